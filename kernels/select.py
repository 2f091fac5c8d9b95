"""Choosing kernels from a model config: validation, and what ``"auto"`` runs for the GPT's
attention."""

from __future__ import annotations

import jax.numpy as jnp

from meshtrain.kernels import _common, autotable
from meshtrain.kernels._flash_checks import HEAD_DIMS, cannot_run


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
            f"gpt attention_impl={attention_impl!r} needs a head width (head_dim, or d_model / "
            f"n_heads) of {' or '.join(map(str, HEAD_DIMS))}, got {head_dim}; change head_dim, "
            "d_model or n_heads, or use attention_impl='xla' (or 'auto', which falls back to xla)"
        )


def attention_choice(
    impl: str,
    *,
    head_dim: int,
    dtype=None,
    seq: int = 0,
    causal: bool = True,
    window: int | None = None,
    packed: bool = False,
    context: bool | str = False,
) -> autotable.Choice:
    """The attention the model runs for a setting of ``attention_impl``, and why: a named impl
    as it is; ``"auto"`` as `_common.auto_choice` resolves it for this call, leaving out what
    the call cannot take (`cannot_run`, and cuDNN under context parallelism other than
    Ulysses: `context` is the algorithm, or True for any)."""
    if impl != "auto":
        return autotable.Choice(impl, "set")
    exclude = cannot_run(
        head_dim, jnp.float32 if dtype is None else dtype, packed=packed, window=window
    )
    exclude += ("cudnn",) if context and context != "ulysses" else ()
    shape = {"seq": seq, "head_dim": head_dim, "causal": causal}
    return _common.auto_choice("flash_attention", _common.ATTENTION_IMPLS, shape, exclude)


def model_attention_impl(impl: str, head_dim: int, dtype=None, **call) -> str:
    """`attention_choice`'s impl (``call``: its ``seq``, ``causal``, ``window``, ``packed``,
    ``context``)."""
    return attention_choice(impl, head_dim=head_dim, dtype=dtype, **call).impl


def chosen(
    model,
    *,
    seq_len: int,
    packed: bool = False,
    context: bool | str = False,
    loss_impl: str | None = "xla",
) -> dict[str, autotable.Choice]:
    """What each kernel setting of `model` (a GPT or MoE config; others have none) and the
    loss runs in this run, by op: ``"attention"``, ``"norm"``, ``"loss"``.

    Args:
        model: the model config (``attention_impl``, ``norm_impl`` where it has them).
        seq_len: tokens per sequence.
        packed: packed documents (segment ids) in the batches.
        context: context parallelism (``seq > 1``): its algorithm, or True.
        loss_impl: the cross-entropy setting (`meshtrain.run.TrainConfig.loss_impl`); None
            for a run with another loss.
    """
    shape = getattr(model, "backbone", model)  # an MoE's attention, norms and head
    if not hasattr(shape, "attention_impl"):
        return {}
    out = {
        "attention": attention_choice(
            model.attention_impl, head_dim=shape.head_width, dtype=shape.compute_dtype,
            seq=seq_len, window=shape.sliding_window or None, packed=packed, context=context,
        ),
    }  # fmt: skip
    norm = getattr(model, "norm_impl", "xla")
    kernel = "layer_norm" if shape.style == "gpt2" else "rms_norm"
    out["norm"] = _setting(norm, kernel, {"features": shape.d_model})
    if loss_impl is not None:
        out["loss"] = _setting(loss_impl, "token_cross_entropy", {"vocab": shape.padded_vocab})
    return out


def describe(choices: dict[str, autotable.Choice]) -> str:
    """The run summary's kernel line, e.g. ``kernels: attention cudnn (auto: ...) · norm xla``."""
    parts = [
        f"{op} {c.impl}" + ("" if c.why == "set" else f" (auto: {c.why})")
        for op, c in choices.items()
    ]
    return "kernels: " + " · ".join(parts)


def _setting(impl: str, kernel: str, shape: dict) -> autotable.Choice:
    """A norm or loss setting as it runs: as named, or ``auto`` resolved."""
    if impl != "auto":
        return autotable.Choice(impl, "set")
    return _common.auto_choice(kernel, _common.IMPLS, shape)
