"""The pipelined loss and gradients of any model that offers `PipelineParts`.

The model's stacked blocks are cut into ``pipe × repeats`` contiguous chunks of layers; stage
s holds chunks s, s+p, s+2p, ... (just chunk s unless the schedule is circular). The
embedding and the head run outside the pipelined loop, partitioned by the compiler like the
rest of the model. The loop is manual over ``pipe`` and the replica axes
(`Rules.replica_axes`), each replica running its own rows of every microbatch. The executors
are in `meshtrain.pipeline.spmd`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

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
from meshtrain.mesh import PIPE, mesh_sizes
from meshtrain.models.base import PipelineParts, pipeline_parts
from meshtrain.pipeline import spmd
from meshtrain.pipeline.config import PipelineConfig
from meshtrain.pipeline.schedules import schedule_table

LossFn = Callable[[jax.Array, jax.Array], jax.Array]


def _circular_order(n_layers: int, p: int, v: int) -> jax.Array:
    """Layer order that gives stage s the chunks s, s+p, ... as one contiguous slice."""
    lc = n_layers // (p * v)
    order = [(r * p + s) * lc + j for s in range(p) for r in range(v) for j in range(lc)]
    return jnp.asarray(order, jnp.int32)


class _Cut:
    """A model in pieces: its parts, and its stacked blocks as chunks the stages run."""

    def __init__(self, graphdef: nnx.GraphDef, params: dict, rest: dict):
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
        self.key, self.run_blocks = parts.blocks, parts.run_blocks
        self.blocks_def = nnx.split(getattr(model, parts.blocks))[0]
        self.n_layers = jax.tree.leaves(params[parts.blocks])[0].shape[0]
        self.head_keys = tuple(k for k in parts.head_params if k in params)

    def parts(self, params: dict) -> PipelineParts:
        """The parts of the model over `params` (its blocks may be any chunk of the layers)."""
        return nnx.merge(self.graphdef, params, self.rest).pipeline_parts()

    def stage(self, chunk: dict, x: jax.Array) -> jax.Array:
        """Runs one chunk of stacked blocks."""
        return self.run_blocks(nnx.merge(self.blocks_def, chunk), x)


def _replicas(mesh: Mesh) -> tuple[str, ...]:
    """The replica axes of the active layout (none outside `activation_rules`)."""
    layout = active()
    outer = manual_axes()  # inside the replicas' own step: each replica runs alone
    axes = () if layout is None else layout.rules.replica_axes(mesh_sizes(mesh))
    return tuple(a for a in axes if a not in outer)


def _over_pipe(fn, mesh: Mesh, replicas: tuple[str, ...], in_specs, out_specs):
    """`fn` manual over ``pipe`` and `replicas`; the other axes stay with the compiler. Inside
    the replicas' own step (`meshtrain.replicas`, manual over pipe and them already) `fn`
    itself: its arguments are already the blocks the region would give it."""
    axes = {spmd.AXIS, *replicas}
    if axes <= manual_axes():
        return fn
    return manual_region(fn, mesh=mesh, axes=axes, in_specs=in_specs, out_specs=out_specs)


def pipeline_loss(
    graphdef: nnx.GraphDef,
    params: dict,
    rest: dict,
    batch: Mapping[str, jax.Array],
    *,
    config: PipelineConfig,
    mesh: Mesh,
    loss_fn: LossFn,
    poison: bool = False,
) -> jax.Array:
    """Mean loss of the model over `batch`, its blocks run by the gpipe / circular forward loop
    (1f1b evaluates with the gpipe loop). Differentiable with `jax.grad`.

    Call it inside `jax.jit` under `meshtrain.layout.activation_rules(mesh, rules)`.
    """
    p = mesh_sizes(mesh)[PIPE]
    m = config.num_microbatches(p)
    v = config.chunks_per_stage()
    cut = _Cut(graphdef, params, rest)
    parts = cut.parts(params)
    x_MbTD = split_microbatches(parts.embed(batch["inputs"]), m)
    blocks = params[cut.key]
    if v > 1:
        order = _circular_order(cut.n_layers, p, v)
        blocks = jax.tree.map(lambda w: jnp.take(w, order, axis=0), blocks)

    dtype = x_MbTD.dtype
    replicas = _replicas(mesh)
    rows = P(None, replicas or None)  # [M, b, ...]: each replica its rows of every microbatch

    def body(blocks, x_MbTD):
        chunks = jax.tree.map(lambda w: w.reshape(v, w.shape[0] // v, *w.shape[1:]), blocks)
        chunks = varying(chunks)  # their gradient is summed over replicas after the loop
        # Cast after marking it per-stage, so its gradient's sum over stages is in float32.
        x_MbTD = varying(x_MbTD).astype(dtype)
        return spmd.forward_loop(cut.stage, chunks, x_MbTD, stages=p, repeats=v, poison=poison)

    # The embedded batch crosses into the loop in float32: its gradient is summed over the
    # stages on the way out, and XLA's CPU backend aborts on a bfloat16 all-reduce there.
    run = _over_pipe(body, mesh, replicas, (P(spmd.AXIS), rows), rows)
    y_BTD = merge_microbatches(run(blocks, x_MbTD.astype(jnp.float32)))
    y_BTD = constrain(y_BTD, ("batch", "seq", "embed"))
    return loss_fn(parts.head(y_BTD), batch["targets"])


def pipeline_loss_and_grads(
    graphdef: nnx.GraphDef,
    params: dict,
    rest: dict,
    batch: Mapping[str, jax.Array],
    *,
    config: PipelineConfig,
    mesh: Mesh,
    loss_fn: LossFn,
    poison: bool = False,
) -> tuple[jax.Array, dict]:
    """Mean loss and its gradient with respect to `params`, pipelined by ``config.schedule``.

    gpipe and circular differentiate `pipeline_loss`; 1f1b runs its hand-scheduled backward.
    `loss_fn` must be a mean over examples (as cross-entropy is), so that the mean of the
    microbatch losses is the loss of the whole batch.

    Returns:
        ``(loss, grads)``, `grads` shaped like `params`.
    """
    kwargs = dict(config=config, mesh=mesh, loss_fn=loss_fn, poison=poison)
    if config.schedule != "1f1b":
        return jax.value_and_grad(lambda prm: pipeline_loss(graphdef, prm, rest, batch, **kwargs))(
            params
        )

    p = mesh_sizes(mesh)[PIPE]
    m = config.num_microbatches(p)
    table = schedule_table("1f1b", p, m)
    cut = _Cut(graphdef, params, rest)
    key = cut.key
    outer = {k: w for k, w in params.items() if k != key}

    def embed(outer):
        return cut.parts({**outer, key: params[key]}).embed(batch["inputs"])

    x_BTD, embed_vjp = jax.vjp(embed, outer)
    x_MbTD = split_microbatches(x_BTD, m)
    tgt_MbT = split_microbatches(batch["targets"], m)
    replicas = _replicas(mesh)
    n = math.prod(mesh_sizes(mesh)[a] for a in replicas)  # each replica's loss is 1/n of it
    rows = P(None, replicas or None)

    def body(chunk, outer, x_MbTD, tgt_MbT):
        def head_fn(h, y_bTD, tgt_bT):
            parts = cut.parts({**outer, **h, key: chunk})
            # Logits split over vocab inside the stage loop trip XLA's partitioner (a failed
            # check in spmd_partitioner_util on jax 0.12); keep them whole over tensor here.
            with override_activations(vocab=None):
                return loss_fn(parts.head(y_bTD), tgt_bT) / (m * n)

        h = {k: outer[k] for k in cut.head_keys}
        return spmd.one_f_one_b(
            cut.stage, head_fn, chunk, h, x_MbTD, tgt_MbT, table, replicas=replicas, poison=poison
        )

    specs_in = (P(spmd.AXIS), P(), rows, rows)
    run = _over_pipe(body, mesh, replicas, specs_in, (P(), P(spmd.AXIS), P(), rows))
    loss, g_blocks, g_head, g_x = run(params[key], outer, x_MbTD, tgt_MbT)
    (grads,) = embed_vjp(constrain(merge_microbatches(g_x), ("batch", "seq", "embed")))
    for k in cut.head_keys:
        grads[k] = jax.tree.map(jnp.add, grads[k], g_head[k])
    grads[key] = g_blocks
    return loss, grads
