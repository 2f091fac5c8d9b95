"""Choosing kernels from a model config: validation and what ``"auto"`` means for the GPT."""

from __future__ import annotations

import jax.numpy as jnp

from meshtrain.kernels import _common
from meshtrain.kernels.attention import DTYPES, HEAD_DIMS


def check_impls(attention_impl: str, norm_impl: str, head_dim: int) -> None:
    """Raises a clear ValueError for an unknown impl or an attention kernel the head width
    cannot use; called from `GPTConfig.__post_init__`, before anything is traced."""
    for field, value, allowed in (
        ("attention_impl", attention_impl, _common.ATTENTION_IMPLS),
        ("norm_impl", norm_impl, _common.IMPLS),
    ):
        if value not in allowed:
            raise ValueError(f"gpt {field}={value!r}: choose from {', '.join(allowed)}")
    if attention_impl in ("pallas", "cudnn") and head_dim not in HEAD_DIMS:
        raise ValueError(
            f"gpt attention_impl={attention_impl!r} needs a head width (d_model / n_heads) of "
            f"{' or '.join(map(str, HEAD_DIMS))}, got {head_dim}; change d_model or n_heads, "
            "or use attention_impl='xla' (or 'auto', which falls back to xla)"
        )


def model_attention_impl(impl: str, head_dim: int, dtype=None) -> str:
    """The attention impl the GPT runs: ``"auto"`` is Pallas on a GPU for a supported head
    width and dtype (float32, bfloat16), and the jnp path (`layers.causal_attention`)
    otherwise."""
    if impl != "auto":
        return impl
    supported = dtype is None or jnp.dtype(dtype) in DTYPES
    return "pallas" if _common.on_gpu() and head_dim in HEAD_DIMS and supported else "xla"
