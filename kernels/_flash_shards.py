"""One shard's flash attention: its key/value heads, and its forward and backward kernel calls.

The kernels run per shard (`_common.sharded`: batch over data × fsdp, heads over tensor). With
fewer key/value heads than tensor shards, each shard holds the whole k/v and picks the heads
its query heads use (`local_kv_heads`); the backward sums their gradients back
(`kv_heads_back`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from meshtrain.kernels import _common
from meshtrain.kernels._flash_backward import backward
from meshtrain.kernels._flash_forward import forward
from meshtrain.kernels._flash_operands import pad_operands
from meshtrain.kernels._flash_tiles import F32, Tiling

# The logical names of the kernels' arguments, for `_common.sharded`.
Q_NAMES = ("batch", None, "heads", None)
KV_NAMES = ("batch", None, "kv_heads", None)
LSE_NAMES = ("batch", "heads", None)
SEG_NAMES = ("batch", None)


def local_kv_heads(q_BTHK, k_BSGK, v_BSGK, *, heads: int, axes):
    """This shard's key/value heads, arranged for its query heads (inside a manual region).

    Query head h uses key/value head ``h // R`` (R = H / G). Split over the same axes, each
    shard holds whole groups and its own k/v: nothing to do. When the query heads are split
    and k/v are whole on every shard (the layout replicates ``kv_heads`` that ``tensor`` does
    not divide), shard i holds query heads ``[i·Hl, (i+1)·Hl)`` and picks what they use:

    - the one group's k/v head when the shard's heads all fall in one group (R a multiple of
      Hl: G divides the split, e.g. 8 query and 2 k/v heads on tensor=4): no copy, and the
      kernel runs GQA with all local heads in one group;
    - otherwise (the shard's heads straddle groups unevenly) one k/v head per local query head.

    Picking beats repeating k/v to every query head up front: the kernels read only the k/v
    heads a shard uses. The Pallas backwards pick them again and `kv_heads_back` adds their
    gradients back into the whole heads; cuDNN's reach them through the region's transpose.
    """
    idx = kv_index(q_BTHK, k_BSGK, heads=heads, axes=axes)
    if idx is None:
        return k_BSGK, v_BSGK
    if idx.shape[0] == 1:
        pick = lambda x: lax.dynamic_slice_in_dim(x, idx[0], 1, axis=2)
    else:
        pick = lambda x: jnp.take(x, idx, axis=2)
    return pick(k_BSGK), pick(v_BSGK)


def kv_index(q_BTHK, k_BSGK, *, heads: int, axes):
    """The key/value heads this shard's query heads use (see `local_kv_heads`): None when
    the shard holds its own, else their indices [1] (one group) or [Hl] (one per head)."""
    q_axes, kv_axes = axes.get("heads", ()), axes.get("kv_heads", ())
    if kv_axes == q_axes:
        return None
    if kv_axes:
        raise ValueError(
            f"flash_attention: key/value heads split over {kv_axes} but query heads over "
            f"{q_axes or 'nothing'}; split kv_heads over the axes heads use, or not at all"
        )
    G, Hl = k_BSGK.shape[2], q_BTHK.shape[2]
    R = heads // G
    first = lax.axis_index(q_axes) * Hl  # this shard's first query head
    if R % Hl == 0:
        return (first // R)[None]
    return (first + jnp.arange(Hl)) // R


def kv_heads_back(q_BTHK, k_BSGK, d_BSGK, *, heads: int, axes):
    """The transpose of `local_kv_heads` (inside the kernels' manual region): the gradients
    `d_BSGK` of the key/value heads this shard picked, put back among all of `k_BSGK`'s heads
    in float32 and summed over the query heads' axes (every shard holds the whole k/v)."""
    idx = kv_index(q_BTHK, k_BSGK, heads=heads, axes=axes)
    if idx is None:
        return d_BSGK
    full = jnp.zeros(k_BSGK.shape, F32).at[:, :, idx].add(d_BSGK.astype(F32))
    return lax.psum(full, axes["heads"])


def forward_shard(
    t: Tiling, q, k, v, *, heads, axes, interpret, out_dtype=None, segments=None, positions=None
):
    """One shard's ``(out [B, T, H, K], logsumexp [B, H, T])``.

    The arguments are `backward_shard`'s; the output is in `out_dtype` (default: the input
    dtype).
    """
    k, v = local_kv_heads(q, k, v, heads=heads, axes=axes)
    qp, kp, vp, extra = pad_operands(t, q, k, v, segments, positions)
    o, lse = forward(qp, kp, vp, extra, t, interpret=interpret, out_dtype=out_dtype)
    return o[:, : t.seq_q], lse[:, :, : t.seq_q]


def backward_shard(
    t: Tiling, q, k, v, do, lse, *, delta=None, o=None, heads, axes, interpret,
    grad_dtype=None, segments=None, positions=None,
):  # fmt: skip
    """One shard's ``(dq, dk, dv)``, dk and dv for all of `k`'s heads (see `kv_heads_back`).

    Args:
        t: the tiling.
        q, k, v: this shard's inputs, unpadded.
        do: the output's cotangent, like q.
        lse: the logsumexp [B, H, T].
        delta: ``rowsum(out · do)`` [B, H, T]; None: computed from `o`.
        o: the output, like q (only without `delta`).
        heads, axes: the query heads in all, and the shard's axes (`_common.sharded`).
        interpret: run the kernels interpreted.
        grad_dtype: the kernels' gradient dtype (default: their inputs' dtypes).
        segments: None, or the query and key segment ids [B, T] and [B, S].
        positions: None, or the query and key positions [T] and [S].

    Returns:
        ``(dq [B, T, H, K], dk [B, S, G, K], dv [B, S, G, K])``.
    """
    kl, vl = local_kv_heads(q, k, v, heads=heads, axes=axes)
    qp, kp, vp, extra = pad_operands(t, q, kl, vl, segments, positions)
    Tp = t.padded_q
    dop = _common.pad_to(do, 1, Tp)
    lsep = _common.pad_to(lse, 2, Tp)  # padded rows have do = 0: they add nothing
    if delta is None:
        op = _common.pad_to(o, 1, Tp)
        deltap = jnp.einsum("bthk,bthk->bht", op.astype(F32), dop.astype(F32))
    else:
        deltap = _common.pad_to(delta, 2, Tp)
    dq, dk, dv = backward(
        qp, kp, vp, dop, lsep, deltap, extra, t, interpret=interpret, grad_dtype=grad_dtype
    )
    back = functools.partial(kv_heads_back, q, k, heads=heads, axes=axes)
    return dq[:, : t.seq_q], back(dk[:, : t.seq_k]), back(dv[:, : t.seq_k])
