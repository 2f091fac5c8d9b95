"""The pipelined loss and gradients of any model that offers `PipelineParts`.

The model's stacked blocks are cut into ``pipe × repeats`` contiguous chunks of layers; stage
s holds chunks s, s+p, s+2p, ... (just chunk s unless the schedule is circular). The
embedding and the head run outside the pipelined loop, partitioned by the compiler like the
rest of the model. The loop is manual over ``pipe`` and the replica axes
(`Rules.replica_axes`) and, for a model with experts, ``expert`` (which splits the batch as
well as the experts), each shard running its own rows of every microbatch. The executors are
in `meshtrain.pipeline.spmd`.

A packed batch's segment ids and positions are split into microbatches like the inputs and
reach each stage with the microbatch it runs; its loss is the sum over the real tokens of the
whole batch divided by their count. A model whose blocks return statistics (an MoE's router
losses) has them summed over the stages, averaged over the microbatches, and turned into its
loss terms and metrics by `PipelineParts.stats`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshtrain.layout import (
    active,
    constrain,
    manual_axes,
    manual_region,
    merge_microbatches,
    override_activations,
    split_microbatches,
    varying,
)
from meshtrain.mesh import EXPERT, PIPE, mesh_sizes
from meshtrain.pipeline import spmd
from meshtrain.pipeline.config import PipelineConfig
from meshtrain.pipeline.cut import Cut
from meshtrain.pipeline.layers import as_chunks, from_chunks, model_order, stage_order
from meshtrain.pipeline.schedules import HAND_SCHEDULED, ScheduleTable, schedule_table
from meshtrain.pipeline.specs import reduce_grads, without
from meshtrain.precision.loss_scale import scale_backward

LossFn = Callable[..., jax.Array]


def _rows(mesh: Mesh, outer: bool = False) -> tuple[str, ...]:
    """The axes the loop's rows are split over by hand: the replica axes of the active layout,
    and ``expert`` where it splits the batch (none outside `activation_rules`). With `outer`,
    those an enclosing region is already manual over instead (the replicas' own step, where
    each replica runs alone)."""
    layout = active()
    if layout is None:
        return ()
    sizes = mesh_sizes(mesh)
    replicas = layout.rules.replica_axes(sizes)
    extra = (EXPERT,) if EXPERT in layout.rules.batch_axes(sizes) else ()
    manual = manual_axes()
    rows = tuple(replicas) + tuple(a for a in extra if a not in replicas)
    return tuple(a for a in rows if (a in manual) == outer)


def _gathered(mesh: Mesh, config: PipelineConfig, rows: tuple[str, ...]) -> tuple[str, ...]:
    """With ``gather_once``: the batch axes that split the stage weights (fsdp; data too
    under the fsdp preset), which the region then takes by hand, the weights whole."""
    layout = active()
    if not config.gather_once or layout is None:
        return ()
    outer = manual_axes()
    axes = layout.rules.batch_axes(mesh_sizes(mesh))
    return tuple(a for a in axes if a not in rows and a not in outer)


class _Pipe(NamedTuple):
    """One call's pipeline: p stages, m microbatches, v chunks per stage, the model in pieces,
    and the axes the region splits the rows over by hand (the `gathered` ones among them)."""

    p: int
    m: int
    v: int
    cut: Cut
    rows: tuple[str, ...]
    gathered: tuple[str, ...]


def _sizes(config: PipelineConfig, mesh: Mesh) -> tuple[int, int, int]:
    """``(p, m, v)``: the stages, the microbatches and the chunks per stage."""
    p = mesh_sizes(mesh)[PIPE]
    return p, config.num_microbatches(p), config.chunks_per_stage()


def _pipe(graphdef, params, rest, batch, config: PipelineConfig, mesh: Mesh) -> _Pipe:
    """The pipeline of one call of `pipeline_loss` or `pipeline_loss_and_grads`."""
    p, m, v = _sizes(config, mesh)
    cut = Cut(graphdef, params, rest, batch)
    rows = _rows(mesh)
    gathered = _gathered(mesh, config, rows)
    return _Pipe(p, m, v, cut, rows + gathered, gathered)


def _over_pipe(fn, mesh: Mesh, rows: tuple[str, ...], in_specs, out_specs):
    """`fn` manual over ``pipe`` and `rows`; the other axes stay with the compiler. Inside
    the replicas' own step (`meshtrain.replicas`, manual over pipe and them already) `fn`
    itself: its arguments are already the blocks the region would give it."""
    axes = {spmd.AXIS, *rows}
    if axes <= manual_axes():
        return fn
    return manual_region(fn, mesh=mesh, axes=axes, in_specs=in_specs, out_specs=out_specs)


def _mask(batch: Mapping) -> jax.Array | None:
    """The tokens a packed batch's loss counts (``segment_ids > 0``); None when not packed."""
    seg = batch.get("segment_ids")
    return None if seg is None else seg > 0


