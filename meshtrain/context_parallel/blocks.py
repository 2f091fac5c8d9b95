"""Attention of a block of queries against a block of keys at given global positions, with its
log-sum-exp, and the merge of partial results: the per-step math every algorithm shares.

Shape suffixes: B batch, T query positions, S key positions, H query heads, G key/value heads,
R = H // G, K head width.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshtrain.kernels import attention as flash

NEG = -1e30  # a masked score: finite, so a block that sees no key keeps finite results
_F32 = jnp.float32


def visible(q_pos_T: jax.Array, k_pos_S: jax.Array, *, causal: bool, window: int | None):
    """[T, S] mask of the keys each query sees, from global positions (None: all)."""
    if not causal:
        return None
    gap_TS = q_pos_T[:, None] - k_pos_S[None, :]
    ok_TS = gap_TS >= 0
    return ok_TS if window is None else ok_TS & (gap_TS < window)


def mask(q_pos_T, k_pos_S, opts, q_seg_BT=None, k_seg_BS=None):
    """The keys each query sees: `visible` by position, and with segment ids ([B, T] and
    [B, S]) only keys of the query's own segment; [T, S], [B, 1, 1, T, S] (broadcasting over
    the scores' [B, G, R, T, S]) or None (all)."""
    ok_TS = visible(q_pos_T, k_pos_S, causal=opts.causal, window=opts.window)
    if q_seg_BT is None:
        return ok_TS
    ok_BTS = q_seg_BT[:, :, None] == k_seg_BS[:, None, :]
    if ok_TS is not None:
        ok_BTS = ok_BTS & ok_TS
    return ok_BTS[:, None, None]


