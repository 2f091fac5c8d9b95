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
- `scheduled` (1f1b, interleaved-1f1b, zb-h1): the forward *and* backward scheduled by hand.
  At each slot every stage runs a forward (`jax.vjp` of its chunk, keeping the residuals in a
  ring buffer), a backward (the stored vjp applied to the cotangent from the next chunk),
  zb-h1's input or weight pass (`meshtrain.pipeline.split`) or nothing, chosen by
  `lax.switch` on the schedule table. Weight gradients accumulate across microbatches.

Both send only what the table moves: each slot's (tick's) permutes are a branch chosen by the
slot, the same on every stage, naming only the stage pairs it moves something between
(`meshtrain.pipeline.slots`).

Slots where a stage has nothing to do still run in lockstep. Their values are never allowed
to reach a result: every write is a `jnp.where` on the schedule, and stage inputs are zeroed
outside their valid ticks. ``poison=True`` (or tracing inside `poison_buffers`) fills those
slots and all unused buffer entries with NaN to prove it.

Side inputs and statistics: a stage runs ``stage_fn(chunk, x, side) -> (y, stats)``, where
`side` holds the [b, T] entries of the microbatch it is processing (a packed batch's segment
ids and positions; empty otherwise), indexed at every slot by the microbatch the schedule
gives that stage, and `stats` is a dict of scalars (an MoE's router losses and load; empty
otherwise), summed over the microbatches each stage runs and then over the stages.

Shapes: M microbatches, b rows per microbatch, T positions, D width, L stacked layers, Lc
layers per chunk.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain._compat import varying_axes
from meshtrain.layout import varying
from meshtrain.layout.memory import on_host
from meshtrain.mesh import PIPE
from meshtrain.pipeline.schedules import BWD, FWD, WGT, ScheduleTable, forward_ticks
from meshtrain.pipeline.slots import slot_plan, tick_patterns
from meshtrain.pipeline.split import split_backward

AXIS = PIPE

# (chunk params [Lc, ...], x [b, T, D], side {name: [b, T]}) -> (y [b, T, D], stats {name: []})
StageFn = Callable[[dict, jax.Array, dict], tuple[jax.Array, dict]]


class Microbatches(NamedTuple):
    """The per-microbatch inputs of `scheduled` (the same on every stage).

    Attributes:
        x: embedded microbatches [M, b, T, D].
        side: side inputs of the stages, leading dims [M, b].
        labels: inputs of the head (its targets), leading dims [M, b].
    """

    x: jax.Array
    side: dict
    labels: dict


class Rows(NamedTuple):
    """The manual axes the rows of a microbatch are split over.

    Attributes:
        inner: by the pipeline's own region (its replicas; summed over at its end).
        outer: by an enclosing region (the replicas' own step), whose replicas' gradients
            are averaged after the pipeline returns.
    """

    inner: tuple[str, ...] = ()
    outer: tuple[str, ...] = ()


_POISON = contextvars.ContextVar("meshtrain_pipeline_poison", default=False)


@contextlib.contextmanager
def poison_buffers():
    """While tracing inside this block, the pipelines' idle slots and unused buffer entries
    start out NaN (testing: a value that reaches a result shows)."""
    token = _POISON.set(True)
    try:
        yield
    finally:
        _POISON.reset(token)


def poisoning() -> bool:
    """Whether the trace is inside `poison_buffers`."""
    return _POISON.get()


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


def _host_ring(shape, depth: int, axes) -> jax.Array:
    """A ring buffer of `depth` + 1 slots in host memory (the last one takes discarded
    writes), typed to vary over `axes`."""
    ring = varying(jnp.zeros((depth + 1, *shape.shape), shape.dtype), axes)
    return jax.device_put(ring, jax.memory.Space.Host)


def _put_host(buf: jax.Array, value: jax.Array, index, when) -> jax.Array:
    """``buf[index] = value`` where `when`, else into the spare last slot: a masked write to a
    host ring with no select on host memory."""
    return lax.dynamic_update_index_in_dim(buf, value, jnp.where(when, index, buf.shape[0] - 1), 0)


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