def _task_loss(loss_fn: LossFn, logits: jax.Array, targets: jax.Array, mask) -> jax.Array:
    """`loss_fn` on the logits, over the real tokens when there is a `mask`."""
    return loss_fn(logits, targets) if mask is None else loss_fn(logits, targets, mask=mask)


def _with_stats(cut: Cut, task: jax.Array, totals: dict, m: int):
    """``(loss, metrics)``: the task loss plus the statistics' loss terms, and the metrics
    (with ``task_loss`` when there are statistics, as `meshtrain.loss` reports it)."""
    if cut.stats is None:
        return task, {}
    aux, metrics = cut.finish(totals, m)
    return task + aux, {**metrics, "task_loss": task}


def pipeline_loss(
    graphdef: nnx.GraphDef,
    params: dict,
    rest: dict,
    batch: Mapping[str, jax.Array],
    *,
    config: PipelineConfig,
    mesh: Mesh,
    loss_fn: LossFn,
    with_metrics: bool = False,
):
    """Mean loss of the model over `batch`, its blocks run by the gpipe / circular forward loop
    (the hand-scheduled ones evaluate with the gpipe or circular loop). Differentiable with
    `jax.grad`.

    A packed batch (``segment_ids`` and ``positions``) averages over its real tokens: `loss_fn`
    is called with ``mask=segment_ids > 0``. A model whose blocks return statistics (an MoE)
    adds their loss terms (`PipelineParts.stats`), each microbatch's weighted 1/M.

    Call it inside `jax.jit` under `meshtrain.layout.activation_rules(mesh, rules)`.

    Returns:
        The loss; with `with_metrics`, ``(loss, metrics)`` (the model's statistics and
        ``task_loss``; empty for a model without statistics).
    """
    pipe = _pipe(graphdef, params, rest, batch, config, mesh)
    cut, m = pipe.cut, pipe.m
    parts = cut.parts(params)
    x_MbTD = split_microbatches(cut.embed(parts, batch), m)
    side_Mb = cut.side(batch, m)
    blocks = stage_order(params[cut.key], cut.n_layers, pipe.p, pipe.v)
    rows = P(None, pipe.rows or None)  # [M, b, ...]: each shard its rows of every microbatch
    # Gathered weights enter whole; their gradient, varying over the gathered axes inside,
    # is summed over them once, as the region's input is transposed.
    specs = without(cut.block_specs(mesh, {spmd.AXIS, *pipe.rows}), pipe.gathered)
    # The embedded batch crosses into the loop in float32: its gradient is summed over the
    # stages on the way out, and XLA's CPU backend aborts on a bfloat16 all-reduce there.
    body = _forward_body(pipe, x_MbTD.dtype)
    run = _over_pipe(body, mesh, pipe.rows, (specs, rows, rows), (rows, P()))
    y_MbTD, totals = run(blocks, x_MbTD.astype(jnp.float32), side_Mb)
    y_BTD = constrain(merge_microbatches(y_MbTD), ("batch", "seq", "embed"))
    task = _task_loss(loss_fn, parts.head(y_BTD), batch["targets"], _mask(batch))
    loss, metrics = _with_stats(cut, task, totals, m)
    return (loss, metrics) if with_metrics else loss


def _forward_body(pipe: _Pipe, dtype) -> Callable:
    """The gpipe / circular region: ``(blocks, x_MbTD, side_Mb) -> (y_MbTD, stats)``."""

    def body(blocks, x_MbTD, side_Mb):
        chunks = varying(as_chunks(blocks, pipe.v))  # grads summed over replicas after it
        # Cast after marking it per-stage, so its gradient's sum over stages is in float32.
        x_MbTD = varying(x_MbTD).astype(dtype)
        return spmd.forward_loop(
            pipe.cut.stage,
            chunks,
            x_MbTD,
            side_Mb,
            stages=pipe.p,
            repeats=pipe.v,
            rows=pipe.rows,
            poison=spmd.poisoning(),
        )

    return body


