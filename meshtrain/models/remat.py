"""Rematerialisation policies by name: what a layer's backward pass keeps from its forward."""

from __future__ import annotations

import jax

from meshtrain import validate
from meshtrain.problem import Problem

ATTN_OUT = "attn_out"  # checkpoint_name of the attention output inside a block

# name -> jax.checkpoint policy; None means "do not remat at all".
POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save-dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save-attention-out": jax.checkpoint_policies.save_only_these_names(ATTN_OUT),
}


def policy_problems(name: str, field: str = "gpt.remat") -> list[Problem]:
    """An unknown policy name, as a `Problem` listing the known ones."""
    return validate.one_of(field, name, POLICIES, example="full", note="unknown remat policy")