def _pass_on(patterns, pattern, y: jax.Array) -> jax.Array:
    """The forward loop's permute of one tick: only from the stages whose output the next
    chunk uses (the others' receivers get zeros). `pattern` is the same on every stage, so
    every stage takes the same branch and meets the same collectives."""

    def branch(pairs):
        return lambda y: varying(lax.ppermute(y, AXIS, list(pairs)) if pairs else jnp.zeros_like(y))

    if len(patterns) == 1:
        return branch(patterns[0])(y)
    return lax.switch(pattern, [branch(pairs) for pairs in patterns], y)


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
    patterns, pattern = tick_patterns(valid, chunk, p, v)
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
        t, ok_row, mb_row, r_row, pat = row
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
        recv = _pass_on(patterns, pat, y)
        return (recv, pending, outputs, totals), None

    ticks = (
        jnp.arange(len(valid)),
        *(jnp.asarray(a) for a in (valid, micro, chunk, pattern)),
    )
    (_, _, outputs, totals), _ = lax.scan(tick, (recv, pending, outputs, totals), ticks)
    # Only the last stage holds the outputs; the others contribute zeros.
    return _from_stage(outputs, p - 1), _stage_totals(totals, rows)


class _Chunk:
    """How a stage runs one chunk forward and backward: whole (one vjp of the chunk) or, when
    the backward is split (zb-h1), layer by layer, so that each layer's backward can be cut
    into its input pass and its weight pass (`meshtrain.pipeline.split`)."""

    def __init__(self, stage_fn: StageFn, split: bool):
        self.stage_fn, self.split = stage_fn, split
        self.structure: list = []  # (treedef, where) of the vjp, learnt while tracing

    def _vjp(self, c, x, side):
        """The chunk's (or layer's) output and statistics, its kept residuals, and how to
        rebuild its vjp. Residuals that are the parameters themselves are not kept (they
        don't change between forward and backward); the backward puts them back."""
        (y, stats), vjp = jax.vjp(lambda c, x: self.stage_fn(c, x, side), c, x)
        leaves, treedef = jax.tree.flatten(vjp)
        params = jax.tree.leaves(c)
        where = [next((j for j, w in enumerate(params) if leaf is w), None) for leaf in leaves]
        kept = [leaf for leaf, j in zip(leaves, where, strict=True) if j is None]
        self.structure[:] = [(treedef, where, jax.tree.map(varying_axes, stats))]
        return y, stats, kept

    def forward(self, c, x, side):
        """``(y, stats, kept)``; split: the layers' residuals stacked [Lc, ...]."""
        if not self.split:
            return self._vjp(c, x, side)

        def layer(x, c_l):
            y, stats, kept = self._vjp(_one(c_l), x, side)
            return y, (kept, stats)

        y, (kept, stats) = lax.scan(layer, x, c)
        return y, jax.tree.map(lambda a: a.sum(0), stats), kept

    def _backward_fn(self, c, n_kept: int, d_stats):
        """The flat backward of one vjp: ``(*params, *kept, ct) -> [g_x, *g_params]``."""
        treedef, where, stats_axes = self.structure[0]
        n_p = len(jax.tree.leaves(c))
        # The statistics' cotangent typed as they are (they vary over pipe inside a slot).
        d_stats = jax.tree.map(lambda d, axes: varying(d, axes), d_stats, stats_axes)

        def bwd(*a):
            params, kept, ct = a[:n_p], iter(a[n_p : n_p + n_kept]), a[n_p + n_kept]
            leaves = [params[j] if j is not None else next(kept) for j in where]
            g_c, g_x = jax.tree.unflatten(treedef, leaves)((ct, d_stats))
            return [g_x, *jax.tree.leaves(g_c)]

        return bwd

    def backward(self, c, kept, ct, side, d_stats):
        """The whole backward: ``(g_chunk, g_x)``."""
        self._vjp(c, jnp.zeros_like(ct), side)  # the structure only; its math is unused
        bwd = self._backward_fn(c, len(kept), d_stats)
        g_x, *g_c = bwd(*jax.tree.leaves(c), *kept, ct)
        return jax.tree.unflatten(jax.tree.structure(c), g_c), g_x

    def _split(self, c_l, kept_l, ct, side, d_stats):
        """One layer's backward cut in two, traced on these arguments' types."""
        c1 = _one(c_l)
        self._vjp(c1, jnp.zeros_like(ct), side)
        bwd = self._backward_fn(c1, len(kept_l), d_stats)
        params = jax.tree.leaves(c1)
        args = [*params, *kept_l, ct]
        return split_backward(bwd, args, 1, len(params) + len(kept_l)), params

    def input_pass(self, c, kept, ct, side, d_stats):
        """zb-h1's B: ``(g_x, handover)``, the handover stacked over the layers."""

        def layer(ct, xs):
            c_l, kept_l = xs
            cut, params = self._split(c_l, kept_l, ct, side, d_stats)
            (g_x,), handover = cut.input_pass(*params, *kept_l, ct)
            return g_x, handover

        return lax.scan(layer, ct, (c, kept), reverse=True)

    def weight_pass(self, c, kept, handover, ct_like, side, d_stats):
        """zb-h1's W: the chunk's gradient [Lc, ...] from the residuals and the handover."""

        def layer(_, xs):
            c_l, kept_l, hand_l = xs
            cut, params = self._split(c_l, kept_l, ct_like, side, d_stats)
            g_c = cut.weight_pass([*params, *kept_l], hand_l)
            g_c = jax.tree.unflatten(jax.tree.structure(c_l), [g[0] for g in g_c])
            return None, g_c

        return lax.scan(layer, None, (c, kept, handover))[1]


