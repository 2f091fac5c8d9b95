"""Pipeline parallelism over the ``pipe`` mesh axis: gpipe, circular and 1F1B, in pure SPMD.

The GPT's stacked blocks are cut into ``pipe × repeats`` contiguous chunks of layers; stage s
holds chunks s, s+p, s+2p, ... (just chunk s unless the schedule is circular). The
embedding and the head run outside the pipelined loop, partitioned by the compiler like the
rest of the model. The train state is the same pytree as without a pipeline: the rules put
the ``layers`` dimension on ``pipe``, so each stage already holds its own layers.

    from meshtrain.pipeline import PipelineConfig, schedule_table
    schedule_table("1f1b", p=4, m=8).plot()
    Trainer(..., mesh=make_mesh("pipe=2,data=2,tensor=2"),
            pipeline=PipelineConfig(schedule="1f1b", microbatches=8))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshtrain.mesh import mesh_sizes
from meshtrain.pipeline import spmd
from meshtrain.pipeline.schedules import (
    BWD,
    FWD,
    IDLE,
    SCHEDULES,
    ScheduleTable,
    check_schedule,
    schedule_table,
)
from meshtrain.sharding import constrain, override_activations

__all__ = [
    "BWD",
    "FWD",
    "IDLE",
    "SCHEDULES",
    "PipelineConfig",
    "ScheduleTable",
    "check_pipeline",
    "pipeline_loss",
    "pipeline_loss_and_grads",
    "schedule_table",
]

LossFn = Callable[[jax.Array, jax.Array], jax.Array]
_HEAD_KEYS = ("norm", "head")  # GPT parameters the loss head reads (plus a tied embedding)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How to pipeline over the mesh's ``pipe`` axis (ignored while pipe = 1).

    Args:
        schedule: ``gpipe``, ``circular`` (interleaved) or ``1f1b``.
        microbatches: microbatches per step; 0 means 2 × pipe.
        repeats: chunks of layers per stage, v (circular only).
    """

    schedule: str = "gpipe"
    microbatches: int = 0
    repeats: int = 1

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule={self.schedule!r}: unknown pipeline schedule; choose from "
                f"{', '.join(SCHEDULES)}"
            )
        if not isinstance(self.microbatches, int) or self.microbatches < 0:
            raise ValueError(f"microbatches={self.microbatches!r}: must be ≥ 1 (or 0 for 2 × pipe)")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats={self.repeats!r}: must be ≥ 1")

    def num_microbatches(self, pipe: int) -> int:
        """Microbatches per step on a mesh with `pipe` stages."""
        return self.microbatches or 2 * pipe


