"""The flash kernels' argument checks, and the block sizes they tile with."""

from __future__ import annotations

import jax.numpy as jnp

from meshtrain.kernels import _args, _common, autotable
from meshtrain.kernels._flash_tiles import Tiling

HEAD_DIMS = (64, 128)
DTYPES = (jnp.float32, jnp.bfloat16)
CUDNN_DTYPES = (jnp.bfloat16,)  # cuDNN's fused attention has no float32 kernel


def cannot_run(head_dim: int, dtype, *, packed: bool, window=None) -> tuple[str, ...]:
    """The attention impls a call cannot take (what ``"auto"`` leaves out): the kernels off
    their head widths and dtypes; cuDNN off bfloat16, and on packed documents before Hopper
    or with a sliding window."""
    if head_dim not in HEAD_DIMS or jnp.dtype(dtype) not in DTYPES:
        return ("pallas", "cudnn")
    packed_unfit = packed and (window is not None or not _common.hopper_or_later())
    return ("cudnn",) if packed_unfit or jnp.dtype(dtype) not in CUDNN_DTYPES else ()


def validate(q, k, v, impl, causal, window, segment_ids=None):
    """Clear errors for shapes, head widths, dtypes, windows and segment ids the kernels do
    not take."""
    if window is not None and (not causal or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"flash_attention: window={window!r} (causal={causal}) is not supported; a sliding "
            "window is an integer ≥ 1 and needs causal=True"
        )
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"flash_attention: q, k, v must be [batch, seq, heads, head_dim]; got ranks "
            f"{q.ndim}, {k.ndim}, {v.ndim}"
        )
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k {k.shape} and v {v.shape} must have one shape")
    B, T, H, K = q.shape
    if k.shape[0] != B or k.shape[3] != K:
        raise ValueError(
            f"flash_attention: q {q.shape} and k {k.shape} disagree on batch or head_dim"
        )
    if H % k.shape[2]:
        raise ValueError(
            f"flash_attention: {k.shape[2]} key/value heads do not divide {H} query heads"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"flash_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); "
            "cast them to one dtype"
        )
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(
            f"flash_attention: q, k, v are {q.dtype}; attention needs floats, e.g. "
            "q.astype(jnp.float32)"
        )
    if segment_ids is not None:
        if segment_ids.shape != (B, T) or k.shape[1] != T:
            raise ValueError(
                f"flash_attention: segment_ids {segment_ids.shape} must be [batch, seq] = "
                f"{(B, T)} of a self-attention (keys {k.shape[1]}, queries {T})"
            )
        _args.integers("flash_attention", "segment_ids", segment_ids)
        if impl == "cudnn" and window is not None:
            raise ValueError(
                "flash_attention impl='cudnn' takes no sliding window beside segment_ids "
                "(cuDNN's packed layout); use impl='pallas' or 'xla'"
            )
        if impl == "cudnn" and not _common.hopper_or_later():
            raise ValueError(
                "flash_attention impl='cudnn' with segment_ids (packed documents) needs a GPU "
                "of compute capability 9.0 or later (cuDNN's packed layout); use impl='pallas'"
            )
    if impl in ("pallas", "cudnn"):
        if K not in HEAD_DIMS:
            raise ValueError(
                f"flash_attention impl={impl!r}: head_dim={K} is not supported; supported head "
                f"dims are {', '.join(map(str, HEAD_DIMS))} (use impl='xla' for others)"
            )
        if q.dtype not in (CUDNN_DTYPES if impl == "cudnn" else DTYPES):
            raise ValueError(
                f"flash_attention impl={impl!r}: dtype {q.dtype} is not supported; supported "
                + ("dtypes are float32, bfloat16" if impl == "pallas" else "dtype is bfloat16")
            )


def tiling(q, k, causal, window, block_q=None, block_k=None, warps=None, stages=None) -> Tiling:
    """The kernels' tiling of q [B, T, H, K] against k [B, S, G, K]. What is not given comes
    from the configuration tuned on this GPU for the shape (`autotable.flash_config`, which
    the GPU check's sweep writes), else blocks of 64 (shrunk to a power of two ≥ 16 for short
    sequences), 4 or 8 warps by head width and 2 stages."""
    for name, b, low in (("block_q", block_q, 16), ("block_k", block_k, 16), ("warps", warps, 1)):
        _args.power_of_two(
            "flash_attention", name, b, example=4 if name == "warps" else 64, low=low
        )
    _args.whole("flash_attention", "stages", stages, example=2)
    T, S = q.shape[1], k.shape[1]
    tuned = {}
    if _common.on_gpu():
        shape = {"seq": T, "head_dim": q.shape[3], "causal": causal}
        tuned = autotable.flash_config(shape, autotable.device_kind()) or {}
    bq = block_q or min(tuned.get("block_q", 64), max(16, _common.next_pow2(T)))
    bk = block_k or min(tuned.get("block_k", 64), max(16, _common.next_pow2(S)))
    for name, b in (("block_q", bq), ("block_k", bk)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"flash_attention: {name}={b} must be a power of two ≥ 16")
    warps = warps or tuned.get("warps", 0)
    stages = stages or tuned.get("stages", 2)
    return Tiling(causal, window, bq, bk, T, S, warps=warps, stages=stages)


def check_block(q, k, v, q_pos, k_pos, causal, window, q_segments, k_segments):
    """Clear errors for what `block_forward` does not take (beyond `validate`'s)."""
    validate(q, k, v, "pallas", causal, window if causal else None)
    T, S = q.shape[1], k.shape[1]
    if q_pos.shape != (T,) or k_pos.shape != (S,):
        raise ValueError(
            f"flash attention block: positions {q_pos.shape}, {k_pos.shape} must be [{T}] and "
            f"[{S}] (one per query and per key)"
        )
    for name, x in (("q_pos", q_pos), ("k_pos", k_pos)):
        _args.integers("flash attention block", name, x)
    if (q_segments is None) != (k_segments is None):
        raise ValueError("flash attention block: give both q_segments and k_segments, or none")
    if q_segments is not None and (
        q_segments.shape != (q.shape[0], T) or k_segments.shape != (q.shape[0], S)
    ):
        raise ValueError(
            f"flash attention block: segment ids {q_segments.shape}, {k_segments.shape} must "
            f"be [batch, {T}] and [batch, {S}]"
        )
