"""The two algorithms that move whole sequences: all-gather of keys/values, and Ulysses
(all-to-all from sequence-split to head-split and back). Both run inside a region manual over
the sequence axis. With ``impl="xla"`` they are differentiated by autodiff (the transpose of an
all-gather is a reduce-scatter, of an all-to-all the reverse all-to-all); with
``impl="pallas"`` the flash kernel may not be differentiated inside that region, so each has a
custom VJP that spells the same transposes out: the forward runs one block over the gathered
keys/values and keeps its log-sum-exp, the backward runs `blocks.grads` over them.

Packed documents: the keys' segment ids are gathered with them (all-gather: the local
queries' segments against the whole sequence's; Ulysses: the whole sequence's on both sides).

Shape suffixes as in `blocks`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain.context_parallel import blocks
from meshtrain.kernels import flash_attention
from meshtrain.layout.per_shard import typed_like


def _gather(x, axis: str, dim: int):
    """Every device's block of `x` along `dim`, concatenated over `axis`."""
    return lax.all_gather(x, axis, axis=dim, tiled=True)


def _either(fwd, vjp, args):
    """The jnp blocks through `fwd` (its output; autodiff differentiates it), a kernel through
    `vjp` (its backward spelled out)."""
    opts = args[-1]
    blocks.check_impl(opts.impl)
    return fwd(*args)[0] if opts.impl == "xla" else vjp(*args)


def _segments(q_segments, k_segments, caller: str):
    """The segment ids as one argument: None, or the pair (query's, keys')."""
    if (q_segments is None) != (k_segments is None):
        raise ValueError(f"{caller}: give both q_segments and k_segments, or neither")
    return None if q_segments is None else (q_segments, k_segments)


def _segment_kw(q_seg, k_seg) -> dict:
    """The block functions' segment keywords (none without segments)."""
    return {} if q_seg is None else {"q_segments": q_seg, "k_segments": k_seg}


def _gathered_segments(segs, axis: str, *, queries: bool):
    """(query's, keys') segment ids with the keys' gathered over `axis` (and the queries'
    too when `queries`); (None, None) without segments."""
    if segs is None:
        return None, None
    q_seg, k_seg = segs
    return (_gather(q_seg, axis, 1) if queries else q_seg), _gather(k_seg, axis, 1)


