"""The hand-scheduled executor (1f1b, interleaved-1f1b, zb-h1): `scheduled`, in stages.

`scheduled` sets up (the types one forward keeps, learnt by tracing it once; the statistics'
cotangent; the ring buffers), scans the slots of the table, and drains (the sums over the
stages).

The statistics' cotangent is the gradient of the loss term of the step's statistics. A term
linear in them (meshtrain's router losses) has the same gradient everywhere, taken at zeros. A
term that is not (Mixtral's load-balancing loss, pooled over every block and the whole batch
before a product) has its gradient taken at the step's statistics, which a forward of every
microbatch alone gives first (`StatsLoss.totals`): a stage's backward of the first microbatch runs
before the last microbatch's forward, yet needs the pooled statistics of all of them.

Each slot on a stage reads its inputs from the rings, runs its pass and the loss head
(`meshtrain.pipeline.passes`), keeps what they make and sends its outputs on. The overview is
in `meshtrain.pipeline.spmd`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal

from meshtrain._compat import varying_axes
from meshtrain.layout import varying
from meshtrain.layout.memory import on_host
from meshtrain.pipeline.buffers import at, fill, host_ring, put, put_host
from meshtrain.pipeline.chunk import Chunk, StageFn
from meshtrain.pipeline.collectives import AXIS, from_stage, send, size, stage_totals
from meshtrain.pipeline.passes import HeadFn, Kit, PassOut, head_branches, slot_branches
from meshtrain.pipeline.schedules import BWD, FWD, WGT, ScheduleTable
from meshtrain.pipeline.slots import SlotPlan, slot_plan


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


class StatsLoss(NamedTuple):
    """The loss term of the stage statistics, and how to get the step's statistics first.

    Attributes:
        term: the loss term of the step's statistics (summed over the microbatches and
            stages): each stage's backward takes its gradient as the statistics' cotangent.
        totals: ``(chunks, micro) -> stats``, the step's statistics summed over the
            microbatches and stages from a forward alone (no residuals kept; the gpipe /
            circular forward loop, say). Run first, and only when `term`'s gradient depends on
            the statistics (a term not linear in them), to take the gradient there; such a
            `term` without it is an error.
    """

    term: Callable[[dict], jax.Array]
    totals: Callable[[dict, Microbatches], dict] | None = None


class Rows(NamedTuple):
    """The manual axes the rows of a microbatch are split over.

    Attributes:
        inner: by the pipeline's own region (its replicas; summed over at its end).
        outer: by an enclosing region (the replicas' own step), whose replicas' gradients
            are averaged after the pipeline returns.
    """

    inner: tuple[str, ...] = ()
    outer: tuple[str, ...] = ()


def scheduled(
    stage_fn: StageFn,
    head_fn: HeadFn,
    chunks: dict,
    head: dict,
    micro: Microbatches,
    table: ScheduleTable,
    *,
    stats_loss: StatsLoss | None = None,
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
        stats_loss: the loss term of the stage statistics (see `StatsLoss`). None: they add
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
    rows = rows or Rows()
    plan = slot_plan(table)
    run = Chunk(stage_fn, table.schedule == "zb-h1")
    s = lax.axis_index(AXIS)
    x0 = varying(micro.x[0])
    # Typed as in a slot, where the microbatch index varies over pipe: a stage traced on
    # inputs of other types keeps other residuals.
    side0 = varying(at(micro.side, 0))
    # Differentiating an input that is the same on every stage would sum its gradient over
    # the stages inside the branch, a collective only the last stage reaches; keep it local.
    # The same mark on both keeps their gradients per replica until the end.
    head, chunks = varying(head), varying(chunks)
    example = jax.tree.map(lambda c: c[0], chunks), x0, side0
    kept, stats_zero = _trace_forward(run, *example)
    aux_fn = None if stats_loss is None else stats_loss.term
    point = _cotangent_point(stats_loss, stats_zero, chunks, micro)
    d_stats = _stats_cotangent(aux_fn, point, stats_zero, rows)
    kit = _kit(run, plan, head, example, kept, stats_zero, d_stats, poison)
    heads = head_branches(head_fn, kit.head_zero)
    loop = _Loop(s, table, plan, chunks, head, micro, kit.hosted, slot_branches(kit), heads)
    carry = _start(kit, plan, micro, chunks, poison)
    carry, _ = lax.scan(lambda carry, row: _slot(loop, carry, row), carry, _slot_rows(table, plan))
    return _drain(carry, s, table.stages, rows)


# --- set-up: the types one forward keeps, and the buffers ----------------------------------


class _Kept(NamedTuple):
    """What one forward keeps for its backward: each residual's shape, the manual axes it
    varies over, and whether a remat policy moved it to host memory."""

    shapes: list
    axes: list[frozenset[str]]
    hosted: list[bool]


def _trace_forward(run: Chunk, chunk0, x0, side0) -> tuple[_Kept, dict]:
    """What one forward keeps, and zeros shaped like its statistics, from the forward traced
    once (this compiles to nothing).

    Each residual keeps the manual axes it varies over (plus pipe, as the ring's writes depend
    on the stage): a residual the same on every replica (an MoE's router statistics, averaged
    over the rows) must not come back varying, or its cotangents would not type.
    """
    res_axes: list[frozenset[str]] = []
    hosted: list[bool] = []

    def kept_and_stats(c, x, side):
        _, stats, kept = run.forward(c, x, side)
        res_axes[:] = [varying_axes(k) | {AXIS} for k in kept]
        hosted[:] = [on_host(k) for k in kept]
        return kept, stats

    res_shapes, stats_shape = jax.eval_shape(kept_and_stats, chunk0, x0, side0)
    stats_zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stats_shape)
    return _Kept(res_shapes, res_axes, hosted), stats_zero


def _cotangent_point(stats_loss, stats_zero: dict, chunks, micro: Microbatches) -> dict:
    """Where the statistics' loss term's gradient is taken: anywhere (zeros) when it is
    constant, else at the step's statistics, from `StatsLoss.totals`' forward of every
    microbatch."""
    if stats_loss is None or not _gradient_varies(stats_loss.term, stats_zero):
        return stats_zero
    if stats_loss.totals is None:
        raise ValueError(
            "the statistics' loss term is not linear in them (its gradient depends on the "
            "step's statistics): give StatsLoss.totals, a forward that gives them first"
        )
    totals = stats_loss.totals(chunks, micro)
    return jax.tree.map(lambda t, z: lax.stop_gradient(t).astype(z.dtype), totals, stats_zero)


def _gradient_varies(aux_fn, stats_zero: dict) -> bool:
    """Whether the gradient of `aux_fn` depends on the statistics: its jaxpr's outputs reached
    from its inputs (conservatively: every output of an equation that reads one)."""
    jaxpr = jax.make_jaxpr(jax.grad(aux_fn))(stats_zero).jaxpr
    reached = set(jaxpr.invars)

    def read(v) -> bool:
        return not isinstance(v, Literal) and v in reached

    for eqn in jaxpr.eqns:
        if any(read(v) for v in eqn.invars):
            reached.update(eqn.outvars)
    return any(read(v) for v in jaxpr.outvars)


def _stats_cotangent(aux_fn, point: dict, stats_zero: dict, rows: Rows) -> dict:
    """d loss / d stats of one microbatch, as this replica's share: `aux_fn`'s gradient at
    `point` (the step's statistics, or anywhere for a linear `aux_fn`), the same for every
    microbatch and stage, as each adds its statistics to the step's."""
    d_stats = {} if aux_fn is None else jax.grad(aux_fn)(point)
    # A statistic that varies over replica axes counts as their mean (`stage_totals`), so
    # each replica's share is 1/n of it.
    d_stats = jax.tree.map(
        lambda d, a: d / size(varying_axes(a) & set(rows.inner)), d_stats, stats_zero
    )
    # Inside the replicas' own region each replica's gradient is averaged with the others',
    # while a statistic the router reduced over them is the whole batch's: each replica's
    # share of its gradient is the whole of it (jax's transpose of that reduction says the
    # same for the loops it differentiates).
    return jax.tree.map(
        lambda d, a: d * size(tuple(x for x in rows.outer if x not in varying_axes(a))),
        d_stats,
        stats_zero,
    )


def _kit(run, plan: SlotPlan, head, example, kept: _Kept, stats_zero, d_stats, poison) -> Kit:
    """What the slot passes share: the residual rings, zb-h1's handover rings, and zeros
    shaped like the head and a chunk.

    `example` is ``(chunk, x, side)`` of one slot, typed as the slot's are.
    """
    chunk0, x0, _ = example
    # A residual a remat policy moved to host memory stays there: its ring is a host buffer,
    # one slot longer, whose last slot takes the writes of the slots that keep nothing (a
    # write is a dynamic update alone, no compute on host memory).
    depth = plan.depth["res"]
    residuals = [
        host_ring(r, depth, a) if h else _ring(r, depth, a, poison)
        for r, a, h in zip(kept.shapes, kept.axes, kept.hosted, strict=True)
    ]
    handovers, hand_axes = [], []
    if run.split:
        handovers, hand_axes = _handover_rings(run, plan, example, d_stats, poison)
    head_zero = jax.tree.map(jnp.zeros_like, head)
    chunk_zero = jax.tree.map(jnp.zeros_like, chunk0)
    return Kit(
        run, x0, stats_zero, chunk_zero, head_zero, d_stats,
        residuals, kept.axes, kept.hosted, handovers, hand_axes, poison,
    )  # fmt: skip


def _ring(shape, depth: int, axes, poison: bool) -> jax.Array:
    """A ring buffer of `depth` entries shaped like `shape`, typed to vary over `axes`."""
    return varying(fill(jnp.zeros((depth, *shape.shape), shape.dtype), poison), axes)


def _handover_rings(run: Chunk, plan: SlotPlan, example, d_stats, poison: bool):
    """zb-h1's rings of what the input pass hands the weight pass, and each entry's manual
    axes, from one forward and input pass traced once."""
    hand_axes: list[frozenset[str]] = []

    def handover_of(c, x, side):
        _, _, kept = run.forward(c, x, side)
        _, hand = run.input_pass(c, kept, varying(x), side, d_stats)
        hand_axes[:] = [varying_axes(h) | {AXIS} for h in hand]
        return hand

    hand_shapes = jax.eval_shape(handover_of, *example)
    depth = plan.depth["hand"]
    rings = [_ring(h, depth, a, poison) for h, a in zip(hand_shapes, hand_axes, strict=True)]
    return rings, hand_axes


class _Carry(NamedTuple):
    """The slot loop's state: the receive rings, the kept residuals and handovers, and the
    sums (loss, statistics, gradients)."""

    fin: jax.Array
    bin: jax.Array
    res: list
    hand: list
    loss: jax.Array
    totals: dict
    g_chunks: dict
    g_head: dict
    g_x: jax.Array


def _start(kit: Kit, plan: SlotPlan, micro: Microbatches, chunks, poison: bool) -> _Carry:
    """The loop's state before the first slot: empty rings and zero sums."""
    x0 = kit.x0
    fin = fill(jnp.zeros((plan.depth["fin"], *x0.shape), x0.dtype), poison)
    bin_ = fill(jnp.zeros((plan.depth["bin"], *x0.shape), x0.dtype), poison)
    return _Carry(
        *varying((fin, bin_)),
        kit.residuals,
        kit.handovers,
        *varying(
            (jnp.zeros((), jnp.float32), kit.stats_zero, jax.tree.map(jnp.zeros_like, chunks))
        ),
        varying(kit.head_zero),
        varying(fill(micro.x, poison)),
    )


def _slot_rows(table: ScheduleTable, plan: SlotPlan):
    """What the loop scans over, a row per slot: the table's phase, microbatch, chunk and
    permute pattern, and the plan's buffer entries read and written."""
    return (
        tuple(jnp.asarray(a) for a in (table.phase, table.micro, table.chunk, plan.pattern)),
        {k: jnp.asarray(a) for k, a in plan.read.items()},
        {k: jnp.asarray(a) for k, a in plan.write.items()},
    )


# --- the slot loop: read, run a pass (and the loss head), keep, send -----------------------


class _Loop(NamedTuple):
    """What every slot reads, fixed before the loop."""

    s: jax.Array  # this stage
    table: ScheduleTable
    plan: SlotPlan
    chunks: dict
    head: dict
    micro: Microbatches
    hosted: list[bool]  # which residual rings are in host memory
    branches: list  # the passes, by phase
    heads: tuple  # the loss head's branches: (run it, do nothing)


class _Task(NamedTuple):
    """What this stage runs in a slot: its phase, microbatch and local chunk, the chunk's
    parameters, and whether it is the model's first or last chunk."""

    phase: jax.Array
    i: jax.Array
    r: jax.Array
    c: dict
    first: jax.Array
    model_last: jax.Array


def _slot(loop: _Loop, carry: _Carry, row) -> tuple[_Carry, None]:
    """One slot on this stage: read its inputs, run its pass and the loss head, keep what
    they make, and send the outputs on."""
    (ph_row, mb_row, r_row, pat), reads, writes = row
    task = _task(loop, ph_row, mb_row, r_row)
    x_in, cot, stored, hand_in = _read(loop, carry, task, reads)
    out = lax.switch(
        task.phase, loop.branches, task.c, x_in, at(loop.micro.side, task.i), cot, stored, hand_in
    )
    head_out = _head(loop, ph_row, mb_row, r_row, out.y)
    carry = _keep(loop, carry, task, out, head_out, writes)
    return _send_on(loop, carry, out, pat, writes), None


def _task(loop: _Loop, ph_row, mb_row, r_row) -> _Task:
    """This stage's entries of the slot's row of the table."""
    s, p, v = loop.s, loop.table.stages, loop.table.repeats
    ph, i, r = ph_row[s], jnp.maximum(mb_row[s], 0), jnp.maximum(r_row[s], 0)
    c = jax.tree.map(lambda a: a[r], loop.chunks)
    first, model_last = (s == 0) & (r == 0), (s == p - 1) & (r == v - 1)
    return _Task(ph, i, r, c, first, model_last)


def _read(loop: _Loop, carry: _Carry, task: _Task, reads):
    """The pass's inputs: the activation (the microbatch itself for the model's first chunk),
    the cotangent, the stored residuals and handover."""
    s = loop.s
    x_in = jnp.where(task.first, loop.micro.x[task.i], carry.fin[reads["fin"][s]])
    cot = carry.bin[reads["bin"][s]]
    stored = [b[reads["res"][s]] for b in carry.res]
    hand_in = [b[reads["hand"][s]] for b in carry.hand]
    return x_in, cot, stored, hand_in


def _head(loop: _Loop, ph_row, mb_row, r_row, y):
    """``(loss, g_head, dy)`` of the loss head on the last stage, in the slot where it runs
    the model's last chunk's forward (zeros elsewhere)."""
    p, v = loop.table.stages, loop.table.repeats
    last_fwd = (ph_row[p - 1] == FWD) & (r_row[p - 1] == v - 1)
    last_mb = jnp.maximum(mb_row[p - 1], 0)
    here = last_fwd & (loop.s == p - 1)
    return lax.cond(here, *loop.heads, loop.head, y, at(loop.micro.labels, last_mb))


def _keep(loop: _Loop, carry: _Carry, task: _Task, out: PassOut, head_out, writes) -> _Carry:
    """The slot's writes: the residuals and handover kept, and the sums grown."""
    s, ph = loop.s, task.phase
    loss_i, g_head_i, dy = head_out
    is_f, is_b = ph == FWD, ph == BWD
    res = [
        put_host(b, k, writes["res"][s], is_f) if h else put(b, k, writes["res"][s], is_f)
        for b, k, h in zip(carry.res, out.kept, loop.hosted, strict=True)
    ]
    hand = [put(b, h, writes["hand"][s], is_b) for b, h in zip(carry.hand, out.hand, strict=True)]
    loss = jnp.where(is_f & task.model_last, carry.loss + loss_i, carry.loss)
    totals = jax.tree.map(lambda a, b: jnp.where(is_f, a + b, a), carry.totals, out.stats)
    grad_phase = WGT if loop.table.schedule == "zb-h1" else BWD
    g_chunks = jax.tree.map(
        lambda a, g: put(a, a[task.r] + g, task.r, ph == grad_phase), carry.g_chunks, out.g_chunk
    )
    g_head = jax.tree.map(
        lambda a, g: jnp.where(is_f & task.model_last, a + g, a), carry.g_head, g_head_i
    )
    g_x = put(carry.g_x, out.dx, task.i, is_b & task.first)
    bin_ = _put_at(carry.bin, dy, writes["head"], s)
    return carry._replace(
        bin=bin_, res=res, hand=hand, loss=loss, totals=totals, g_chunks=g_chunks, g_head=g_head,
        g_x=g_x,
    )  # fmt: skip


def _send_on(loop: _Loop, carry: _Carry, out: PassOut, pat, writes) -> _Carry:
    """The slot's permutes, and what arrives written into the receive rings."""
    s = loop.s
    y_recv, dx_recv = send(loop.plan.patterns, pat, out.y, out.dx)
    fin = _put_at(carry.fin, y_recv, writes["fin"], s)
    bin_ = _put_at(carry.bin, dx_recv, writes["bin"], s)
    return carry._replace(fin=fin, bin=bin_)


def _put_at(buf: jax.Array, value: jax.Array, entries, s) -> jax.Array:
    """`value` written into the ring entry stage `s` writes in the slot, when it names one
    (−1: none)."""
    return put(buf, value, jnp.maximum(entries[s], 0), entries[s] >= 0)


def _drain(carry: _Carry, s, p: int, rows: Rows):
    """After the last slot: the loss and head gradients summed from the last stage, the
    statistics over the stages, and the input gradients from the first."""
    loss = lax.psum(jnp.where(s == p - 1, carry.loss, 0.0), (AXIS, *rows.inner))
    g_head = jax.tree.map(
        lambda g: lax.psum(jnp.where(s == p - 1, g, 0), (AXIS, *rows.inner)), carry.g_head
    )
    g_x = from_stage(carry.g_x, 0)
    return loss, stage_totals(carry.totals, rows.inner), carry.g_chunks, g_head, g_x