def scores(q_BTHK: jax.Array, k_BSGK: jax.Array, ok_TS) -> jax.Array:
    """Scaled, masked scores [B, G, R, T, S] in float32 (`ok_TS`: a `mask`, or None)."""
    B, T, H, K = q_BTHK.shape
    G = k_BSGK.shape[2]
    q_BTGRK = q_BTHK.reshape(B, T, G, H // G, K)
    s = jnp.einsum("btgrk,bsgk->bgrts", q_BTGRK, k_BSGK, preferred_element_type=_F32)
    s = s / math.sqrt(K)
    return s if ok_TS is None else jnp.where(ok_TS, s, NEG)


# How one block is computed: "xla", the jnp math below; "pallas", the flash-attention kernel
# with global positions (`kernels.attention.block_forward` / `block_backward`; interpreted off
# the GPU), for head widths 64 and 128 in float32 or bfloat16. The kernel runs per shard under
# the active layout and must not be differentiated: the algorithms call it inside custom-VJP
# rules only.
IMPLS = ("xla", "pallas")


LEAF = 128  # the half-work own block halves its diagonals while the halves keep ≥ LEAF rows


class Options(NamedTuple):
    """How attention is computed, block by block: the causal mask, its sliding window (keys
    (t − window, t] with `causal`; None: all earlier), the block impl (`IMPLS`), and for the
    ring whether it computes only the causally visible half of each block (`halve`: exact only
    for causal attention on the zig-zag positions, see `ring.for_positions`) and the fewest
    rows a halved diagonal keeps (`leaf`)."""

    causal: bool = True
    window: int | None = None
    impl: str = "xla"
    halve: bool = False
    leaf: int = LEAF


def attend(
    q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, opts: Options, *, q_segments=None,
    k_segments=None,
):  # fmt: skip
    """Softmax attention of one block: ``(out [B, T, H, K] float32, lse [B, G, R, T] float32)``.

    A query that sees no key of the block gets an lse near `NEG`, so merging weighs it 0
    (its output is 0 with ``impl="pallas"``, the mean of the values with ``"xla"``: either
    weighs nothing). `opts` gives the mask and how the block is computed; `q_segments` and
    `k_segments` ([B, T] and [B, S] integers, both or neither) keep each query to keys of its
    own segment (packed documents).
    """
    causal, window, impl = opts.causal, opts.window, opts.impl
    check_impl(impl)
    if impl == "pallas":
        return flash.block_forward(
            q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, causal=causal, window=window,
            q_segments=q_segments, k_segments=k_segments,
        )  # fmt: skip
    B, T, H, K = q_BTHK.shape
    s_BGRTS = scores(q_BTHK, k_BSGK, mask(q_pos_T, k_pos_S, opts, q_segments, k_segments))
    lse_BGRT = jax.nn.logsumexp(s_BGRTS, axis=-1)
    p_BGRTS = jnp.exp(s_BGRTS - lse_BGRT[..., None])
    o = jnp.einsum(
        "bgrts,bsgk->btgrk", p_BGRTS.astype(v_BSGK.dtype), v_BSGK, preferred_element_type=_F32
    )
    return o.reshape(B, T, H, K), lse_BGRT


def merge(o_a, lse_a, o_b, lse_b):
    """Two partial softmax results over disjoint key sets → the result over their union."""
    lse = jnp.logaddexp(lse_a, lse_b)
    w_a = _per_query(jnp.exp(lse_a - lse), o_a.shape)
    w_b = _per_query(jnp.exp(lse_b - lse), o_a.shape)
    return o_a * w_a + o_b * w_b, lse


def _per_query(w_BGRT: jax.Array, shape) -> jax.Array:
    """[B, G, R, T] weights → [B, T, H, 1] to scale an output."""
    B, T, H, _ = shape
    return jnp.moveaxis(w_BGRT, 3, 1).reshape(B, T, H, 1)


def delta(o_BTHK, do_BTHK, groups: int) -> jax.Array:
    """``rowsum(o · do)`` [B, G, R, T] float32: the softmax backward's per-query term."""
    B, T, H, K = o_BTHK.shape
    shape = (B, T, groups, H // groups, K)
    o, do = (x.astype(_F32).reshape(shape) for x in (o_BTHK, do_BTHK))
    return jnp.einsum("btgrk,btgrk->bgrt", do, o)


def grads(
    q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, upstream, opts: Options, *, q_segments=None,
    k_segments=None,
):  # fmt: skip
    """One block's contributions to the gradients, from ``upstream = (do [B, T, H, K], lse
    [B, G, R, T], delta [B, G, R, T])`` (the output's cotangent and the whole attention's lse
    and `delta`): ``(dq [B, T, H, K], dk [B, S, G, K], dv [B, S, G, K])``, all float32;
    segments as `attend`'s."""
    do_BTHK, lse_BGRT, delta_BGRT = upstream
    causal, window, impl = opts.causal, opts.window, opts.impl
    check_impl(impl)
    if impl == "pallas":
        return flash.block_backward(
            q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, do_BTHK, lse_BGRT, delta_BGRT,
            causal=causal, window=window, q_segments=q_segments, k_segments=k_segments,
        )  # fmt: skip
    B, T, H, K = q_BTHK.shape
    G = k_BSGK.shape[2]
    do_BTGRK = do_BTHK.astype(_F32).reshape(B, T, G, H // G, K)
    q_BTGRK = q_BTHK.astype(_F32).reshape(B, T, G, H // G, K)
    ok = mask(q_pos_T, k_pos_S, opts, q_segments, k_segments)
    p_BGRTS = jnp.exp(scores(q_BTHK, k_BSGK, ok) - lse_BGRT[..., None])
    if ok is not None:
        p_BGRTS = jnp.where(ok, p_BGRTS, 0.0)
    dv = jnp.einsum("bgrts,btgrk->bsgk", p_BGRTS, do_BTGRK)
    dp_BGRTS = jnp.einsum("btgrk,bsgk->bgrts", do_BTGRK, v_BSGK.astype(_F32))
    ds_BGRTS = p_BGRTS * (dp_BGRTS - delta_BGRT[..., None]) / math.sqrt(K)
    dq = jnp.einsum("bgrts,bsgk->btgrk", ds_BGRTS, k_BSGK.astype(_F32))
    dk = jnp.einsum("bgrts,btgrk->bsgk", ds_BGRTS, q_BTGRK)
    return dq.reshape(B, T, H, K), dk, dv


def check_impl(impl: str) -> None:
    """Raises for a block `impl` that is not one of `IMPLS`."""
    if impl not in IMPLS:
        raise ValueError(f"context-parallel block impl={impl!r}: choose from {', '.join(IMPLS)}")
