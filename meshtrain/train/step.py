"""The pure train step ``(state, batch) -> (state, metrics)`` and its sharded, jitted form.

A `TrainState` is a plain pytree: the step count, the model's parameters as a nested dict
(float32 master weights), the optax state, and any other model variables. The NNX graph is
kept aside (`nnx.GraphDef`) and merged back inside the step, so the state can go straight to
`jax.jit` shardings, optax and orbax.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.mesh import mesh_sizes
from meshtrain.pipeline import PipelineConfig, pipeline_loss, pipeline_loss_and_grads
from meshtrain.sharding import (
    Rules,
    activation_rules,
    batch_spec,
    constrain,
    create_sharded_model,
    named,
    state_specs,
)

LossFn = Callable[[jax.Array, jax.Array], jax.Array]


class TrainState(NamedTuple):
    """Everything a step reads and writes."""

    step: jax.Array  # int32 []
    params: dict  # nnx.Param variables, nested dict of float32 arrays
    opt_state: Any  # optax state
    rest: dict  # other model variables (usually empty)


def cross_entropy(logits: jax.Array, targets: jax.Array, *, impl: str = "xla") -> jax.Array:
    """Mean softmax cross-entropy; logits [..., C] float, targets [...] int.

    ``impl`` other than ``"xla"`` runs `meshtrain.kernels.cross_entropy` (pallas / auto).
    """
    if impl != "xla":
        from meshtrain import kernels

        return kernels.cross_entropy_loss(logits, targets, impl=impl)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return losses.mean()


def state_layout(
    param_vars: nnx.State, rest_vars: nnx.State, tx, mesh: Mesh, rules: Rules
) -> tuple[dict, dict, Any, TrainState]:
    """Where each part of a train state lives on `mesh`.

    Returns:
        ``(params, rest, abstract_opt_state, shardings)``: the variables as pure dicts, the
        optimizer state's shapes, and a `TrainState` of `NamedSharding`s.
    """
    param_sh = named(state_specs(param_vars, rules.params, mesh, warn=False), mesh)
    rest_sh = named(state_specs(rest_vars, rules.params, mesh, warn=False), mesh)
    opt_param_specs = state_specs(param_vars, rules.optimizer_table, mesh, warn=False)
    params, rest = nnx.to_pure_dict(param_vars), nnx.to_pure_dict(rest_vars)
    abstract_opt = jax.eval_shape(tx.init, params)
    opt_specs = optax.tree_map_params(
        tx,
        lambda _, spec: spec,
        abstract_opt,
        opt_param_specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
    replicated = NamedSharding(mesh, P())
    shardings = TrainState(replicated, param_sh, named(opt_specs, mesh), rest_sh)
    return params, rest, abstract_opt, shardings


def init_train_state(
    ctor: Callable[[], nnx.Module], tx: optax.GradientTransformation, mesh: Mesh, rules: Rules
) -> tuple[nnx.GraphDef, TrainState, TrainState]:
    """Creates the model and optimizer state directly sharded on `mesh`.

    Args:
        ctor: zero-argument model constructor.
        tx: the optax transformation.
        mesh: the device mesh.
        rules: logical-axis rules; ``rules.optimizer_table`` lays out the optimizer state.

    Returns:
        ``(graphdef, state, shardings)``, where `shardings` is a `TrainState` of `NamedSharding`s.
    """
    model = create_sharded_model(ctor, mesh, rules)
    graphdef, param_vars, rest_vars = nnx.split(model, nnx.Param, ...)
    params, rest, _, shardings = state_layout(param_vars, rest_vars, tx, mesh, rules)
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return graphdef, TrainState(step, params, opt_state, rest), shardings


def _split_microbatches(batch: Mapping[str, jax.Array], k: int) -> dict[str, jax.Array]:
    """[B, ...] → [k, B/k, ...]; microbatch i takes rows i, i+k, ... so every device keeps
    its share of each microbatch (no resharding)."""
    out = {}
    for key, x in batch.items():
        if x.shape[0] % k:
            raise ValueError(
                f"batch[{key!r}] has {x.shape[0]} rows, not divisible by accum_steps={k}; "
                "make the batch size a multiple of accum_steps"
            )
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
        out[key] = constrain(x, (None, "batch", *([None] * (x.ndim - 2))))
    return out


def train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    state: TrainState,
    batch: Mapping[str, jax.Array],
    *,
    accum_steps: int = 1,
    loss_fn: LossFn = cross_entropy,
    schedule: optax.Schedule | None = None,
    pipeline: tuple[PipelineConfig, Mesh] | None = None,
    skip_nonfinite: bool = True,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step; a pure function of its inputs.

    With ``accum_steps = k`` the batch is cut into k microbatches whose gradients are averaged
    (in float32) before the single update: the same update as the whole batch at once.
    With `pipeline` = ``(config, mesh)`` the loss and gradients come from the pipelined GPT
    (`meshtrain.pipeline`) instead of a plain `jax.value_and_grad`.

    With `skip_nonfinite`, a step whose loss or gradient norm is NaN or infinite skips its
    batch: the parameters, the optimizer's moments and the other variables stay exactly as they
    were, while the step count and the optimizer's own step counters advance. The schedule is a
    function of batches consumed, so the update after a skip runs at the learning rate of its
    own step, and the optimizer's counters always equal ``state.step``.

    Returns:
        The new state and metrics: ``loss``, ``grad_norm``, ``skipped`` (1 when the update was
        skipped, else 0) and (with `schedule`) ``lr``, the rate of this step (``schedule`` at
        the old ``state.step``), which is the one the update used.
    """

    def loss_of(params, rest, mb):
        model = nnx.merge(graphdef, params, rest)
        loss = loss_fn(model(mb["inputs"]), mb["targets"])
        return loss, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))

    if not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps!r}: must be a positive integer")
    if pipeline is None:
        grad_fn = jax.value_and_grad(loss_of, has_aux=True)
    else:
        config, mesh = pipeline

        def grad_fn(params, rest, mb):
            loss, grads = pipeline_loss_and_grads(
                graphdef, params, rest, mb, config=config, mesh=mesh, loss_fn=loss_fn
            )
            return (loss, rest), grads

    if accum_steps == 1:
        (loss, rest), grads = grad_fn(state.params, state.rest, batch)
    else:

        def accumulate(carry, mb):
            loss_sum, grad_sum, rest = carry
            (loss, rest), grads = grad_fn(state.params, rest, mb)
            grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
            return (loss_sum + loss, grad_sum, rest), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        carry = (jnp.zeros((), jnp.float32), zeros, state.rest)
        microbatches = _split_microbatches(batch, accum_steps)
        (loss, grads, rest), _ = jax.lax.scan(accumulate, carry, microbatches)
        loss = loss / accum_steps
        grads = jax.tree.map(lambda g, p: (g / accum_steps).astype(p.dtype), grads, state.params)

    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if skip_nonfinite:
        params, opt_state, rest = _keep_if_not(finite, (params, opt_state, rest), state)
    metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": (~finite).astype(jnp.int32)}
    if schedule is not None:
        metrics["lr"] = schedule(state.step)
    return TrainState(state.step + 1, params, opt_state, rest), metrics


