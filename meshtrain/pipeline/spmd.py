"""The pipeline executors: one SPMD program per stage inside a partial-manual `jax.shard_map`.

The region is manual over ``pipe`` and the replica axes (the batch axes no parameter is split
over: ``data`` under dp and hsdp); the other axes (``fsdp`` where it splits parameters,
``tensor``) stay with the compiler, so each stage's blocks are partitioned as they are without a
pipeline. Each replica's stage parameters are marked varying before the loop, so their gradient
is summed over the replicas once, after it, rather than at every tick.

Two executors:

- `forward_loop` (gpipe, circular): a `lax.scan` over ticks; at each tick every stage runs
  its chunk on one microbatch and `ppermute` passes the result one stage on (round the ring
  for circular). `jax.grad` through it gives the backward.
- `one_f_one_b`: the forward *and* backward scheduled by hand. At each slot every stage runs a
  forward (`jax.vjp` of its chunk, keeping the residuals in a ring of p entries), a backward
  (the stored vjp applied to the cotangent from the next stage) or nothing, chosen by
  `lax.switch` on the schedule table. Weight gradients accumulate across microbatches.

Slots where a stage has nothing to do still run in lockstep. Their values are never allowed
to reach a result: every write is a `jnp.where` on the schedule, and stage inputs are zeroed
outside their valid ticks. ``poison=True`` fills those slots and all unused buffer entries with
NaN to prove it.

Side inputs and statistics: a stage runs ``stage_fn(chunk, x, side) -> (y, stats)``, where
`side` holds the [b, T] entries of the microbatch it is processing (a packed batch's segment
ids and positions; empty otherwise), indexed at every slot by the microbatch the schedule
gives that stage, and `stats` is a dict of scalars (an MoE's router losses and load; empty
otherwise), summed over the microbatches each stage runs and then over the stages.

Shapes: M microbatches, b rows per microbatch, T positions, D width, L stacked layers, Lc
layers per chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain._compat import varying_axes
from meshtrain.layout import varying
from meshtrain.mesh import PIPE
from meshtrain.pipeline.schedules import BWD, FWD, ScheduleTable, buffer_depth, forward_ticks

AXIS = PIPE

# (chunk params [Lc, ...], x [b, T, D], side {name: [b, T]}) -> (y [b, T, D], stats {name: []})
StageFn = Callable[[dict, jax.Array, dict], tuple[jax.Array, dict]]


class Microbatches(NamedTuple):
    """The per-microbatch inputs of `one_f_one_b` (the same on every stage).

    Attributes:
        x: embedded microbatches [M, b, T, D].
        side: side inputs of the stages, leading dims [M, b].
        labels: inputs of the head (its targets), leading dims [M, b].
    """

    x: jax.Array
    side: dict
    labels: dict


def _fill(x: jax.Array, poison: bool) -> jax.Array:
    """Zeros (or NaN, when poisoning) shaped like `x`."""
    return (
        jnp.full_like(x, jnp.nan)
        if poison and jnp.issubdtype(x.dtype, jnp.floating)
        else (jnp.zeros_like(x))
    )


def _put(buf: jax.Array, value: jax.Array, index, when) -> jax.Array:
    """``buf[index] = value`` where `when`, else unchanged; a masked ring-buffer write."""
    return lax.dynamic_update_index_in_dim(buf, jnp.where(when, value, buf[index]), index, 0)


def _from_stage(x: jax.Array, stage: int) -> jax.Array:
    """Stage `stage`'s value of `x` on every stage: a psum with the others contributing zeros.

    The sum runs in float32: XLA's CPU backend aborts on a bfloat16 all-reduce here
    ("Invalid binary instruction opcode copy", jax 0.12).
    """
    mine = jnp.where(lax.axis_index(AXIS) == stage, x, jnp.zeros_like(x))
    return lax.psum(mine.astype(jnp.float32), AXIS).astype(x.dtype)


def _at(tree, i):
    """Entry `i` of every leaf's leading dimension."""
    return jax.tree.map(lambda a: a[i], tree)


def _stage_totals(stats: dict, rows: tuple[str, ...]) -> dict:
    """Per-stage sums of `stats` → their sum over the stages, the same on every device. A
    statistic that differs between the shards of `rows` counts as its mean over them (an MoE's
    router statistics are already reduced over the rows inside the stage, so it is none)."""

    def total(a):
        a = lax.psum(a, AXIS)
        axes = tuple(x for x in rows if x in varying_axes(a))
        return lax.pmean(a, axes) if axes else a

    return jax.tree.map(total, stats)


def _size(axes) -> int:
    """The number of devices along manual `axes`."""
    return math.prod(lax.axis_size(a) for a in axes)


