"""Rematerialisation policies by name: what a layer's backward pass keeps from its forward,
and where it keeps it.

A policy is a preset (`POLICIES`) or a selection of the block's named intermediates (`NAMES`):
``save:NAME,...`` keeps those in accelerator memory, ``offload:NAME,...`` moves them to host
memory in the forward and back in the backward, and ``save:...+offload:...`` does both;
everything else is recomputed. The attention scores are never named, so no named policy saves them.
"""

from __future__ import annotations

from jax import checkpoint_policies as cp

from meshtrain import validate
from meshtrain.layout.memory import ACCELERATOR, HOST
from meshtrain.problem import Problem

ATTN_OUT = "attn_out"  # checkpoint_name of the attention output inside a block

# The intermediates a GPT block names (`jax.ad_checkpoint.checkpoint_name`), with their shapes.
NAMES = {
    "attn_in": "the normed input of attention [B, T, D]",
    "qkv": "the q, k and v projections, before RoPE [B, T, H or G, K] each",
    ATTN_OUT: "the attention output, before the o projection [B, T, H, K]",
    "mlp_in": "the normed input of the MLP [B, T, D]",
    "mlp_hidden": "the MLP's hidden activation, before the down projection [B, T, F]",
}

# name -> jax.checkpoint policy; None means "do not remat at all".
POLICIES = {
    "none": None,
    "full": cp.nothing_saveable,
    "save-dots": cp.dots_with_no_batch_dims_saveable,
    "save-attention-out": cp.save_only_these_names(ATTN_OUT),
    "offload-dots": cp.offload_dot_with_no_batch_dims(ACCELERATOR, HOST),
}
_KINDS = ("save", "offload")


def selection(name: str) -> dict[str, tuple[str, ...]]:
    """The names a ``save:...+offload:...`` policy keeps in accelerator memory and moves to host
    (``{"save": (...), "offload": (...)}``); empty for a preset."""
    if name in POLICIES:
        return {}
    chosen: dict[str, tuple[str, ...]] = {kind: () for kind in _KINDS}
    for part in name.split("+"):
        kind, _, names = part.partition(":")
        chosen[kind] = chosen.get(kind, ()) + tuple(n for n in names.split(",") if n)
    return chosen


_SAID = {
    "none": "every activation kept for the backward",
    "full": "each block recomputed in the backward",
    "save-dots": "matmul outputs kept, the rest recomputed",
    "save-attention-out": "the attention output kept, the rest recomputed",
    "offload-dots": "matmul outputs moved to host memory, the rest recomputed",
}


def describe(name: str) -> str:
    """The run summary's part for policy `name`, e.g. ``remat full (each block recomputed in
    the backward)``."""
    if name in _SAID:
        return f"remat {name} ({_SAID[name]})"
    chosen = selection(name)
    kept = [f"{', '.join(chosen[k])} {where}" for k, where in
            (("save", "kept"), ("offload", "moved to host memory")) if chosen.get(k)]  # fmt: skip
    return f"remat {name} ({'; '.join(kept)}; the rest recomputed)"


def policy(name: str):
    """The `jax.checkpoint` policy of a preset or a ``save:``/``offload:`` selection (None: no
    remat)."""
    if name in POLICIES:
        return POLICIES[name]
    chosen = selection(name)
    if not chosen["offload"]:
        return cp.save_only_these_names(*chosen["save"])
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=list(chosen["save"]),
        names_which_can_be_offloaded=list(chosen["offload"]),
        offload_src=ACCELERATOR,
        offload_dst=HOST,
    )


def offloads(name: str) -> bool:
    """Whether the policy moves residuals to host memory."""
    return name == "offload-dots" or bool(selection(name).get("offload"))


def policy_problems(name: str, field: str = "gpt.remat") -> list[Problem]:
    """An unknown preset, or a selection with an unknown kind or name, as one `Problem`."""
    if name in POLICIES or ":" not in name:
        return validate.one_of(
            field, name, POLICIES, example="full",
            note="or save:NAME,... / offload:NAME,... joined by +",
        )  # fmt: skip
    chosen = selection(name)
    wrong = (
        [f"kind {k}" for k in chosen if k not in _KINDS]
        + [f"name {n}" for k in _KINDS for n in chosen[k] if n not in NAMES]
        + [
            f"{n} both saved and offloaded"
            for n in sorted(set(chosen["save"]) & set(chosen["offload"]))
        ]
    )
    if not wrong:
        return []
    return [
        Problem(
            field, name,
            f"{'; '.join(wrong)}: write save:NAME,... and/or offload:NAME,... joined by +, "
            f"NAME from {', '.join(NAMES)} (e.g. save:{ATTN_OUT}+offload:mlp_hidden)",
        )
    ]  # fmt: skip
