"""The pure train step ``(state, batch) -> (state, metrics)`` and its sharded, jitted form."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain import layout, offload
from meshtrain.data.shares import token_shares
from meshtrain.layout import Rules, activation_rules, split_microbatches, varying
from meshtrain.loss import LossFn, cross_entropy, loss_and_metrics, loss_mask
from meshtrain.models.base import after_step, call_model
from meshtrain.pipeline import PipelineConfig, pipeline_loss
from meshtrain.pipeline.step import pipeline_mesh, pipelined_grad_fn
from meshtrain.precision import loss_scale, matmul_precision
from meshtrain.replicas.step import local_train_step, synced_grads
from meshtrain.run import RunSpec
from meshtrain.state import TrainState


def train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    state: TrainState,
    batch: Mapping[str, jax.Array],
    *,
    run: RunSpec | None = None,
    schedule: optax.Schedule | None = None,
    skip_nonfinite: bool = True,
    param_specs: dict | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step; a pure function of its inputs.

    The step reads four settings of `run`: ``train.accum_steps``, the loss (``loss_fn``, or
    ``train.loss`` with ``train.loss_impl``), ``pipeline`` and ``sync``.

    With ``accum_steps = k`` the batch is cut into k microbatches whose gradients are averaged (in
    float32) before the single update: the same update as the whole batch at once. Traced under a
    layout whose mesh has ``pipe > 1`` (as `jit_train_step` does), the loss and gradients come from
    the pipelined model (`meshtrain.pipeline`) instead of a plain `jax.value_and_grad`.

    With `skip_nonfinite`, a step whose loss or gradient norm is NaN or infinite skips its
    batch: the parameters, the optimizer's moments and the other variables stay exactly as they
    were, while the step count and the optimizer's own step counters advance. The schedule is a
    function of batches consumed, so the update after a skip runs at the learning rate of its
    own step, and the optimizer's counters always equal ``state.step``.

    With float16's dynamic loss scaling (``run.precision``; the scale in ``state.opt_state``,
    see `meshtrain.precision.loss_scale`), the backward starts from the scale and the gradients
    are unscaled in float32 before anything reads them. A step whose gradients overflow while
    its loss is finite skips its batch as above (error-feedback residuals included), halves the
    scale and reports ``overflow``; it is not ``skipped``, which counts bad steps only.

    With ``run.sync``, the replicas synchronise as `meshtrain.replicas` describes: local SGD /
    DiLoCo (the whole step is `meshtrain.replicas.local_step`); a compressed gradient exchange in a
    region manual over the replica axes (error-feedback residuals in ``state.comm``); or bounded
    staleness s, where the update applies the gradient computed s steps before (``grad_norm`` and
    the non-finite check are that gradient's) and the first s steps update nothing.

    After the update, a model with an ``after_step()`` method updates its other variables from
    what the step's forwards left in them (`meshtrain.models.base.after_step`: an MoE's
    balancing bias from the load of the whole batch, every microbatch counted); its metrics
    join the step's.

    Args:
        graphdef: the model's graph (from `init_train_state`).
        tx: the optax transformation.
        state: the current state.
        batch: ``inputs`` and ``targets``, global arrays; a packed batch also has ``segment_ids``
            and ``positions`` (passed to the model as keywords; the loss then counts only
            tokens with ``segment_ids > 0``).
        run: the run (`meshtrain.run.RunSpec`); None: ``RunSpec()``. Its ``sync`` state is
            ``state.comm`` (`meshtrain.replicas.with_sync` builds it); its ``pipeline`` takes
            effect only where the active layout's mesh has ``pipe > 1``.
        schedule: the learning-rate schedule, to report ``lr``.
        skip_nonfinite: skip updates whose loss or gradient is not finite.
        param_specs: the parameters' `PartitionSpec`s (`jit_train_step` passes them): with
            gradient compression, a gradient split over model axes is encoded shard by shard.

    Returns:
        The new state and metrics: ``loss`` (with any auxiliary terms the model returns, see
        `meshtrain.loss.loss_and_metrics`, whose metrics are included), ``grad_norm``,
        ``skipped`` (1 when a non-finite loss or gradient skipped the update, else 0; 0 for a
        loss-scale overflow), under loss scaling ``loss_scale`` (after the step) and
        ``overflow``, and (with `schedule`) ``lr``, the rate of this step (``schedule`` at the
        old ``state.step``), which is the one the update used.
    """
    run = RunSpec() if run is None else run
    loss_fn = run.step_loss
    state = offload.to_device(state)  # a state kept in host memory (`Offload`) comes in first
    scale = loss_scale.step_scale(state.opt_state, run.loss_scaling)
    compute = _compute_fn(_grad_fn(graphdef, run, loss_fn, scale), run.train.accum_steps, scale)
    options: dict[str, Any] = {"skip_nonfinite": skip_nonfinite, "param_specs": param_specs}
    if run.sync.local:  # local SGD: the replicas' own step is the whole step
        new_state, metrics = local_train_step(compute, tx, state, batch, sync=run.sync, **options)
    else:
        new_state, metrics = _synchronous_step(compute, tx, state, batch, run, scale, **options)
    rest, settled = after_step(graphdef, new_state.params, new_state.rest)
    new_state, metrics = new_state._replace(rest=rest), {**metrics, **settled}
    if schedule is not None:
        metrics["lr"] = schedule(state.step)
    return new_state, metrics


