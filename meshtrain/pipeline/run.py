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

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
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
    state_specs,
    varying,
)
from meshtrain.mesh import EXPERT, PIPE, mesh_sizes
from meshtrain.models.base import PACKED_KEYS, PipelineParts, pipeline_parts
from meshtrain.pipeline import spmd
from meshtrain.pipeline.config import PipelineConfig
from meshtrain.pipeline.schedules import HAND_SCHEDULED, schedule_table
from meshtrain.precision.loss_scale import scale_backward

LossFn = Callable[..., jax.Array]


def _circular_order(n_layers: int, p: int, v: int) -> jax.Array:
    """Layer order that gives stage s the chunks s, s+p, ... as one contiguous slice."""
    lc = n_layers // (p * v)
    order = [(r * p + s) * lc + j for s in range(p) for r in range(v) for j in range(lc)]
    return jnp.asarray(order, jnp.int32)


class _Cut:
    """A model in pieces: its parts, and its stacked blocks as chunks the stages run."""

    def __init__(self, graphdef: nnx.GraphDef, params: dict, rest: dict, batch: Mapping):
        self.graphdef, self.rest = graphdef, rest
        model = nnx.merge(graphdef, params, rest)
        parts = pipeline_parts(model)
        if parts is None:
            raise ValueError(
                f"pipelining needs a model with a pipeline_parts() method (see "
                f"meshtrain.models.PipelineParts); {type(model).__name__} has none: set pipe=1"
            )
        if jax.tree.leaves(rest):
            raise ValueError(
                "pipelining supports models whose only variables are parameters; this model "
                f"also has {', '.join(rest)}"
            )
        self.packed = any(k in batch for k in PACKED_KEYS)
        if self.packed and not parts.packed:
            raise ValueError(
                f"model {type(model).__name__}: a packed batch (segment_ids/positions) needs "
                "pipeline_parts() with packed=True, whose embed and run_blocks take them (see "
                "meshtrain.models.PipelineParts); or train on plain windows (--data.no-packing)"
            )
        self.key, self.run_blocks, self.stats = parts.blocks, parts.run_blocks, parts.stats
        blocks = getattr(model, parts.blocks)
        self.blocks_def = nnx.split(blocks)[0]
        self.blocks_state = nnx.state(blocks)  # their logical names, for `block_specs`
        self.n_layers = jax.tree.leaves(params[parts.blocks])[0].shape[0]
        self.head_keys = tuple(k for k in parts.head_params if k in params)

    def parts(self, params: dict) -> PipelineParts:
        """The parts of the model over `params` (its blocks may be any chunk of the layers)."""
        return nnx.merge(self.graphdef, params, self.rest).pipeline_parts()

    def embed(self, parts: PipelineParts, batch: Mapping) -> jax.Array:
        """The embedded batch (with its positions, when packed)."""
        if self.packed:
            return parts.embed(batch["inputs"], batch["positions"])
        return parts.embed(batch["inputs"])

    def side(self, batch: Mapping, m: int) -> dict:
        """The batch's inputs to the blocks, as microbatches [M, b, T] (none unless packed)."""
        keys = PACKED_KEYS if self.packed else ()
        return {k: split_microbatches(batch[k], m) for k in keys}

    def stage(self, chunk: dict, x: jax.Array, side: dict) -> tuple[jax.Array, dict]:
        """Runs one chunk of stacked blocks on one microbatch; its output and statistics."""
        blocks = nnx.merge(self.blocks_def, chunk)
        args = tuple(side[k] for k in PACKED_KEYS) if side else ()
        out = self.run_blocks(blocks, x, *args)
        return out if self.stats is not None else (out, {})

    def finish(self, totals: dict, m: int) -> tuple[jax.Array, dict]:
        """The loss terms and metrics of the statistics summed over `m` microbatches."""
        if self.stats is None:
            return jnp.zeros((), jnp.float32), {}
        return self.stats(jax.tree.map(lambda t: t / m, totals))

    def block_specs(self, mesh: Mesh, manual: set[str]) -> dict:
        """The blocks' specs over the region's manual axes: ``layers`` over pipe, and any
        dimension the rules split over another manual axis (experts over expert)."""
        layout = active()
        if layout is None or manual <= manual_axes():  # no region to make (see `_over_pipe`)
            return jax.tree.map(lambda _: P(PIPE), nnx.to_pure_dict(self.blocks_state))

        def keep(spec: P) -> P:
            kept = []
            for entry in spec:
                axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()))
                axes = tuple(a for a in axes if a in manual)
                kept.append(axes[0] if len(axes) == 1 else (axes or None))
            return P(*kept)

        specs = state_specs(self.blocks_state, layout.rules.params, mesh, warn=False)
        return jax.tree.map(keep, specs, is_leaf=lambda x: isinstance(x, P))


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