def pipeline_loss_and_grads(
    graphdef: nnx.GraphDef,
    params: dict,
    rest: dict,
    batch: Mapping[str, jax.Array],
    *,
    config: PipelineConfig,
    mesh: Mesh,
    loss_fn: LossFn,
    with_metrics: bool = False,
    loss_scale: jax.Array | None = None,
):
    """Mean loss and its gradient with respect to `params`, pipelined by ``config.schedule``.

    gpipe and circular differentiate `pipeline_loss`; 1f1b, interleaved-1f1b and zb-h1 run
    their hand-scheduled backward (`meshtrain.pipeline.spmd.scheduled`).
    `loss_fn` must be a mean over examples (as cross-entropy is), so that the mean of the
    microbatch losses is the loss of the whole batch; on a packed batch it is called with
    ``mask=`` and each microbatch's mean is weighted by its share of the batch's real tokens.
    The loss terms of the blocks' statistics (an MoE's router losses) are each microbatch's,
    weighted 1/M, as gradient accumulation over M microbatches weighs them.
    With `loss_scale` (float16's dynamic loss scaling), every loss term's backward starts from
    the scale (`meshtrain.precision.loss_scale.scale_backward`): the gradients come out
    scaled, the loss does not.

    Returns:
        ``(loss, grads)``, `grads` shaped like `params`; with `with_metrics`,
        ``((loss, metrics), grads)`` (see `pipeline_loss`).
    """

    def scaled(loss):
        return loss if loss_scale is None else scale_backward(loss, loss_scale)

    if config.schedule not in HAND_SCHEDULED:

        def whole(prm):
            loss, metrics = pipeline_loss(
                graphdef, prm, rest, batch, config=config, mesh=mesh, loss_fn=loss_fn,
                with_metrics=True,
            )  # fmt: skip
            return scaled(loss), metrics

        (loss, metrics), grads = jax.value_and_grad(whole, has_aux=True)(params)
    else:
        table = schedule_table(config.schedule, *_sizes(config, mesh))  # before the model's
        pipe = _pipe(graphdef, params, rest, batch, config, mesh)
        n = math.prod(mesh_sizes(mesh)[a] for a in pipe.rows)  # each shard's loss is 1/n of it
        weighted = _Weighted(loss_fn, scaled, pipe.m, n)
        (loss, metrics), grads = _hand_scheduled(pipe, table, params, batch, mesh, weighted)
    return ((loss, metrics), grads) if with_metrics else (loss, grads)


class _Weighted(NamedTuple):
    """How a microbatch's loss terms are computed and weighted inside the region."""

    loss_fn: LossFn
    scaled: Callable[[jax.Array], jax.Array]  # the loss scale's start of the backward
    m: int  # microbatches
    n: int  # row shards


def _hand_scheduled(pipe: _Pipe, table: ScheduleTable, params, batch, mesh, weighted: _Weighted):
    """``((loss, metrics), grads)`` of a hand-scheduled pipeline: the embedding's vjp, the
    region that runs the schedule, and the gradients put together."""
    cut, key = pipe.cut, pipe.cut.key
    outer = {k: w for k, w in params.items() if k != key}

    def embed(outer):
        return cut.embed(cut.parts({**outer, key: params[key]}), batch)

    x_BTD, embed_vjp = jax.vjp(embed, outer)
    micro, count = _microbatches(cut, batch, x_BTD, pipe.m)
    rows = P(None, pipe.rows or None)
    specs = cut.block_specs(mesh, {spmd.AXIS, *pipe.rows})  # the gradients'
    specs_whole = without(specs, pipe.gathered)  # the weights', whole over the gathered axes
    region_rows = spmd.Rows(pipe.rows, _rows(mesh, outer=True))  # read outside the region
    body = _scheduled_body(pipe, table, weighted, region_rows, specs)
    blocks = stage_order(params[key], cut.n_layers, pipe.p, pipe.v)
    specs_in = (specs_whole, P(), rows, rows, rows, P())
    run = _over_pipe(body, mesh, pipe.rows, specs_in, (P(), P(), specs, P(), rows))
    task, totals, g_blocks, g_head, g_x = run(blocks, outer, *micro, count)
    g_blocks = model_order(g_blocks, cut.n_layers, pipe.p, pipe.v)
    (grads,) = embed_vjp(constrain(merge_microbatches(g_x), ("batch", "seq", "embed")))
    for k in cut.head_keys:
        grads[k] = jax.tree.map(jnp.add, grads[k], g_head[k])
    grads[key] = g_blocks
    return _with_stats(cut, task, totals, pipe.m), grads