def check_pipeline(
    config: PipelineConfig, *, n_layers: int, pipe: int, batch_size: int, batch_ways: int
) -> None:
    """Validates a pipeline against the model, mesh and batch before anything compiles.

    Args:
        config: the pipeline settings.
        n_layers: the model's stacked layers.
        pipe: stages (the mesh's pipe size).
        batch_size: the global batch.
        batch_ways: devices the batch is split over (data × fsdp).

    Raises:
        ValueError: naming the field, the value and the fix.
    """
    m, v = config.num_microbatches(pipe), config.repeats
    check_schedule(config.schedule, pipe, m, v)
    if n_layers % (pipe * v):
        raise ValueError(
            f"gpt n_layers={n_layers} is not divisible by pipe × repeats = {pipe} × {v} = "
            f"{pipe * v}: each stage needs whole layers; use a multiple of {pipe * v} layers"
        )
    if batch_size % m:
        raise ValueError(
            f"batch_size={batch_size} is not divisible by microbatches={m}; "
            f"use a batch that is a multiple of {m}"
        )
    if (batch_size // m) % batch_ways:
        raise ValueError(
            f"batch_size={batch_size} / microbatches={m} = {batch_size // m} rows per "
            f"microbatch, not divisible by data × fsdp = {batch_ways} devices; use a batch "
            f"that is a multiple of {m * batch_ways}"
        )


def split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] → [M, B/M, ...]; microbatch i takes rows i, i+M, ... so no row changes device."""
    x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
    return constrain(x, (None, "batch", *([None] * (x.ndim - 2))))


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`."""
    x = x.swapaxes(0, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _circular_order(n_layers: int, p: int, v: int) -> jax.Array:
    """Layer order that gives stage s the chunks s, s+p, ... as one contiguous slice."""
    lc = n_layers // (p * v)
    order = [(r * p + s) * lc + j for s in range(p) for r in range(v) for j in range(lc)]
    return jnp.asarray(order, jnp.int32)


class _Parts:
    """The GPT in pieces: embedding, one chunk of blocks, and the loss head."""

    def __init__(self, graphdef: nnx.GraphDef, params: dict, rest: dict, loss_fn: LossFn):
        if "blocks" not in params:
            raise ValueError(
                "pipelining needs a model with stacked 'blocks' and embed_tokens / run_blocks / "
                "head_logits methods (meshtrain's GPT)"
            )
        if jax.tree.leaves(rest):
            raise ValueError(
                "pipelining supports models whose only variables are parameters; this model "
                f"also has {', '.join(rest)}"
            )
        self.graphdef, self.rest, self.loss_fn = graphdef, rest, loss_fn
        model = nnx.merge(graphdef, params, rest)
        self.remat = model.cfg.remat
        self.blocks_def = nnx.split(model.blocks)[0]
        self.n_layers = model.cfg.n_layers
        keys = _HEAD_KEYS + (("embed",) if model.head is None else ())
        self.head_keys = tuple(k for k in keys if k in params)

    def model(self, params: dict):
        """The GPT over `params` (its 'blocks' may be any chunk of the layers)."""
        return nnx.merge(self.graphdef, params, self.rest)

    def stage(self, chunk: dict, x_bTD: jax.Array) -> jax.Array:
        """Runs one chunk of stacked blocks."""
        from meshtrain.models.gpt import scan_blocks

        return scan_blocks(nnx.merge(self.blocks_def, chunk), x_bTD, self.remat)


def _shard_map(fn, mesh: Mesh, in_specs, out_specs):
    """A shard_map that is manual over ``pipe`` only."""
    return jax.shard_map(
        fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={spmd.AXIS}
    )


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
    """Mean loss of the GPT over `batch`, its blocks run by the gpipe / circular forward loop
    (1f1b evaluates with the gpipe loop). Differentiable with `jax.grad`.

    Call it inside `jax.jit` under `meshtrain.sharding.activation_rules(mesh, rules)`.
    """
    p = mesh_sizes(mesh)["pipe"]
    m = config.num_microbatches(p)
    v = config.repeats if config.schedule == "circular" else 1
    parts = _Parts(graphdef, params, rest, loss_fn)
    model = parts.model(params)
    x_MbTD = split_microbatches(model.embed_tokens(batch["inputs"]), m)
    blocks = params["blocks"]
    if v > 1:
        order = _circular_order(parts.n_layers, p, v)
        blocks = jax.tree.map(lambda w: jnp.take(w, order, axis=0), blocks)

    dtype = x_MbTD.dtype

    def body(blocks, x_MbTD):
        chunks = jax.tree.map(lambda w: w.reshape(v, w.shape[0] // v, *w.shape[1:]), blocks)
        # Cast after marking it per-stage, so its gradient's sum over stages is in float32.
        x_MbTD = spmd.varying(x_MbTD).astype(dtype)
        return spmd.forward_loop(parts.stage, chunks, x_MbTD, stages=p, repeats=v, poison=poison)

    # The embedded batch crosses into the loop in float32: its gradient is summed over the
    # stages on the way out, and XLA's CPU backend aborts on a bfloat16 all-reduce there.
    run = _shard_map(body, mesh, (P(spmd.AXIS), P()), P())
    y_BTD = merge_microbatches(run(blocks, x_MbTD.astype(jnp.float32)))
    y_BTD = constrain(y_BTD, ("batch", "seq", "embed"))
    return loss_fn(model.head_logits(y_BTD), batch["targets"])


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

    p = mesh_sizes(mesh)["pipe"]
    m = config.num_microbatches(p)
    table = schedule_table("1f1b", p, m)
    parts = _Parts(graphdef, params, rest, loss_fn)
    outer = {k: w for k, w in params.items() if k != "blocks"}

    def embed(outer):
        return parts.model({**outer, "blocks": params["blocks"]}).embed_tokens(batch["inputs"])

    x_BTD, embed_vjp = jax.vjp(embed, outer)
    x_MbTD = split_microbatches(x_BTD, m)
    tgt_MbT = split_microbatches(batch["targets"], m)

    def body(chunk, outer, x_MbTD, tgt_MbT):
        def head_fn(h, y_bTD, tgt_bT):
            model = parts.model({**outer, **h, "blocks": chunk})
            # Logits split over vocab inside the stage loop trip XLA's partitioner (a failed
            # check in spmd_partitioner_util on jax 0.12); keep them whole over tensor here.
            with override_activations(vocab=None):
                return loss_fn(model.head_logits(y_bTD), tgt_bT) / m

        h = {k: outer[k] for k in parts.head_keys}
        return spmd.one_f_one_b(
            parts.stage, head_fn, chunk, h, x_MbTD, tgt_MbT, table, poison=poison
        )

    run = _shard_map(body, mesh, (P(spmd.AXIS), P(), P(), P()), (P(), P(spmd.AXIS), P(), P()))
    loss, g_blocks, g_head, g_x = run(params["blocks"], outer, x_MbTD, tgt_MbT)
    (grads,) = embed_vjp(constrain(merge_microbatches(g_x), ("batch", "seq", "embed")))
    for k in parts.head_keys:
        grads[k] = jax.tree.map(jnp.add, grads[k], g_head[k])
    grads["blocks"] = g_blocks
    return loss, grads
