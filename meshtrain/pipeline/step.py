"""The train step's pipelined case: the mesh it pipelines over, and one microbatch's loss and
gradients through the pipeline in the shape the step accumulates."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
from flax import nnx
from jax.sharding import Mesh

from meshtrain import layout
from meshtrain.mesh import PIPE, mesh_sizes
from meshtrain.pipeline.config import PipelineConfig
from meshtrain.pipeline.run import LossFn, pipeline_loss_and_grads


def pipeline_mesh(pipeline: PipelineConfig | None, run_mesh=None) -> Mesh | None:
    """The mesh to pipeline over: the active layout's, when `pipeline` is set and pipe > 1.

    Without an active layout there is nothing to pipeline over: fine unless the run's own
    mesh has ``pipe > 1``.

    Args:
        pipeline: the run's pipeline settings, or None (no pipeline).
        run_mesh: the run's mesh, or its sizes (a mapping); None: not known.

    Returns:
        The active layout's mesh, or None where the step is not pipelined.

    Raises:
        ValueError: `run_mesh` has ``pipe > 1`` but no layout is active.
    """
    if pipeline is None:
        return None
    active = layout.active()
    if active is None:
        if run_mesh is None:
            return None
        sizes = run_mesh if isinstance(run_mesh, Mapping) else mesh_sizes(run_mesh)
        if sizes.get(PIPE, 1) == 1:
            return None
        raise ValueError(
            "pipeline=...: a pipelined step must be traced under "
            "meshtrain.layout.activation_rules(mesh, rules) (jit_train_step does this)"
        )
    return active.mesh if mesh_sizes(active.mesh)[PIPE] > 1 else None


def pipelined_grad_fn(
    graphdef: nnx.GraphDef,
    config: PipelineConfig,
    mesh: Mesh,
    loss_fn: LossFn,
    loss_scale: jax.Array | None = None,
) -> Callable:
    """One microbatch's loss and gradients through the pipeline, as the train step takes them.

    Args:
        graphdef: the model's graph.
        config: the pipeline settings.
        mesh: the mesh to pipeline over (`pipeline_mesh`).
        loss_fn: the loss, a mean over examples.
        loss_scale: float16's loss scale the backward starts from, or None.

    Returns:
        ``grad_fn(params, rest, mb, share=None) -> ((loss, (rest, metrics)), grads)``; with
        `share` (a packed microbatch's share of the batch's real tokens, times the number of
        microbatches) the loss, its gradients and ``task_loss`` come weighted by it.
    """

    def grad_fn(params, rest, mb, share=None):
        (loss, extra), grads = pipeline_loss_and_grads(
            graphdef,
            params,
            rest,
            mb,
            config=config,
            mesh=mesh,
            loss_fn=loss_fn,
            with_metrics=True,
            loss_scale=loss_scale,
        )
        if share is not None:
            loss, grads, extra = _weighted(share, loss, grads, extra)
        return (loss, (rest, extra)), grads

    return grad_fn


def _weighted(share: jax.Array, loss: jax.Array, grads, extra: dict):
    """`loss`, `grads` and the ``task_loss`` of `extra` times a packed microbatch's `share`."""
    loss, grads = loss * share, jax.tree.map(lambda g: g * share, grads)
    if "task_loss" in extra:
        extra = {**extra, "task_loss": extra["task_loss"] * share}
    return loss, grads, extra
