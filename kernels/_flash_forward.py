"""The flash forward kernel: an online softmax over key blocks that also saves the logsumexp.

Each grid cell holds one ``[block_q, head_dim]`` query tile and its float32 accumulator, and
writes the output tile and the tile's ``[block_q]`` logsumexp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.kernels._flash_operands import launch
from meshtrain.kernels._flash_tiles import (
    F32,
    NEG,
    MaskInputs,
    Tiling,
    dot,
    dot_nt,
    softmax_scale,
    sweep,
)


def forward_kernel(q_ref, k_ref, v_ref, extra, o_ref, lse_ref, *, t: Tiling):
    """One query tile's output and logsumexp, from the key blocks it sees."""
    q = q_ref[...]
    scale = softmax_scale(q_ref.shape[-1])

    def step(kv, ok, carry):
        k, v = kv
        acc, m, denom = carry
        s = jnp.where(ok, dot_nt(q, k) * scale, NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        denom = denom * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
        return acc, m_new, denom

    init = (
        jnp.zeros((t.bq, q_ref.shape[-1]), F32),
        jnp.full((t.bq,), NEG, F32),
        jnp.zeros((t.bq,), F32),
    )
    acc, m, denom = sweep(t, extra, (k_ref, v_ref), step, init, over_keys=True)
    # Rows with no visible key (padding, or a block wholly masked by positions) get an output
    # of 0 and a logsumexp of NEG, which a merge of partial results weighs 0.
    denom = jnp.where(denom == 0.0, 1.0, denom)
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(denom)


def forward(q, k, v, extra: MaskInputs, t: Tiling, *, interpret: bool, out_dtype=None):
    """Runs the forward kernel on padded q, k, v and mask inputs (see `pad_operands`).

    Returns:
        ``(out [B, Tp, H, K], logsumexp [B, H, Tp] float32)``; the output in `out_dtype`
        (default: the input dtype).
    """
    B, Tp, H, K = q.shape
    return launch(
        forward_kernel,
        t,
        (q, k, v),
        ("q_tile", "kv_all", "kv_all"),
        extra,
        outs=["q_tile", "row_tile"],
        out_shape=[
            jax.ShapeDtypeStruct((B, Tp, H, K), out_dtype or q.dtype),
            jax.ShapeDtypeStruct((B, H, Tp), F32),
        ],
        over_queries=True,
        interpret=interpret,
        name="flash_attention_fwd",
    )