def allgather(
    q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, axis, opts, *, q_segments=None, k_segments=None
):  # fmt: skip
    """This device's queries against every device's keys, gathered over `axis`.

    Args: as `ring.ring`.

    Returns:
        [B, T, H, K] in the dtype of `v_BSGK`.
    """
    segs = _segments(q_segments, k_segments, "allgather")
    blocks.check_impl(opts.impl)
    # Every block impl takes the spelled-out backward: it sums the keys' gradients over `axis`
    # in float32 (autodiff would reduce them in the inputs' dtype, and XLA's CPU compiler
    # aborts on that bfloat16 reduce-scatter).
    return _allgather_vjp(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, segs, axis, opts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _allgather_vjp(q, k, v, q_pos, k_pos, segs, axis, opts):
    """`allgather` with its backward spelled out."""
    return _allgather_fwd(q, k, v, q_pos, k_pos, segs, axis, opts)[0]


def _allgather_fwd(q, k, v, q_pos, k_pos, segs, axis, opts):
    k_all, v_all = (_gather(x, axis, 1) for x in (k, v))
    q_seg, k_seg_all = _gathered_segments(segs, axis, queries=False)
    o, lse = blocks.attend(
        q, k_all, v_all, q_pos, _gather(k_pos, axis, 0), opts, **_segment_kw(q_seg, k_seg_all)
    )
    o = o.astype(v.dtype)
    # Only this device's k/v are kept: the backward gathers them again rather than hold
    # the whole sequence's between the passes.
    return o, (q, k, v, q_pos, k_pos, segs, o, lse)


def _allgather_bwd(axis, opts, res, do_BTHK):
    q, k, v, q_pos, k_pos, segs, o, lse_BGRT = res
    k_all, v_all = (_gather(x, axis, 1) for x in (k, v))
    q_seg, k_seg_all = _gathered_segments(segs, axis, queries=False)
    delta_BGRT = blocks.delta(o, do_BTHK, k.shape[2])
    dq, dk_all, dv_all = blocks.grads(
        q, k_all, v_all, q_pos, _gather(k_pos, axis, 0), (do_BTHK, lse_BGRT, delta_BGRT), opts,
        **_segment_kw(q_seg, k_seg_all),
    )  # fmt: skip
    # Each device's queries touched every key: the owners sum the contributions.
    dk, dv = (lax.psum_scatter(x, axis, scatter_dimension=1, tiled=True) for x in (dk_all, dv_all))
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    return (*typed_like(grads, (q, k, v)), None, None, None)


_allgather_vjp.defvjp(_allgather_fwd, _allgather_bwd)


def _to_heads(x, axis: str):
    """[B, T/n, H, K] per device → [B, T, H/n, K]: the sequence whole, the heads split."""
    return lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def _to_sequence(x, axis: str):
    """The inverse of `_to_heads`."""
    return lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def ulysses(
    q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, axis, opts, *, q_segments=None, k_segments=None
):  # fmt: skip
    """Attention with the heads split over `axis` instead of the sequence (DeepSpeed Ulysses).

    An all-to-all turns each device's [B, T/n, H, K] into [B, T, H/n, K]; attention runs over
    the whole sequence for its heads; a second all-to-all turns the result back. Key/value
    heads that `axis` does not divide are repeated to one per query head first.

    Args: as `ring.ring`; the query heads must be divisible by the size of `axis`.

    Returns:
        [B, T, H, K] in the dtype of `v_BSGK`.
    """
    segs = _segments(q_segments, k_segments, "ulysses")
    args = (q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, segs, axis, opts)
    return _either(_ulysses_fwd, _ulysses_vjp, args)


def ulysses_cudnn(
    q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, axis, opts, *, q_segments=None, k_segments=None
):  # fmt: skip
    """`ulysses` with cuDNN's fused attention on each device's heads. cuDNN masks by index,
    not by position, so the whole sequence is put in position order for the call and back in
    the layout's order after it: the positions must be one sequence's (self-attention, the
    query's and the keys' the same permutation of 0..T−1, as a balanced layout has them).
    Differentiated by autodiff: the all-to-alls', the reorders' and, per shard, cuDNN's own
    backward (`meshtrain.kernels._shard_vjp`)."""
    segs = _segments(q_segments, k_segments, "ulysses")
    r = _repeats(q_BTHK.shape[2], k_BSGK.shape[2], axis)
    k_r, v_r = (x if r == 1 else jnp.repeat(x, r, axis=2) for x in (k_BSGK, v_BSGK))
    q_h, k_h, v_h = (_to_heads(x, axis) for x in (q_BTHK, k_r, v_r))
    pos_all = _gather(q_pos_T, axis, 0)  # the layout's order: entry i holds position pos_all[i]
    natural = jnp.argsort(pos_all)  # natural[p]: where position p sits in the layout
    seg = None if segs is None else _gather(segs[0], axis, 1)[:, natural]
    o_n = flash_attention(
        *(x[:, natural] for x in (q_h, k_h, v_h)), causal=opts.causal, window=opts.window,
        impl="cudnn", segment_ids=seg,
    )  # fmt: skip
    return _to_sequence(o_n[:, pos_all].astype(v_BSGK.dtype), axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _ulysses_vjp(q, k, v, q_pos, k_pos, segs, axis, opts):
    """`ulysses` with its backward spelled out (for block impls autodiff may not enter)."""
    return _ulysses_fwd(q, k, v, q_pos, k_pos, segs, axis, opts)[0]


def _repeats(H: int, G: int, axis: str) -> int:
    """How many times each key/value head is repeated before the all-to-all (1: none)."""
    return H // G if G % lax.axis_size(axis) else 1


def _ulysses_fwd(q, k, v, q_pos, k_pos, segs, axis, opts):
    r = _repeats(q.shape[2], k.shape[2], axis)
    k_r, v_r = (x if r == 1 else jnp.repeat(x, r, axis=2) for x in (k, v))
    q_h, k_h, v_h = (_to_heads(x, axis) for x in (q, k_r, v_r))
    q_pos_all, k_pos_all = _gather(q_pos, axis, 0), _gather(k_pos, axis, 0)
    seg_all = _gathered_segments(segs, axis, queries=True)
    o_h, lse = blocks.attend(q_h, k_h, v_h, q_pos_all, k_pos_all, opts, **_segment_kw(*seg_all))
    o_h = o_h.astype(v.dtype)
    res = (q, k, v, q_h, k_h, v_h, q_pos_all, k_pos_all, seg_all, o_h, lse)
    return _to_sequence(o_h, axis), res


def _ulysses_bwd(axis, opts, res, do_BTHK):
    q, k, v, q_h, k_h, v_h, q_pos_all, k_pos_all, seg_all, o_h, lse_BGRT = res
    do_h = _to_heads(do_BTHK, axis)
    delta_BGRT = blocks.delta(o_h, do_h, k_h.shape[2])
    dq_h, dk_h, dv_h = blocks.grads(
        q_h, k_h, v_h, q_pos_all, k_pos_all, (do_h, lse_BGRT, delta_BGRT), opts,
        **_segment_kw(*seg_all),
    )  # fmt: skip
    dq, dk, dv = (_to_sequence(x, axis) for x in (dq_h, dk_h, dv_h))
    r = _repeats(q.shape[2], k.shape[2], axis)
    if r > 1:  # the transpose of the repeat: each key/value head's copies summed
        B, S, G, K = k.shape
        dk, dv = (x.reshape(B, S, G, r, K).sum(axis=3) for x in (dk, dv))
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    return (*typed_like(grads, (q, k, v)), None, None, None)


_ulysses_vjp.defvjp(_ulysses_fwd, _ulysses_bwd)
