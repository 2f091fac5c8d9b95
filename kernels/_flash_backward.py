"""The flash backward: a dq kernel over key blocks and a dk/dv kernel over query blocks.

Both recompute each tile's probabilities from the saved logsumexp, so nothing of size
``T × S`` is ever stored. dk and dv come out per query head and are summed over each group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.kernels._flash_operands import launch
from meshtrain.kernels._flash_tiles import (
    F32,
    MaskInputs,
    Tiling,
    dot,
    dot_nt,
    dot_tn,
    softmax_scale,
    sweep,
)


def recompute(q, k, v, do, lse, delta, ok, scale):
    """A tile's probabilities from the logsumexp, and its score gradients ``p · (do vᵀ − δ)``."""
    p = jnp.where(ok, jnp.exp(dot_nt(q, k) * scale - lse[:, None]), 0.0)
    return p, p * (dot_nt(do, v) - delta[:, None])


def dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, extra, dq_ref, *, t: Tiling):
    """One query tile's dq, from the key blocks it sees."""
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    scale = softmax_scale(q_ref.shape[-1])

    def step(kv, ok, dq):
        k, v = kv
        _, ds = recompute(q, k, v, do, lse, delta, ok, scale)
        return dq + dot(ds.astype(k.dtype), k)

    dq = sweep(t, extra, (k_ref, v_ref), step, jnp.zeros(q.shape, F32), over_keys=True)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, extra, dk_ref, dv_ref, *, t):
    """One key tile's dk and dv (for one query head), from the query blocks that see it."""
    k, v = k_ref[...], v_ref[...]
    scale = softmax_scale(q_ref.shape[-1])

    def step(rows, ok, carry):
        q, do, lse, delta = rows
        dk, dv = carry
        p, ds = recompute(q, k, v, do, lse, delta, ok, scale)
        dv = dv + dot_tn(p.astype(do.dtype), do)
        dk = dk + dot_tn(ds.astype(q.dtype), q)
        return dk, dv

    zeros = jnp.zeros(k.shape, F32)
    refs = (q_ref, do_ref, lse_ref, delta_ref)
    dk, dv = sweep(t, extra, refs, step, (zeros, zeros), over_keys=False)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(
    q, k, v, do, lse, delta, extra: MaskInputs, t: Tiling, *, interpret: bool, grad_dtype=None
):
    """Runs the dq kernel and the dk/dv kernel on padded arrays (see `pad_operands`).

    Args:
        q, k, v, extra: as `forward` took them.
        do: the output's cotangent [B, Tp, H, K].
        lse, delta: the logsumexp and ``rowsum(out · do)``, [B, H, Tp] float32.
        t: the tiling.
        interpret: run the kernels interpreted.
        grad_dtype: the gradients' dtype (default: their inputs' dtypes).

    Returns:
        ``(dq, dk, dv)``, padded like q, k, v.
    """
    B, _, H, K = q.shape
    Sp, G = k.shape[1], k.shape[2]
    inputs = (q, k, v, do, lse, delta)
    dq = launch(
        dq_kernel,
        t,
        inputs,
        ("q_tile", "kv_all", "kv_all", "q_tile", "row_tile", "row_tile"),
        extra,
        outs="q_tile",
        out_shape=jax.ShapeDtypeStruct(q.shape, grad_dtype or q.dtype),
        over_queries=True,
        interpret=interpret,
        name="flash_attention_dq",
    )
    # dk and dv come out per query head in float32 and are summed over each group outside.
    dkh, dvh = launch(
        dkv_kernel,
        t,
        inputs,
        ("q_all", "kv_tile", "kv_tile", "q_all", "row_all", "row_all"),
        extra,
        outs=["kvh_tile", "kvh_tile"],
        out_shape=[jax.ShapeDtypeStruct((B, Sp, H, K), F32)] * 2,
        over_queries=False,
        interpret=interpret,
        name="flash_attention_dkv",
    )
    R = H // G
    dk = dkh.reshape(B, Sp, G, R, K).sum(axis=3).astype(grad_dtype or k.dtype)
    dv = dvh.reshape(B, Sp, G, R, K).sum(axis=3).astype(grad_dtype or v.dtype)
    return dq, dk, dv
