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

The executors' pieces, a module a role: `meshtrain.pipeline.buffers` (fills, masked ring
writes, `poison_buffers`), `meshtrain.pipeline.collectives` (the permutes and the sums over
``pipe``), `meshtrain.pipeline.chunk` (a chunk's forward and backward),
`meshtrain.pipeline.passes` (what a slot can run) and `meshtrain.pipeline.hand_scheduled`
(`scheduled`, in stages).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain.layout import varying
from meshtrain.pipeline.buffers import at, fill, poison_buffers, poisoning, put
from meshtrain.pipeline.chunk import StageFn
from meshtrain.pipeline.collectives import AXIS, from_stage, pass_on, stage_totals
from meshtrain.pipeline.hand_scheduled import Microbatches, Rows, StatsLoss, scheduled
from meshtrain.pipeline.schedules import forward_ticks
from meshtrain.pipeline.slots import tick_patterns

__all__ = [
    "AXIS",
    "Microbatches",
    "Rows",
    "StatsLoss",
    "StageFn",
    "forward_loop",
    "poison_buffers",
    "poisoning",
    "scheduled",
]


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
    outputs = varying(fill(x_MbTD, poison))
    recv = varying(fill(x0, poison))
    # Outputs of the last stage waiting at stage 0 for their next round (circular only).
    pending = varying(fill(x_MbTD, poison)) if v > 1 else None
    first_chunk = jax.tree.map(lambda c: c[0], chunks)
    stats_shape = jax.eval_shape(stage_fn, first_chunk, x0, at(side_Mb, 0))[1]
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
            pending = put(pending, recv, jnp.maximum(k_prev, 0) % m, back)
            first = jnp.where(r == 0, x_MbTD[i], pending[i])
        else:
            first = x_MbTD[i]
        x_in = jnp.where(s == 0, first, recv)
        x_in = jnp.where(ok, x_in, jnp.zeros_like(x_in))  # bubbles compute on zeros, never NaN
        params = jax.tree.map(lambda c: c[r], chunks)
        y, stats = stage_fn(params, x_in, at(side_Mb, i))
        totals = jax.tree.map(lambda a, b: a + jnp.where(ok, b, jnp.zeros_like(b)), totals, stats)
        outputs = put(outputs, y, i, ok & (s == p - 1) & (r == v - 1))
        recv = pass_on(patterns, pat, y)
        return (recv, pending, outputs, totals), None

    ticks = (
        jnp.arange(len(valid)),
        *(jnp.asarray(a) for a in (valid, micro, chunk, pattern)),
    )
    (_, _, outputs, totals), _ = lax.scan(tick, (recv, pending, outputs, totals), ticks)
    # Only the last stage holds the outputs; the others contribute zeros.
    return from_stage(outputs, p - 1), stage_totals(totals, rows)