def _grad_fn(graphdef: nnx.GraphDef, run: RunSpec, loss_fn: LossFn, scale: jax.Array | None):
    """``(params, rest, mb, share=None) -> ((loss, (rest, extra)), grads)`` of one microbatch:
    through the pipeline where the run pipelines, else `jax.value_and_grad` of the model."""
    mesh = pipeline_mesh(run.pipeline, run.mesh)
    if mesh is not None:
        return pipelined_grad_fn(graphdef, run.pipeline, mesh, loss_fn, scale)

    def loss_of(params, rest, mb, share=None):
        model = nnx.merge(graphdef, params, rest)
        output = call_model(model, mb)
        loss, extra = loss_and_metrics(loss_fn, output, mb["targets"], loss_mask(mb), share)
        if scale is not None:  # the backward starts from the scale; the value stays
            loss = loss_scale.scale_backward(loss, scale)
        return loss, (nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))), extra)

    return jax.value_and_grad(loss_of, has_aux=True)


def _compute_fn(grad_fn, accum_steps: int, scale: jax.Array | None):
    """``(params, rest, batch) -> ((loss, (rest, extra)), grads)``: `grad_fn` accumulated over
    the batch's microbatches, its gradient unscaled."""

    def compute(params, rest, batch):
        out, grads = _accumulated(grad_fn, params, rest, batch, accum_steps)
        return out, grads if scale is None else loss_scale.unscale(grads, scale)

    return compute


def _synchronous_step(compute, tx, state, batch, run, scale, *, skip_nonfinite, param_specs):
    """The step of replicas that apply one gradient together: gradient, update, guard,
    loss-scale bookkeeping and metrics."""
    scaled = scale is not None
    sync = run.sync
    (loss, (rest, extra)), grads, comm, ready = synced_grads(
        compute, state, batch, sync=sync, param_specs=param_specs
    )
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if skip_nonfinite or sync.staleness or scaled:
        apply = (finite if skip_nonfinite or scaled else True) & ready
        params, opt_state, rest = _keep_if_not(apply, (params, opt_state, rest), state)
    overflow = jnp.bool_(False)
    if scaled:  # an overflow is skipped, error-feedback residuals included
        opt_state, overflow = loss_scale.settle(
            opt_state, loss, grad_norm, run.precision.loss_scale_period
        )
        comm = jax.tree.map(lambda n, o: jnp.where(overflow, o, n), comm, dict(state.comm))
    metrics = _step_metrics(extra, loss, grad_norm, finite, overflow, opt_state, scaled)
    return TrainState(state.step + 1, params, opt_state, rest, comm), metrics