def _one(c_l):
    """One layer's parameters as a chunk of one layer (a leading dimension of 1)."""
    return jax.tree.map(lambda a: a[None], c_l)


def _send(patterns, pattern, y, dx):
    """The slot's permutes: only the pairs the table moves something between (the others
    receive zeros). `pattern` is the same on every stage, so every stage takes the same
    branch and meets the same collectives."""

    def branch(fwd, bwd):
        def send(y, dx):
            y_recv = lax.ppermute(y, AXIS, list(fwd)) if fwd else jnp.zeros_like(y)
            dx_recv = lax.ppermute(dx, AXIS, list(bwd)) if bwd else jnp.zeros_like(dx)
            return varying((y_recv, dx_recv))

        return send

    branches = [branch(f, b) for f, b in patterns]
    if len(branches) == 1:
        return branches[0](y, dx)
    return lax.switch(pattern, branches, y, dx)


def scheduled(
    stage_fn: StageFn,
    head_fn: Callable[[dict, jax.Array, dict], jax.Array],
    chunks: dict,
    head: dict,
    micro: Microbatches,
    table: ScheduleTable,
    *,
    aux_fn: Callable[[dict], jax.Array] | None = None,
    rows: Rows | None = None,
    poison: bool = False,
):
    """The hand-scheduled forward and backward (1f1b, interleaved-1f1b, zb-h1), run inside
    the shard_map over ``pipe``.

    At each slot every stage runs what the table gives it, chosen by `lax.switch`: a forward
    (`jax.vjp` of the chunk, its residuals kept in a ring buffer), a backward (the stored vjp
    applied to the cotangent from the next chunk), zb-h1's input and weight passes, or
    nothing. Weight gradients accumulate across microbatches in one buffer per chunk. Buffer
    entries and the permutes of every slot come from `meshtrain.pipeline.slots.slot_plan`:
    only payloads the table moves cross the wire.

    Args:
        stage_fn: runs a chunk of layers.
        head_fn: ``(head, y_bTD, labels_b) -> loss`` of one microbatch, already weighted (by
            1/M, say); runs right after the model's last chunk's forward.
        chunks: this stage's parameters, leading dims [v, Lc, ...] (local chunk r is global
            chunk r·p + stage).
        head: the parameters `head_fn` differentiates (the same on every stage).
        micro: the embedded microbatches, the stages' side inputs and `head_fn`'s labels (its
            targets), each with leading dims [M, b].
        table: a hand-scheduled `ScheduleTable`.
        aux_fn: the loss term of one microbatch's stage statistics (linear in them): each
            stage's backward takes its gradient as the statistics' cotangent. None: they add
            nothing to the loss.
        rows: the manual axes the rows are split over (see `Rows`; none when None);
            `head_fn`'s loss must already be weighted by this replica's share, and the loss
            and head gradients are summed over ``rows.inner`` at the end.
        poison: start buffers and idle outputs as NaN (testing).

    Returns:
        ``(loss, stats, chunk_grads, head_grads, x_grads)``: the summed loss, the stage
        statistics summed over microbatches and stages, and the head gradients (the same on
        every stage and replica); this stage's chunk gradients [v, Lc, ...] (this replica's
        share: the caller sums them over the replicas) and d loss / d ``micro.x`` (this
        replica's rows).
    """
    x_MbTD, side_Mb, labels_Mb = micro
    rows = rows or Rows()
    p, v = table.stages, table.repeats
    plan = slot_plan(table)
    split = table.schedule == "zb-h1"
    run = _Chunk(stage_fn, split)
    s = lax.axis_index(AXIS)
    x0 = varying(x_MbTD[0])
    # Typed as in a slot, where the microbatch index varies over pipe: a stage traced on
    # inputs of other types keeps other residuals.
    side0 = varying(_at(side_Mb, 0))
    # Differentiating an input that is the same on every stage would sum its gradient over
    # the stages inside the branch, a collective only the last stage reaches; keep it local.
    # The same mark on both keeps their gradients per replica until the end.
    head, chunks = varying(head), varying(chunks)
    chunk0 = jax.tree.map(lambda c: c[0], chunks)

    # Trace once to learn the residuals', statistics' and handover's types (this compiles to
    # nothing). Each keeps the manual axes it varies over (plus pipe, as the ring's writes
    # depend on the stage): a residual the same on every replica (an MoE's router statistics,
    # averaged over the rows) must not come back varying, or its cotangents would not type.
    res_axes: list[frozenset[str]] = []
    hosted: list[bool] = []  # a residual a remat policy moved to host memory
    hand_axes: list[frozenset[str]] = []

    def kept_and_stats(c, x, side):
        _, stats, kept = run.forward(c, x, side)
        res_axes[:] = [varying_axes(k) | {AXIS} for k in kept]
        hosted[:] = [on_host(k) for k in kept]
        return kept, stats

    res_shapes, stats_shape = jax.eval_shape(kept_and_stats, chunk0, x0, side0)
    stats_zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stats_shape)
    # d loss / d stats of one microbatch: a constant, as `aux_fn` is linear. A statistic that
    # varies over replica axes counts as their mean (`_stage_totals`), so each replica's
    # share is 1/n of it.
    d_stats = {} if aux_fn is None else jax.grad(aux_fn)(stats_zero)
    d_stats = jax.tree.map(
        lambda d, a: d / _size(varying_axes(a) & set(rows.inner)), d_stats, stats_zero
    )
    # Inside the replicas' own region each replica's gradient is averaged with the others',
    # while a statistic the router reduced over them is the whole batch's: each replica's
    # share of its gradient is the whole of it (jax's transpose of that reduction says the
    # same for the loops it differentiates).
    d_stats = jax.tree.map(
        lambda d, a: d * _size(tuple(x for x in rows.outer if x not in varying_axes(a))),
        d_stats,
        stats_zero,
    )

    def ring(shape, depth, axes):
        return varying(_fill(jnp.zeros((depth, *shape.shape), shape.dtype), poison), axes)

    # A residual a remat policy moved to host memory stays there: its ring is a host buffer,
    # one slot longer, whose last slot takes the writes of the slots that keep nothing (a
    # write is a dynamic update alone, no compute on host memory).
    residuals = [
        _host_ring(r, plan.depth["res"], a) if h else ring(r, plan.depth["res"], a)
        for r, a, h in zip(res_shapes, res_axes, hosted, strict=True)
    ]

    def unused(bufs):
        """Stand-ins for the residuals a slot keeps none of: zeros, or a host ring's spare
        slot (written back to itself)."""
        return [b[-1] if h else jnp.zeros_like(b[0]) for b, h in zip(bufs, hosted, strict=True)]

    handovers: list = []
    if split:

        def handover_of(c, x, side):
            _, _, kept = run.forward(c, x, side)
            _, hand = run.input_pass(c, kept, varying(x), side, d_stats)
            hand_axes[:] = [varying_axes(h) | {AXIS} for h in hand]
            return hand

        hand_shapes = jax.eval_shape(handover_of, chunk0, x0, side0)
        handovers = [
            ring(h, plan.depth["hand"], a) for h, a in zip(hand_shapes, hand_axes, strict=True)
        ]
    head_zero = jax.tree.map(jnp.zeros_like, head)
    chunk_zero = jax.tree.map(jnp.zeros_like, chunk0)

    # The things a stage can do in a slot; `lax.switch` picks one per stage. Each returns
    # (y, stats, dx, kept residuals, handover, chunk gradient).

    def idle(c, x_in, side, cot, stored, hand):
        nan_like = lambda a: _fill(a, poison)  # noqa: E731
        return (
            nan_like(x0),
            stats_zero,
            nan_like(x0),
            [r[-1] if h else nan_like(r[0]) for r, h in zip(residuals, hosted, strict=True)],
            [nan_like(h[0]) for h in handovers],
            jax.tree.map(nan_like, chunk_zero),
        )

    def fwd(c, x_in, side, cot, stored, hand):
        y, stats, kept = run.forward(c, x_in, side)
        zeros = [jnp.zeros_like(h[0]) for h in handovers]
        return (y, stats, jnp.zeros_like(x0), kept, zeros, chunk_zero)

    def bwd(c, x_in, side, cot, stored, hand):
        zeros = unused(residuals)
        if split:
            g_x, handover = run.input_pass(c, stored, cot, side, d_stats)
            return (jnp.zeros_like(x0), stats_zero, g_x, zeros, handover, chunk_zero)
        g_chunk, g_x = run.backward(c, stored, cot, side, d_stats)
        return (jnp.zeros_like(x0), stats_zero, g_x, zeros, [], g_chunk)

    def wgt(c, x_in, side, cot, stored, hand):
        g_chunk = run.weight_pass(c, stored, hand, cot, side, d_stats)
        zeros = unused(residuals)
        hand_zeros = [jnp.zeros_like(h[0]) for h in handovers]
        return (jnp.zeros_like(x0), stats_zero, jnp.zeros_like(x0), zeros, hand_zeros, g_chunk)

    # The loss head runs after the model's last chunk's forward, on the last stage only, under
    # a `lax.cond`. The branch is taken by some stages and not others, so it must hold no
    # collective across stages: the head's weights and logits are partitioned only over the
    # axes the compiler keeps (tensor, fsdp), whose groups lie within one stage, and the logits
    # are kept whole over tensor (see `pipeline_loss_and_grads`).

    def head_step(head, y, labels):
        loss, head_vjp = jax.vjp(lambda h, y: head_fn(h, y, labels), head, y)
        g_head, dy = head_vjp(jnp.ones_like(loss))
        return varying((loss.astype(jnp.float32), g_head, dy.astype(y.dtype)))

    def no_head(head, y, labels):
        return varying((jnp.zeros((), jnp.float32), head_zero, jnp.zeros_like(y)))

    def typed(out):
        """A branch's outputs, typed alike in every branch: varying over every manual axis,
        except the residuals and handover, which keep their own axes."""
        y, stats, dx, kept, hand, g_chunk = out
        kept = [varying(k, a) for k, a in zip(kept, res_axes, strict=True)]
        hand = [varying(h, a) for h, a in zip(hand, hand_axes, strict=True)]
        return (*varying((y, stats, dx)), kept, hand, varying(g_chunk))

    # Every branch's outputs differ between stages, so mark them so: the types must agree.
    passes = (idle, fwd, bwd, wgt if split else idle)  # WGT slots exist only when split
    branches = [lambda *a, f=f: typed(f(*a)) for f in passes]
    fin = _fill(jnp.zeros((plan.depth["fin"], *x0.shape), x0.dtype), poison)
    bin_ = _fill(jnp.zeros((plan.depth["bin"], *x0.shape), x0.dtype), poison)
    carry = (
        *varying((fin, bin_)),
        residuals,
        handovers,
        *varying((jnp.zeros((), jnp.float32), stats_zero, jax.tree.map(jnp.zeros_like, chunks))),
        varying(head_zero),
        varying(_fill(x_MbTD, poison)),
    )
    grad_phase = WGT if split else BWD

    def slot(carry, row):
        fin, bin_, res, hand, loss, totals, g_chunks, g_head, g_x = carry
        (ph_row, mb_row, r_row, pat), reads, writes = row
        ph, i, r = ph_row[s], jnp.maximum(mb_row[s], 0), jnp.maximum(r_row[s], 0)
        c = jax.tree.map(lambda a: a[r], chunks)
        first, model_last = (s == 0) & (r == 0), (s == p - 1) & (r == v - 1)
        x_in = jnp.where(first, x_MbTD[i], fin[reads["fin"][s]])
        cot = bin_[reads["bin"][s]]
        stored = [b[reads["res"][s]] for b in res]
        hand_in = [b[reads["hand"][s]] for b in hand]
        y, stats, dx, kept, hand_out, g_i = lax.switch(
            ph, branches, c, x_in, _at(side_Mb, i), cot, stored, hand_in
        )
        last_fwd = (ph_row[p - 1] == FWD) & (r_row[p - 1] == v - 1)
        last_mb = jnp.maximum(mb_row[p - 1], 0)
        loss_i, g_head_i, dy = lax.cond(
            last_fwd & (s == p - 1), head_step, no_head, head, y, _at(labels_Mb, last_mb)
        )
        is_f, is_b = ph == FWD, ph == BWD
        res = [
            _put_host(b, k, writes["res"][s], is_f) if h else _put(b, k, writes["res"][s], is_f)
            for b, k, h in zip(res, kept, hosted, strict=True)
        ]
        hand = [_put(b, h, writes["hand"][s], is_b) for b, h in zip(hand, hand_out, strict=True)]
        loss = jnp.where(is_f & model_last, loss + loss_i, loss)
        totals = jax.tree.map(lambda a, b: jnp.where(is_f, a + b, a), totals, stats)
        g_chunks = jax.tree.map(lambda a, g: _put(a, a[r] + g, r, ph == grad_phase), g_chunks, g_i)
        g_head = jax.tree.map(lambda a, g: jnp.where(is_f & model_last, a + g, a), g_head, g_head_i)
        g_x = _put(g_x, dx, i, is_b & first)
        bin_ = _put(bin_, dy, jnp.maximum(writes["head"][s], 0), writes["head"][s] >= 0)
        y_recv, dx_recv = _send(plan.patterns, pat, y, dx)
        fin = _put(fin, y_recv, jnp.maximum(writes["fin"][s], 0), writes["fin"][s] >= 0)
        bin_ = _put(bin_, dx_recv, jnp.maximum(writes["bin"][s], 0), writes["bin"][s] >= 0)
        return (fin, bin_, res, hand, loss, totals, g_chunks, g_head, g_x), None

    slots = (
        tuple(jnp.asarray(a) for a in (table.phase, table.micro, table.chunk, plan.pattern)),
        {k: jnp.asarray(a) for k, a in plan.read.items()},
        {k: jnp.asarray(a) for k, a in plan.write.items()},
    )
    carry, _ = lax.scan(slot, carry, slots)
    _, _, _, _, loss, totals, g_chunks, g_head, g_x = carry
    loss = lax.psum(jnp.where(s == p - 1, loss, 0.0), (AXIS, *rows.inner))
    g_head = jax.tree.map(
        lambda g: lax.psum(jnp.where(s == p - 1, g, 0), (AXIS, *rows.inner)), g_head
    )
    g_x = _from_stage(g_x, 0)
    return loss, _stage_totals(totals, rows.inner), g_chunks, g_head, g_x
