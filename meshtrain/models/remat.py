"""Rematerialisation policies by name: what a layer's backward pass keeps from its forward."""

from __future__ import annotations

import jax

ATTN_OUT = "attn_out"  # checkpoint_name of the attention output inside a block

# name -> jax.checkpoint policy; None means "do not remat at all".
POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save-dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save-attention-out": jax.checkpoint_policies.save_only_these_names(ATTN_OUT),
}


def check_policy(name: str) -> str:
    """Returns `name` if it is a known policy, else raises a ValueError listing them."""
    if name not in POLICIES:
        raise ValueError(
            f"gpt remat={name!r}: unknown remat policy; choose from {', '.join(POLICIES)}"
        )
    return name