def _step_metrics(extra, loss, grad_norm, finite, overflow, opt_state, scaled: bool) -> dict:
    """The synchronous step's metrics (``lr`` aside): the loss's, ``grad_norm``, ``skipped``,
    and under loss scaling ``loss_scale`` and ``overflow``."""
    metrics = {**extra, "loss": loss, "grad_norm": grad_norm}
    metrics["skipped"] = (~finite & ~overflow).astype(jnp.int32)
    if scaled:
        metrics["loss_scale"] = opt_state.scale
        metrics["overflow"] = overflow.astype(jnp.int32)
    return metrics


def _accumulated(grad_fn, params, rest, batch, accum_steps: int):
    """`grad_fn` on `batch`, or the mean over its `accum_steps` microbatches (in float32).

    A packed batch's microbatches hold different numbers of real tokens, and its loss is the
    mean over the real tokens of the whole batch: each microbatch's task loss is weighted by
    ``accum_steps × its real tokens / the batch's``, so the mean of the microbatches is that
    of the whole batch (auxiliary terms, an MoE's router losses, keep weight 1/accum_steps).
    Inside the replicas' own step each device sees its rows only, and its share is taken of
    the real tokens of every device's rows, so the replicas' mean is the whole batch's too.
    """
    if accum_steps == 1:
        shares = token_shares(loss_mask({k: x[None] for k, x in batch.items()}), 1)
        return grad_fn(params, rest, batch, None if shares is None else shares[0])

    def accumulate(carry, mb_share):
        loss_sum, grad_sum, rest, extra_sum = carry
        mb, share = mb_share
        (loss, (rest, extra)), grads = grad_fn(params, rest, mb, share)
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
        extra_sum = jax.tree.map(lambda a, m: a + m, extra_sum, extra)
        return (loss_sum + loss, grad_sum, rest, extra_sum), None

    for key, x in batch.items():
        if x.shape[0] % accum_steps:
            raise ValueError(
                f"batch[{key!r}] has {x.shape[0]} rows, not divisible by accum_steps="
                f"{accum_steps}; make the batch size a multiple of accum_steps"
            )
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    first = {k: x[: x.shape[0] // accum_steps] for k, x in batch.items()}
    extra_shape = jax.eval_shape(grad_fn, params, rest, first)[0][1][1]
    extra0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), extra_shape)
    # Inside a region manual over the replica axes the carry must start per replica.
    carry = varying((jnp.zeros((), jnp.float32), zeros, rest, extra0))
    microbatches = {k: split_microbatches(x, accum_steps) for k, x in batch.items()}
    (loss, grads, rest, extra), _ = jax.lax.scan(
        accumulate, carry, (microbatches, token_shares(loss_mask(microbatches), accum_steps))
    )
    extra = jax.tree.map(lambda m: m / accum_steps, extra)
    grads = jax.tree.map(lambda g, p: (g / accum_steps).astype(p.dtype), grads, params)
    return (loss / accum_steps, (rest, extra)), grads


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
    *,
    loss_fn: LossFn = cross_entropy,
    pipeline: PipelineConfig | None = None,
) -> jax.Array:
    """Mean loss of the model in `state` on `batch` (no update); `pipeline` as in `train_step`."""
    mesh = pipeline_mesh(pipeline)
    if mesh is not None:
        loss, metrics = pipeline_loss(
            graphdef,
            state.params,
            state.rest,
            batch,
            config=pipeline,
            mesh=mesh,
            loss_fn=loss_fn,
            with_metrics=True,
        )
        return metrics.get("task_loss", loss)
    model = nnx.merge(graphdef, state.params, state.rest)
    output = call_model(model, batch)
    loss, metrics = loss_and_metrics(loss_fn, output, batch["targets"], loss_mask(batch))
    return metrics.get("task_loss", loss)