def _ring(p: int, step: int, wrap: bool) -> list[tuple[int, int]]:
    """ppermute pairs sending stage s to s + step (mod p when `wrap`)."""
    pairs = [(s, s + step) for s in range(p) if 0 <= s + step < p]
    if wrap:
        pairs = [(s, (s + step) % p) for s in range(p)]
    return pairs


def forward_loop(
    stage_fn: StageFn,
    chunks: dict,
    x_MbTD: jax.Array,
    side_Mb: dict | None = None,
    *,
    stages: int,
    repeats: int,
    rows: tuple[str, ...] = (),
    poison: bool = False,
) -> tuple[jax.Array, dict]:
    """The gpipe / circular forward, run inside the shard_map over ``pipe``.

    Args:
        stage_fn: runs one chunk of layers.
        chunks: this stage's parameters, leading dims [v, Lc, ...] (local chunk r is global
            chunk r·p + stage), already marked `varying`.
        x_MbTD: the embedded microbatches (the same on every stage).
        side_Mb: per-microbatch side inputs, leading dims [M, b] (the same on every stage).
        stages, repeats: p and v.
        rows: the manual axes the rows are split over.
        poison: start every buffer as NaN (testing).

    Returns:
        ``(y, stats)``: [M, b, T, D] outputs of the last chunk, the same on every stage, and
        the stage statistics summed over microbatches and stages.
    """
    p, v, m = stages, repeats, x_MbTD.shape[0]
    side_Mb = side_Mb or {}
    valid, micro, chunk = forward_ticks(p, m, v)
    s = lax.axis_index(AXIS)
    x0 = x_MbTD[0]
    outputs = varying(_fill(x_MbTD, poison))
    recv = varying(_fill(x0, poison))
    # Outputs of the last stage waiting at stage 0 for their next round (circular only).
    pending = varying(_fill(x_MbTD, poison)) if v > 1 else None
    first_chunk = jax.tree.map(lambda c: c[0], chunks)
    stats_shape = jax.eval_shape(stage_fn, first_chunk, x0, _at(side_Mb, 0))[1]
    totals = varying(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stats_shape))

    def tick(carry, row):
        recv, pending, outputs, totals = carry
        t, ok_row, mb_row, r_row = row
        ok, i, r = ok_row[s], jnp.maximum(mb_row[s], 0), jnp.maximum(r_row[s], 0)
        if v > 1:
            # What arrived at stage 0 was the last stage's item k' = t − p; keep it if it has
            # rounds left.
            k_prev = t - p
            back = (s == 0) & (k_prev >= 0) & (k_prev < (v - 1) * m)
            pending = _put(pending, recv, jnp.maximum(k_prev, 0) % m, back)
            first = jnp.where(r == 0, x_MbTD[i], pending[i])
        else:
            first = x_MbTD[i]
        x_in = jnp.where(s == 0, first, recv)
        x_in = jnp.where(ok, x_in, jnp.zeros_like(x_in))  # bubbles compute on zeros, never NaN
        params = jax.tree.map(lambda c: c[r], chunks)
        y, stats = stage_fn(params, x_in, _at(side_Mb, i))
        totals = jax.tree.map(lambda a, b: a + jnp.where(ok, b, jnp.zeros_like(b)), totals, stats)
        outputs = _put(outputs, y, i, ok & (s == p - 1) & (r == v - 1))
        recv = lax.ppermute(y, AXIS, _ring(p, 1, wrap=v > 1))
        return (recv, pending, outputs, totals), None

    ticks = (jnp.arange(len(valid)), jnp.asarray(valid), jnp.asarray(micro), jnp.asarray(chunk))
    (_, _, outputs, totals), _ = lax.scan(tick, (recv, pending, outputs, totals), ticks)
    # Only the last stage holds the outputs; the others contribute zeros.
    return _from_stage(outputs, p - 1), _stage_totals(totals, rows)