def _keep_if_not(ok: jax.Array, new: tuple, state: TrainState) -> tuple:
    """`new` (params, opt_state, rest) where `ok`; else the old values, but the new counters."""
    params, opt_state, rest = new

    def keep(n, o):
        return jnp.where(ok, n, o)

    # A skipped batch is still consumed. optax keeps its step counters (the `count` of
    # scale_by_schedule, scale_by_adam, ...) as the integer leaves of its state and its moments
    # and traces as float leaves, so counters take the new value either way: they stay equal
    # to `TrainState.step` and the schedule runs on batches consumed. (Adam's bias correction
    # then also counts the skipped step: a slightly smaller update just after an early skip.)
    def keep_moments(n, o):
        return n if jnp.issubdtype(n.dtype, jnp.integer) else keep(n, o)

    return (
        jax.tree.map(keep, params, state.params),
        jax.tree.map(keep_moments, opt_state, state.opt_state),
        jax.tree.map(keep, rest, state.rest),
    )


def eval_loss(
    graphdef: nnx.GraphDef,
    state: TrainState,
    batch: Mapping[str, jax.Array],
    loss_fn: LossFn = cross_entropy,
    pipeline: tuple[PipelineConfig, Mesh] | None = None,
) -> jax.Array:
    """Mean loss of the model in `state` on `batch` (no update)."""
    if pipeline is not None:
        config, mesh = pipeline
        return pipeline_loss(
            graphdef, state.params, state.rest, batch, config=config, mesh=mesh, loss_fn=loss_fn
        )
    model = nnx.merge(graphdef, state.params, state.rest)
    return loss_fn(model(batch["inputs"]), batch["targets"])


def _pipelined(config: PipelineConfig | None, mesh: Mesh):
    """``(config, mesh)`` when the mesh has pipeline stages to run, else None."""
    if mesh_sizes(mesh)["pipe"] == 1:
        return None
    return (config or PipelineConfig(), mesh)


def batch_shardings(batch_shapes: Mapping[str, Any], mesh: Mesh, rules: Rules) -> dict:
    """`NamedSharding` per batch entry (dimension 0 split over the batch axes)."""
    return {
        key: NamedSharding(mesh, batch_spec(len(x.shape), rules, mesh, shape=tuple(x.shape)))
        for key, x in batch_shapes.items()
    }


def jit_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules: Rules,
    state_shardings: TrainState,
    batch_sharding: Mapping[str, NamedSharding],
    *,
    accum_steps: int = 1,
    loss_fn: LossFn = cross_entropy,
    schedule: optax.Schedule | None = None,
    pipeline: PipelineConfig | None = None,
    skip_nonfinite: bool = True,
):
    """`train_step` jitted with explicit in/out shardings; the input state is donated.

    `pipeline` takes effect on meshes with ``pipe > 1``.

    Returns:
        ``step(state, batch) -> (state, metrics)``; metrics are replicated scalars.
    """

    def step(state, batch):
        with activation_rules(mesh, rules):
            return train_step(
                graphdef,
                tx,
                state,
                batch,
                accum_steps=accum_steps,
                loss_fn=loss_fn,
                schedule=schedule,
                pipeline=_pipelined(pipeline, mesh),
                skip_nonfinite=skip_nonfinite,
            )

    replicated = NamedSharding(mesh, P())
    return jax.jit(
        step,
        in_shardings=(state_shardings, dict(batch_sharding)),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )


def jit_eval_step(
    graphdef: nnx.GraphDef,
    mesh: Mesh,
    rules: Rules,
    state_shardings: TrainState,
    batch_sharding: Mapping[str, NamedSharding],
    loss_fn: LossFn = cross_entropy,
    pipeline: PipelineConfig | None = None,
):
    """`eval_loss` jitted with the same layout as the train step."""

    def step(state, batch):
        with activation_rules(mesh, rules):
            return eval_loss(graphdef, state, batch, loss_fn, _pipelined(pipeline, mesh))

    return jax.jit(
        step,
        in_shardings=(state_shardings, dict(batch_sharding)),
        out_shardings=NamedSharding(mesh, P()),
    )