def _microbatches(cut: Cut, batch, x_BTD, m: int) -> tuple[spmd.Microbatches, jax.Array]:
    """The embedded batch, the blocks' side inputs and the head's labels as `m` microbatches,
    and the count of the whole batch's real tokens (1 unless packed)."""
    x_MbTD = split_microbatches(x_BTD, m)
    side_Mb = cut.side(batch, m)
    labels_Mb = {"targets": split_microbatches(batch["targets"], m)}
    mask = _mask(batch)
    if mask is not None:
        labels_Mb["mask"] = split_microbatches(mask, m)
        count = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)  # the whole batch's
    else:
        count = jnp.ones((), jnp.float32)
    return spmd.Microbatches(x_MbTD, side_Mb, labels_Mb), count


def _scheduled_body(pipe: _Pipe, table, weighted: _Weighted, rows: spmd.Rows, specs) -> Callable:
    """The hand-scheduled region: ``(blocks, outer, x, side, labels, count) -> (loss, stats,
    block grads, head grads, x grads)``, the block gradients reduced to their specs."""
    cut = pipe.cut

    def aux_fn(stats):
        """The statistics' loss terms, of the step's statistics (their mean over the M
        microbatches; one microbatch's weighted 1/M, for terms linear in them)."""
        return weighted.scaled(cut.finish(stats, pipe.m)[0])

    def totals_fn(chunks, micro: spmd.Microbatches):
        """The step's statistics from the gpipe / circular forward alone (a loss term not
        linear in them, such as Mixtral's pooled load-balancing loss, needs them before the
        first backward)."""
        return spmd.forward_loop(
            cut.stage,
            chunks,
            varying(micro.x),
            micro.side,
            stages=pipe.p,
            repeats=pipe.v,
            rows=pipe.rows,
            poison=spmd.poisoning(),
        )[1]

    def body(blocks, outer, x_MbTD, side_Mb, labels_Mb, count):
        # This stage's chunks [v, Lc, ...]; local chunk r is the model's chunk r·p + stage.
        chunks = as_chunks(blocks, pipe.v)
        head_fn = _head_fn(cut, outer, chunks, weighted, count)
        h = {k: outer[k] for k in cut.head_keys}
        loss, totals, g_chunks, g_head, g_x = spmd.scheduled(
            cut.stage,
            head_fn,
            chunks,
            h,
            spmd.Microbatches(x_MbTD, side_Mb, labels_Mb),
            table,
            stats_loss=None if cut.stats is None else spmd.StatsLoss(aux_fn, totals_fn),
            rows=rows,
            poison=spmd.poisoning(),
        )
        g_blocks = reduce_grads(from_chunks(g_chunks), specs, pipe.rows, pipe.gathered)
        return loss, totals, g_blocks, g_head, g_x

    return body


def _head_fn(cut: Cut, outer: dict, chunks: dict, weighted: _Weighted, count) -> Callable:
    """The loss head of one microbatch in a slot, ``(head, y_bTD, labels) -> loss``, weighted
    by its share of the batch's loss."""
    loss_fn, scaled, m, n = weighted

    def head_fn(h, y_bTD, labels):
        parts = cut.parts({**outer, **h, cut.key: jax.tree.map(lambda c: c[0], chunks)})
        # Logits split over vocab inside the stage loop trip XLA's partitioner (a failed
        # check in spmd_partitioner_util on jax 0.12); keep them whole over tensor here.
        with override_activations(vocab=None):
            logits = parts.head(y_bTD)
            if "mask" not in labels:
                return scaled(loss_fn(logits, labels["targets"]) / (m * n))
            # This shard's mean over its real tokens, weighted by their share of the
            # batch's: the sum over the microbatches and shards is the batch's mean.
            share = jnp.sum(labels["mask"]).astype(jnp.float32) / count
            return scaled(loss_fn(logits, labels["targets"], mask=labels["mask"]) * share)

    return head_fn