def one_f_one_b(
    stage_fn: StageFn,
    head_fn: Callable[[dict, jax.Array, dict], jax.Array],
    chunk: dict,
    head: dict,
    micro: Microbatches,
    table: ScheduleTable,
    *,
    aux_fn: Callable[[dict], jax.Array] | None = None,
    replicas: tuple[str, ...] = (),
    poison: bool = False,
):
    """The 1F1B forward and backward, run inside the shard_map over ``pipe``.

    Args:
        stage_fn: runs this stage's chunk of layers.
        head_fn: ``(head, y_bTD, labels_b) -> loss`` of one microbatch, already weighted (by
            1/M, say); runs on the last stage, right after its forward.
        chunk: this stage's parameters, leading dim [Lc, ...].
        head: the parameters `head_fn` differentiates (the same on every stage).
        micro: the embedded microbatches, the stages' side inputs and `head_fn`'s labels (its
            targets), each with leading dims [M, b].
        table: a 1f1b `ScheduleTable`.
        aux_fn: the loss term of one microbatch's stage statistics (linear in them): each
            stage's backward takes its gradient as the statistics' cotangent. None: they add
            nothing to the loss.
        replicas: the manual axes the rows are split over; `head_fn`'s loss must already be
            weighted by this replica's share, and the loss and head gradients are summed over
            them at the end.
        poison: start buffers and idle outputs as NaN (testing).

    Returns:
        ``(loss, stats, chunk_grads, head_grads, x_grads)``: the summed loss, the stage
        statistics summed over microbatches and stages, and the head gradients (the same on
        every stage and replica); this stage's chunk gradients (this replica's share: the
        caller sums them over the replicas) and d loss / d ``micro.x`` (this replica's rows).
    """
    x_MbTD, side_Mb, labels_Mb = micro
    p = table.stages
    s = lax.axis_index(AXIS)
    depth_f, depth_b, depth_r = (buffer_depth(table, k) for k in ("fwd", "bwd", "res"))
    x0 = varying(x_MbTD[0])
    # Typed as in a slot, where the microbatch index varies over pipe: a stage traced on
    # inputs of other types keeps other residuals.
    side0 = varying(_at(side_Mb, 0))
    # Differentiating an input that is the same on every stage would sum its gradient over
    # the stages inside the branch, a collective only the last stage reaches; keep it local.
    # The same mark on both keeps their gradients per replica until the end.
    head, chunk = varying(head), varying(chunk)

    def forward(c, x, side):
        """Runs the chunk, returning its output and statistics, the residuals to keep, and how
        to rebuild the vjp from them.

        Residuals that are the chunk's own parameters are not kept (they don't change between
        forward and backward); the backward puts them back.
        """
        (y, stats), vjp = jax.vjp(lambda c, x: stage_fn(c, x, side), c, x)
        leaves, treedef = jax.tree.flatten(vjp)
        params = jax.tree.leaves(c)
        where = [next((j for j, w in enumerate(params) if leaf is w), None) for leaf in leaves]
        kept = [leaf for leaf, j in zip(leaves, where, strict=True) if j is None]
        return y, stats, kept, (treedef, where)

    # Trace once to learn the residuals' and statistics' shapes (this compiles to nothing).
    # Each residual keeps the manual axes it varies over (plus pipe, as the ring's writes
    # depend on the stage): a residual the same on every replica (an MoE's router statistics,
    # averaged over the rows) must not come back varying, or its cotangents would not type.
    res_axes: list[frozenset[str]] = []

    def kept_and_stats(c, x, side):
        _, stats, kept, _ = forward(c, x, side)
        res_axes[:] = [varying_axes(k) | {AXIS} for k in kept]
        return kept, stats

    res_shapes, stats_shape = jax.eval_shape(kept_and_stats, chunk, x0, side0)
    residuals = [
        varying(_fill(jnp.zeros((depth_r, *r.shape), r.dtype), poison), a)
        for r, a in zip(res_shapes, res_axes, strict=True)
    ]
    head_zero = jax.tree.map(jnp.zeros_like, head)
    chunk_zero = jax.tree.map(jnp.zeros_like, chunk)
    stats_zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stats_shape)

    # The three things a stage can do in a slot; `lax.switch` picks one per stage.

    def idle(chunk, x_in, side, cot, stored):
        nan_like = lambda a: _fill(a, poison)  # noqa: E731
        return (
            nan_like(x0),
            stats_zero,
            nan_like(x0),
            [nan_like(r[0]) for r in residuals],
            jax.tree.map(nan_like, chunk_zero),
        )

    def fwd(chunk, x_in, side, cot, stored):
        y, stats, kept, _ = forward(chunk, x_in, side)
        return (y, stats, jnp.zeros_like(x0), kept, chunk_zero)

    def bwd(chunk, x_in, side, cot, stored):
        # The structure only; its math is unused.
        _, stats, _, (treedef, where) = forward(chunk, x0, side)
        it, params = iter(stored), jax.tree.leaves(chunk)
        leaves = [params[j] if j is not None else next(it) for j in where]
        # d loss / d stats of one microbatch: a constant, as `aux_fn` is linear (so none of
        # the structural forward's math is needed). A statistic that varies over replica axes
        # counts as their mean (`_stage_totals`), so each replica's share is 1/n of it.
        d_stats = {} if aux_fn is None else jax.grad(aux_fn)(stats)
        d_stats = jax.tree.map(
            lambda d, a: d / _size(varying_axes(a) & set(replicas)), d_stats, stats
        )
        g_chunk, g_x = jax.tree.unflatten(treedef, leaves)((cot, d_stats))
        zeros = [jnp.zeros_like(r[0]) for r in residuals]
        return (jnp.zeros_like(x0), stats_zero, g_x, zeros, g_chunk)

    # The loss head runs after the last stage's forward, under a `lax.cond` whose predicate
    # comes from the table's slot row and so is the same on every stage. Inside a branch only
    # some stages take, the compiler's collectives for the head's vocab-wide layout wait for
    # stages that never arrive; a branch all stages take is safe. The other stages' results
    # are discarded.

    def head_step(head, y, labels):
        loss, head_vjp = jax.vjp(lambda h, y: head_fn(h, y, labels), head, y)
        g_head, dy = head_vjp(jnp.ones_like(loss))
        return varying((loss.astype(jnp.float32), g_head, dy.astype(y.dtype)))

    def no_head(head, y, labels):
        return varying((jnp.zeros((), jnp.float32), head_zero, jnp.zeros_like(y)))

    def typed(out):
        """A branch's outputs, typed alike in every branch: varying over every manual axis,
        except the residuals, which keep their own axes."""
        y, stats, dx, kept, g_chunk = out
        kept = [varying(k, a) for k, a in zip(kept, res_axes, strict=True)]
        return (*varying((y, stats, dx)), kept, varying(g_chunk))

    # Every branch's outputs differ between stages, so mark them so: the types must agree.
    branches = [lambda *a, f=f: typed(f(*a)) for f in (idle, fwd, bwd)]
    fin = _fill(jnp.zeros((depth_f, *x0.shape), x0.dtype), poison)
    bin_ = _fill(jnp.zeros((depth_b, *x0.shape), x0.dtype), poison)
    carry = (
        *varying((fin, bin_)),
        residuals,
        *varying((jnp.zeros((), jnp.float32), stats_zero, chunk_zero, head_zero)),
        varying(_fill(x_MbTD, poison)),
    )

    def slot(carry, row):
        fin, bin_, res, loss, totals, g_chunk, g_head, g_x = carry
        ph_row, mb_row = row
        ph, i = ph_row[s], jnp.maximum(mb_row[s], 0)
        last = s == p - 1
        x_in = jnp.where(s == 0, x_MbTD[i], fin[i % depth_f])
        cot = bin_[i % depth_b]
        stored = [r[i % depth_r] for r in res]
        y, stats, dx, kept, g_chunk_i = lax.switch(
            ph, branches, chunk, x_in, _at(side_Mb, i), cot, stored
        )
        last_fwd, last_mb = ph_row[p - 1] == FWD, jnp.maximum(mb_row[p - 1], 0)
        loss_i, g_head_i, dy = lax.cond(
            last_fwd, head_step, no_head, head, y, _at(labels_Mb, last_mb)
        )
        is_f, is_b = ph == FWD, ph == BWD
        res = [_put(r, k, i % depth_r, is_f) for r, k in zip(res, kept, strict=True)]
        loss = jnp.where(is_f & last, loss + loss_i, loss)
        totals = jax.tree.map(lambda a, b: jnp.where(is_f, a + b, a), totals, stats)
        g_chunk = jax.tree.map(lambda a, g: jnp.where(is_b, a + g, a), g_chunk, g_chunk_i)
        g_head = jax.tree.map(lambda a, g: jnp.where(is_f & last, a + g, a), g_head, g_head_i)
        g_x = _put(g_x, dx, i, is_b & (s == 0))
        bin_ = _put(bin_, dy, i % depth_b, is_f & last)
        # Pass activations on and cotangents back; the table says what each neighbour sent.
        y_recv = lax.ppermute(y, AXIS, _ring(p, 1, wrap=False))
        dx_recv = lax.ppermute(dx, AXIS, _ring(p, -1, wrap=False))
        prev, nxt = jnp.maximum(s - 1, 0), jnp.minimum(s + 1, p - 1)
        fin = _put(
            fin, y_recv, jnp.maximum(mb_row[prev], 0) % depth_f, (s > 0) & (ph_row[prev] == FWD)
        )
        bin_ = _put(
            bin_, dx_recv, jnp.maximum(mb_row[nxt], 0) % depth_b, (s < p - 1) & (ph_row[nxt] == BWD)
        )
        return (fin, bin_, res, loss, totals, g_chunk, g_head, g_x), None

    rows = (jnp.asarray(table.phase), jnp.asarray(table.micro))
    carry, _ = lax.scan(slot, carry, rows)
    _, _, _, loss, totals, g_chunk, g_head, g_x = carry
    loss = lax.psum(jnp.where(s == p - 1, loss, 0.0), (AXIS, *replicas))
    g_head = jax.tree.map(
        lambda g: lax.psum(jnp.where(s == p - 1, g, 0), (AXIS, *replicas)), g_head
    )
    g_x = _from_stage(g_x, 0)
    return loss, _stage_totals(totals, replicas), g_chunk, g_head, g_x