def _without(specs: dict, axes: tuple[str, ...]) -> dict:
    """`specs` with `axes` dropped: the blocks as the region takes them, gathered over them."""

    def drop(spec: P) -> P:
        kept = []
        for entry in spec:
            names = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()))
            names = tuple(a for a in names if a not in axes)
            kept.append(names[0] if len(names) == 1 else (names or None))
        return P(*kept)

    return jax.tree.map(drop, specs, is_leaf=lambda x: isinstance(x, P))


def _reduce_grad(g: jax.Array, spec: P, rows: tuple[str, ...], gathered: tuple[str, ...]):
    """A block's gradient summed over the row shards that share it: summed over every row axis
    its spec does not split (the experts' own shards keep theirs), and reduce-scattered over
    the gathered axes back to the dimension they split."""
    g = _sum_over(g, tuple(a for a in rows if a not in _axes(spec)))
    for dim, entry in enumerate(spec):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        scatter = tuple(a for a in names if a in gathered)
        if scatter:
            g = lax.psum_scatter(g, scatter, scatter_dimension=dim, tiled=True)
    return g


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


def _with_stats(cut: _Cut, task: jax.Array, totals: dict, m: int):
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
    p = mesh_sizes(mesh)[PIPE]
    m = config.num_microbatches(p)
    v = config.chunks_per_stage()
    cut = _Cut(graphdef, params, rest, batch)
    parts = cut.parts(params)
    x_MbTD = split_microbatches(cut.embed(parts, batch), m)
    side_Mb = cut.side(batch, m)
    blocks = params[cut.key]
    if v > 1:
        order = _circular_order(cut.n_layers, p, v)
        blocks = jax.tree.map(lambda w: jnp.take(w, order, axis=0), blocks)

    dtype = x_MbTD.dtype
    rows_axes = _rows(mesh)
    gathered = _gathered(mesh, config, rows_axes)
    rows_axes += gathered
    rows = P(None, rows_axes or None)  # [M, b, ...]: each shard its rows of every microbatch
    # Gathered weights enter whole; their gradient, varying over the gathered axes inside,
    # is summed over them once, as the region's input is transposed.
    specs = _without(cut.block_specs(mesh, {spmd.AXIS, *rows_axes}), gathered)

    def body(blocks, x_MbTD, side_Mb):
        chunks = jax.tree.map(lambda w: w.reshape(v, w.shape[0] // v, *w.shape[1:]), blocks)
        chunks = varying(chunks)  # their gradient is summed over replicas after the loop
        # Cast after marking it per-stage, so its gradient's sum over stages is in float32.
        x_MbTD = varying(x_MbTD).astype(dtype)
        return spmd.forward_loop(
            cut.stage,
            chunks,
            x_MbTD,
            side_Mb,
            stages=p,
            repeats=v,
            rows=rows_axes,
            poison=spmd.poisoning(),
        )

    # The embedded batch crosses into the loop in float32: its gradient is summed over the
    # stages on the way out, and XLA's CPU backend aborts on a bfloat16 all-reduce there.
    run = _over_pipe(body, mesh, rows_axes, (specs, rows, rows), (rows, P()))
    y_MbTD, totals = run(blocks, x_MbTD.astype(jnp.float32), side_Mb)
    y_BTD = constrain(merge_microbatches(y_MbTD), ("batch", "seq", "embed"))
    task = _task_loss(loss_fn, parts.head(y_BTD), batch["targets"], _mask(batch))
    loss, metrics = _with_stats(cut, task, totals, m)
    return (loss, metrics) if with_metrics else loss


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
    kwargs = dict(config=config, mesh=mesh, loss_fn=loss_fn)

    def scaled(loss):
        return loss if loss_scale is None else scale_backward(loss, loss_scale)

    if config.schedule not in HAND_SCHEDULED:

        def whole(prm):
            loss, metrics = pipeline_loss(graphdef, prm, rest, batch, with_metrics=True, **kwargs)
            return scaled(loss), metrics

        (loss, metrics), grads = jax.value_and_grad(whole, has_aux=True)(params)
        return ((loss, metrics), grads) if with_metrics else (loss, grads)

    p = mesh_sizes(mesh)[PIPE]
    m = config.num_microbatches(p)
    v = config.chunks_per_stage()
    table = schedule_table(config.schedule, p, m, v)
    cut = _Cut(graphdef, params, rest, batch)
    key = cut.key
    outer = {k: w for k, w in params.items() if k != key}

    def embed(outer):
        return cut.embed(cut.parts({**outer, key: params[key]}), batch)

    x_BTD, embed_vjp = jax.vjp(embed, outer)
    x_MbTD = split_microbatches(x_BTD, m)
    side_Mb = cut.side(batch, m)
    labels_Mb = {"targets": split_microbatches(batch["targets"], m)}
    mask = _mask(batch)
    if mask is not None:
        labels_Mb["mask"] = split_microbatches(mask, m)
        count = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)  # the whole batch's
    else:
        count = jnp.ones((), jnp.float32)
    rows_axes = _rows(mesh)
    outer_rows = _rows(mesh, outer=True)  # read here, outside the region this opens
    gathered = _gathered(mesh, config, rows_axes)
    rows_axes += gathered
    n = math.prod(mesh_sizes(mesh)[a] for a in rows_axes)  # each shard's loss is 1/n of it
    rows = P(None, rows_axes or None)
    specs = cut.block_specs(mesh, {spmd.AXIS, *rows_axes})  # the gradients'
    specs_whole = _without(specs, gathered)  # the weights', whole over the gathered axes

    def aux_fn(stats):
        """One microbatch's loss terms: the statistics' terms weighted 1/M."""
        return scaled(cut.finish(stats, m)[0])

    def body(blocks, outer, x_MbTD, side_Mb, labels_Mb, count):
        # This stage's chunks [v, Lc, ...]; local chunk r is the model's chunk r·p + stage.
        chunks = jax.tree.map(lambda w: w.reshape(v, w.shape[0] // v, *w.shape[1:]), blocks)

        def head_fn(h, y_bTD, labels):
            parts = cut.parts({**outer, **h, key: jax.tree.map(lambda c: c[0], chunks)})
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

        h = {k: outer[k] for k in cut.head_keys}
        loss, totals, g_chunks, g_head, g_x = spmd.scheduled(
            cut.stage,
            head_fn,
            chunks,
            h,
            spmd.Microbatches(x_MbTD, side_Mb, labels_Mb),
            table,
            aux_fn=aux_fn if cut.stats is not None else None,
            rows=spmd.Rows(rows_axes, outer_rows),
            poison=spmd.poisoning(),
        )
        g_blocks = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), g_chunks)
        g_blocks = jax.tree.map(
            lambda g, spec: _reduce_grad(g, spec, rows_axes, gathered),
            g_blocks,
            specs,
            is_leaf=lambda x: isinstance(x, P),
        )
        return loss, totals, g_blocks, g_head, g_x

    blocks = params[key]
    if v > 1:
        order = _circular_order(cut.n_layers, p, v)
        blocks = jax.tree.map(lambda w: jnp.take(w, order, axis=0), blocks)
    specs_in = (specs_whole, P(), rows, rows, rows, P())
    run = _over_pipe(body, mesh, rows_axes, specs_in, (P(), P(), specs, P(), rows))
    task, totals, g_blocks, g_head, g_x = run(blocks, outer, x_MbTD, side_Mb, labels_Mb, count)
    if v > 1:  # back to the model's layer order
        inverse = jnp.argsort(_circular_order(cut.n_layers, p, v))
        g_blocks = jax.tree.map(lambda g: jnp.take(g, inverse, axis=0), g_blocks)
    (grads,) = embed_vjp(constrain(merge_microbatches(g_x), ("batch", "seq", "embed")))
    for k in cut.head_keys:
        grads[k] = jax.tree.map(jnp.add, grads[k], g_head[k])
    grads[key] = g_blocks
    loss, metrics = _with_stats(cut, task, totals, m)
    return ((loss, metrics), grads) if with_metrics else (loss, grads)


def _axes(spec: P) -> set[str]:
    """The mesh axes a spec splits over."""
    out: set[str] = set()
    for entry in spec:
        out.update((entry,) if isinstance(entry, str) else entry or ())
    return out


def _sum_over(g: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`g` summed over `axes` (unchanged when there are none)."""
    return lax.psum(g, axes) if axes else g
