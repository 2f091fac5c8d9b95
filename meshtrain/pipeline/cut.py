"""A model in pieces for the pipeline: its embedding, its stacked blocks as the chunks the
stages run, its head, and the loss terms of the blocks' statistics (`PipelineParts`)."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshtrain.layout import active, manual_axes, split_microbatches, state_specs
from meshtrain.mesh import PIPE
from meshtrain.models.base import PACKED_KEYS, PipelineParts, pipeline_parts
from meshtrain.pipeline.specs import only


class Cut:
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

        specs = state_specs(self.blocks_state, layout.rules.params, mesh, warn=False)
        return only(specs, manual)
