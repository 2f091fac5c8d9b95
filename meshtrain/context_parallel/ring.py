"""Ring attention over one manual mesh axis, with a custom VJP.

Each device keeps its queries and passes its key/value block (with the blocks' global positions)
around the ring with ``ppermute``; after n steps every query has met every key, and the
partial results merge by their log-sum-exp (`blocks.merge`). The backward runs the ring again:
the key/value blocks travel with their gradient accumulators, each device adds the
contribution of its queries, and after n hops the accumulators are home.

Why a custom VJP rather than autodiff of the ring: autodiff keeps every step's probabilities
(n blocks of [T/n, T/n] scores per layer, the same [T/n, T] as gathering all keys), while the
custom backward keeps only q, k, v, the output and the log-sum-exp, and recomputes each
step's scores. The Context parallelism guide gives the compiled memory of both.

Half work (``Options(halve=True)``, causal attention on the zig-zag layout only): each hop
computes the half of the block that the causal mask leaves visible, as two [T/2n, T/2n] pieces whose
offsets follow from the device index and the hop (`zigzag.step_groups`), and the own block
skips its masked quarter and most of its two diagonals (`zigzag.own_groups`). Every piece is
one call of `blocks.attend` (forward) or `blocks.grads` (backward) on static-shaped slices,
so no step keeps a second branch's buffers. `for_positions` decides when halving is exact.

Packed documents: the queries' segment ids stay home and the keys' travel around the ring
with their block (tiny int32 [B, T/n]); each step masks by segment as well as by position.
Segments only remove pairs, so the half-work plan (which skips only pieces the causal mask
hides) stays exact with them.

Shape suffixes as in `blocks`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain.context_parallel import blocks, zigzag
from meshtrain.context_parallel.blocks import Options
from meshtrain.context_parallel.zigzag import Piece
from meshtrain.layout import manual_axes
from meshtrain.mesh import PIPE

LEAF = blocks.LEAF  # the half-work own block halves its diagonals while halves keep ≥ LEAF rows


def _shift(x, axis: str, n: int):
    """Sends each device's block to the next device on the ring.

    One exception, on the CPU only: inside a pipeline stage the ring may run in a branch only
    some stages take (a slot of 1f1b or zb-h1), and XLA's CPU runtime runs a
    collective-permute only when every device of the program takes part (it hangs, or pairs
    calls of different slots). There each device gathers the ring's blocks over `axis`, whose
    groups lie within one stage, and keeps its neighbour's: the same values for n times the
    traffic, on simulated devices only (the program lowered for a GPU permutes).
    """
    if x is None:
        return None
    permuted = functools.partial(
        lax.ppermute, axis_name=axis, perm=[(j, (j + 1) % n) for j in range(n)]
    )
    if PIPE not in manual_axes() or lax.axis_size(PIPE) == 1:
        return permuted(x)

    def gathered(x):
        return lax.all_gather(x, axis)[(lax.axis_index(axis) - 1) % n]

    return lax.platform_dependent(x, cpu=gathered, default=permuted)


def _whole(rows: int) -> list[tuple[Piece, ...]]:
    """The whole block as one piece."""
    return [(Piece(0, 0, rows, rows),)]


def _plans(rows: int, halve: bool, leaf: int):
    """(the own block's groups, a function (i, j) → one hop's groups)."""
    if not halve:
        return _whole(rows), lambda i, j: _whole(rows)
    c = rows // 2
    return zigzag.own_groups(c, leaf), lambda i, j: zigzag.step_groups(i, j, c)


def _rows(x, start, size: int, axis: int):
    """Rows [start, start + size) of `x` along `axis` (the whole of `x` when size spans it)."""
    return x if size == x.shape[axis] else lax.dynamic_slice_in_dim(x, start, size, axis)


def _stacked(x, starts, size: int, axis: int):
    """The slices [s, s + size) along `axis`, one per start, stacked on the batch axis (0)."""
    parts = [_rows(x, s, size, axis) for s in starts]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _add_rows(acc, x, start, axis: int):
    """`acc` with `x` added at rows [start, start + len) along `axis`."""
    if x.shape[axis] == acc.shape[axis]:
        return acc + x
    part = _rows(acc, start, x.shape[axis], axis) + x
    return lax.dynamic_update_slice_in_dim(acc, part, start, axis)


def _merge_rows(o, lse, o_p, lse_p, start):
    """The running (o, lse) with a piece's (o_p, lse_p) merged into the query rows from
    `start`."""
    rows = o_p.shape[1]
    if rows == o.shape[1]:
        return blocks.merge(o, lse, o_p, lse_p)
    o_r, lse_r = blocks.merge(_rows(o, start, rows, 1), _rows(lse, start, rows, 3), o_p, lse_p)
    o = lax.dynamic_update_slice_in_dim(o, o_r, start, 1)
    return o, lax.dynamic_update_slice_in_dim(lse, lse_r, start, 3)


def _unstack(x, count: int):
    """The `count` equal parts of `x` along the batch axis (inverse of `_stacked`)."""
    return [x] if count == 1 else jnp.split(x, count, axis=0)


def _piece_segments(q_seg, k_seg, qs, ks, nq: int, nk: int) -> dict:
    """The segment-id keywords of one group's block call: the pieces' query and key segment
    ids stacked like their q and k (none without segments)."""
    if q_seg is None:
        return {}
    return {"q_segments": _stacked(q_seg, qs, nq, 1), "k_segments": _stacked(k_seg, ks, nk, 1)}


def _attend_groups(groups, q, k, v, q_pos, k_pos, acc, block, segs=(None, None)):
    """``acc = (o, lse)`` with every piece of `groups` attended and merged in; (None, None)
    start from the first group, which must then be one piece spanning the block; `segs` the
    (query's, keys') segment ids or Nones."""
    (o, lse), (q_seg, k_seg) = acc, segs
    for group in groups:
        first, nq, nk = group[0], group[0].nq, group[0].nk
        qs, ks = [p.q for p in group], [p.k for p in group]
        o_g, lse_g = block(
            _stacked(q, qs, nq, 1), _stacked(k, ks, nk, 1), _stacked(v, ks, nk, 1),
            _rows(q_pos, first.q, nq, 0), _rows(k_pos, first.k, nk, 0),
            **_piece_segments(q_seg, k_seg, qs, ks, nq, nk),
        )  # fmt: skip
        parts = zip(group, _unstack(o_g, len(group)), _unstack(lse_g, len(group)), strict=True)
        for p, o_p, lse_p in parts:
            if o is None:
                o, lse = o_p, lse_p  # the whole-block plan: one piece spanning the block
            else:
                o, lse = _merge_rows(o, lse, o_p, lse_p, p.q)
    return o, lse


def _start(q, groups: int, plan):
    """The running (o, lse) before the own block: (None, None) when one piece spans the block,
    else zeros and an lse of `blocks.NEG` (weight 0 in the first merge)."""
    if len(plan) == 1 and len(plan[0]) == 1 and plan[0][0].nq == q.shape[1]:
        return None, None
    B, T, H, _ = q.shape
    lse = jnp.full((B, groups, H // groups, T), blocks.NEG, jnp.float32)
    return jnp.zeros_like(q, jnp.float32), lse


def _forward(q, k, v, q_pos, k_pos, axis, opts, segs=None):
    """(out float32, lse) of the ring: the own block, then n − 1 hops of k, v and their
    positions (and segment ids: `segs` = (query's, keys') or None), one step at a time (a
    scan, so one step's scores are live at once)."""
    _check_halve(opts.halve, opts.causal, q.shape[1])
    n, i = lax.axis_size(axis), lax.axis_index(axis)
    block = functools.partial(blocks.attend, opts=opts)
    own, hop_groups = _plans(q.shape[1], opts.halve, opts.leaf)
    q_seg, k_seg = (None, None) if segs is None else segs
    o, lse = _start(q, k.shape[2], own)
    o, lse = _attend_groups(own, q, k, v, q_pos, k_pos, (o, lse), block, (q_seg, k_seg))

    def hop(carry, step):
        k, v, k_pos, k_seg, o, lse = carry
        k, v, k_pos, k_seg = (_shift(x, axis, n) for x in (k, v, k_pos, k_seg))
        groups = hop_groups(i, (i - step) % n)  # the block in hand came from device i − step
        o, lse = _attend_groups(groups, q, k, v, q_pos, k_pos, (o, lse), block, (q_seg, k_seg))
        return (k, v, k_pos, k_seg, o, lse), None

    steps = jnp.arange(1, n, dtype=jnp.int32)
    (_, _, _, _, o, lse), _ = lax.scan(hop, (k, v, k_pos, k_seg, o, lse), steps)
    return o, lse


def _check_halve(halve: bool, causal: bool, rows: int) -> None:
    """Raises when the half-work plan cannot be exact."""
    if halve and (not causal or rows % 2):
        raise ValueError(
            f"ring(halve=True) needs causal attention on the zig-zag layout (an even block); got "
            f"causal={causal}, {rows} rows per device"
        )


def ring(
    q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, axis, opts, *, q_segments=None, k_segments=None
):  # fmt: skip
    """Attention of this device's queries against the keys of every device on `axis`.

    Call inside a region manual over `axis`; each device passes its own blocks.

    Args:
        q_BTHK: this device's queries.
        k_BSGK, v_BSGK: this device's keys and values.
        q_pos_T, k_pos_S: the global positions of those queries and keys (int32).
        axis: the manual mesh axis the sequence is split over.
        opts: the causal mask, its window, how each block is computed, and the half-work
            plan (`blocks.Options`): with ``halve`` only the causally visible half of each
            block is computed (about half the work, no more memory), exact only for causal
            attention with the positions of ``zigzag.order(T, n)`` (pass ``for_positions``'
            choice, never a guess); with it the own block's causal diagonals are halved while
            the halves keep at least ``leaf`` rows.
        q_segments, k_segments: this device's [B, T] segment ids of the queries and of the
            keys (int32, both or neither; self-attention passes the same array twice): a
            query sees only keys of its own segment (packed documents). None: no segments.

    Returns:
        [B, T, H, K] in the dtype of `v_BSGK`.
    """
    if (q_segments is None) != (k_segments is None):
        raise ValueError("ring: give both q_segments and k_segments, or neither")
    segs = None if q_segments is None else (q_segments, k_segments)
    return _ring(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, segs, axis, opts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _ring(q, k, v, q_pos, k_pos, segs, axis, opts):
    """`ring` with its segment ids as one argument (None or a pair), under its custom VJP."""
    o, _ = _forward(q, k, v, q_pos, k_pos, axis, opts, segs)
    return o.astype(v.dtype)


def for_positions(positions_T, n: int, opts: Options):
    """`ring` with ``halve`` set where it pays: causal attention with the jnp blocks and global
    `positions_T` concretely equal to ``zigzag.order(T, n)`` (a traced array: whole blocks).

    The Pallas kernel gets whole blocks: it skips the tiles whose positions see nothing
    itself (a 64-row tile lies inside one zig-zag chunk when the chunk is a multiple of it),
    which halves its work without the pieces' extra buffers.

    Args:
        positions_T: the global positions `context_attention` was given (before the split).
        n: the size of the sequence axis.
        opts: the attention's mask and block impl (`blocks.Options`).

    Returns:
        A function with `ring`'s positional arguments.
    """
    halve = bool(opts.causal) and opts.impl == "xla" and zigzag.is_balanced(positions_T, n)
    return functools.partial(_planned, halve=halve)


def _planned(q, k, v, q_pos, k_pos, axis, opts, *, halve: bool, **segments):
    """`ring` with ``opts.halve`` set to `halve` (`for_positions`' choice)."""
    return ring(q, k, v, q_pos, k_pos, axis, opts._replace(halve=halve), **segments)


def _ring_fwd(q, k, v, q_pos, k_pos, segs, axis, opts):
    o, lse = _forward(q, k, v, q_pos, k_pos, axis, opts, segs)
    o = o.astype(v.dtype)
    return o, (q, k, v, q_pos, k_pos, segs, o, lse)


def _ring_bwd(axis, opts, res, do_BTHK):
    q, k, v, q_pos, k_pos, segs, o, lse_BGRT = res
    n, i = lax.axis_size(axis), lax.axis_index(axis)
    delta_BGRT = blocks.delta(o, do_BTHK, k.shape[2])
    own, hop_groups = _plans(q.shape[1], opts.halve, opts.leaf)
    q_seg, k_seg = (None, None) if segs is None else segs

    def grads(groups, k, v, k_pos, k_seg, dq, dk, dv):
        """The accumulators with this device's queries' contributions against one k/v block,
        piece by piece; None accumulators start from a piece spanning the block."""
        for group in groups:
            first, nq, nk = group[0], group[0].nq, group[0].nk
            qs, ks = [p.q for p in group], [p.k for p in group]
            parts = blocks.grads(
                _stacked(q, qs, nq, 1), _stacked(k, ks, nk, 1), _stacked(v, ks, nk, 1),
                _rows(q_pos, first.q, nq, 0), _rows(k_pos, first.k, nk, 0),
                (_stacked(do_BTHK, qs, nq, 1), _stacked(lse_BGRT, qs, nq, 3),
                 _stacked(delta_BGRT, qs, nq, 3)), opts,
                **_piece_segments(q_seg, k_seg, qs, ks, nq, nk),
            )  # fmt: skip
            dq_g, dk_g, dv_g = (_unstack(x, len(group)) for x in parts)
            for p, dq_p, dk_p, dv_p in zip(group, dq_g, dk_g, dv_g, strict=True):
                if dq is None:  # the whole-block plan: one piece spanning the block
                    dq, dk, dv = dq_p, dk_p, dv_p
                else:
                    dq = _add_rows(dq, dq_p, p.q, 1)
                    dk, dv = _add_rows(dk, dk_p, p.k, 1), _add_rows(dv, dv_p, p.k, 1)
        return dq, dk, dv

    start = _start(q, k.shape[2], own)[0]
    zeros = (None, None, None) if start is None else (
        start, jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32)
    )  # fmt: skip
    dq, dk, dv = grads(own, k, v, k_pos, k_seg, *zeros)

    def hop(carry, step):
        # The k/v block moves on with its gradient accumulators (and its segment ids).
        k, v, k_pos, k_seg, dq, dk, dv = carry
        k, v, k_pos, k_seg, dk, dv = (_shift(x, axis, n) for x in (k, v, k_pos, k_seg, dk, dv))
        dq, dk, dv = grads(hop_groups(i, (i - step) % n), k, v, k_pos, k_seg, dq, dk, dv)
        return (k, v, k_pos, k_seg, dq, dk, dv), None

    steps = jnp.arange(1, n, dtype=jnp.int32)
    (_, _, _, _, dq, dk, dv), _ = lax.scan(hop, (k, v, k_pos, k_seg, dq, dk, dv), steps)
    dk, dv = _shift(dk, axis, n), _shift(dv, axis, n)  # the n-th hop brings them home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_autodiff(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, axis, opts):
    """`ring` differentiated by autodiff (kept to compare compiled memory with the custom
    VJP; see the module docstring; no segments). The jnp blocks only: a kernel may not be
    differentiated inside the region."""
    if opts.impl != "xla":
        raise ValueError(
            f"ring_autodiff: impl={opts.impl!r}; only 'xla' blocks can be differentiated"
        )
    o, _ = _forward(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, axis, opts)
    return o.astype(v_BSGK.dtype)