def _check_batch(batch: Mapping, batch_sharding: Mapping[str, NamedSharding]) -> None:
    """Clear errors for a batch whose keys or rows do not fit the step's batch shardings."""
    if set(batch) != set(batch_sharding):
        raise ValueError(
            f"batch has entries {sorted(batch)} but the step was built for "
            f"{sorted(batch_sharding)}; build batch_sharding from a batch of the same shape"
        )
    for key, x in batch.items():
        sharding = batch_sharding[key]
        axes = layout.axes_of(sharding.spec[0]) if len(sharding.spec) else ()
        n = math.prod(sharding.mesh.shape[a] for a in axes)
        if len(x.shape) and x.shape[0] % n:
            raise ValueError(
                f"batch[{key!r}] has {x.shape[0]} rows, not divisible by the {n} devices its "
                f"sharding splits the batch over; use a batch size that is a multiple of {n}"
            )


class _Jitted:
    """A jitted step that checks its batch first, with the jitted function's ``lower``."""

    def __init__(self, fn, batch_sharding):
        self.fn, self.batch_sharding = fn, dict(batch_sharding)

    def __call__(self, state, batch):
        _check_batch(batch, self.batch_sharding)
        return self.fn(state, batch)

    def lower(self, state, batch):
        """`jax.jit(...).lower` of the step (for compiled-memory and HLO inspection)."""
        _check_batch(batch, self.batch_sharding)
        return self.fn.lower(state, batch)

    def trace(self, state, batch):
        """`jax.jit(...).trace` of the step."""
        _check_batch(batch, self.batch_sharding)
        return self.fn.trace(state, batch)


def jit_train_step(
    run: RunSpec,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    state_shardings: TrainState,
    batch_sharding: Mapping[str, NamedSharding],
    *,
    schedule: optax.Schedule | None = None,
    skip_nonfinite: bool = True,
):
    """`train_step` jitted with explicit in/out shardings; the input state is donated.

    Args:
        run: the run (`meshtrain.run.RunSpec`): its mesh and rules lay the step out
            (activations follow ``rules.activations`` while it traces); the rest as for
            `train_step`.
        graphdef, tx: as for `train_step`.
        state_shardings: a `TrainState` of `NamedSharding`s (from `init_train_state`; with
            ``run.sync`` it includes ``comm``'s, from `meshtrain.replicas.with_sync`).
        batch_sharding: one `NamedSharding` per batch entry (`batch_shardings`).
        schedule, skip_nonfinite: as for `train_step`.

    Returns:
        ``step(state, batch) -> (state, metrics)``; metrics are replicated scalars. A batch
        whose rows do not divide over its sharding is refused with a clear error before the
        call; ``step.lower(state, batch)`` gives jax's lowered program.
    """
    run = run.resolved()
    mesh, rules = run.mesh, run.rules

    def step(state, batch):
        with activation_rules(mesh, rules), matmul_precision(run.precision.matmul_precision):
            return train_step(
                graphdef,
                tx,
                state,
                batch,
                run=run,
                schedule=schedule,
                skip_nonfinite=skip_nonfinite,
                param_specs=param_specs,
            )

    param_specs = jax.tree.map(lambda s: s.spec, state_shardings.params)
    replicated = NamedSharding(mesh, P())
    jitted = jax.jit(
        step,
        in_shardings=(state_shardings, dict(batch_sharding)),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    return _Jitted(jitted, batch_sharding)


def jit_eval_step(
    graphdef: nnx.GraphDef,
    mesh: Mesh,
    rules: Rules,
    state_shardings: TrainState,
    batch_sharding: Mapping[str, NamedSharding],
    *,
    loss_fn: LossFn = cross_entropy,
    pipeline: PipelineConfig | None = None,
    precision: str = "default",
):
    """`eval_loss` jitted with the same layout as the train step (and its `precision` of
    float32 matmuls, `matmul_precision`)."""

    def step(state, batch):
        with activation_rules(mesh, rules), matmul_precision(precision):
            return eval_loss(
                graphdef, state, batch, loss_fn=loss_fn, pipeline=pipeline or PipelineConfig()
            )

    jitted = jax.jit(
        step,
        in_shardings=(state_shardings, dict(batch_sharding)),
        out_shardings=NamedSharding(mesh, P()),
    )
    return _Jitted(jitted, batch_sharding)
