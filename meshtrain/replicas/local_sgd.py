"""Local SGD and DiLoCo: replicas that step on their own data and synchronise every H steps.

Under local SGD the train state holds:

- ``state.params``: θ̄, the parameters at the last synchronisation (what evaluation, export,
  sampling and checkpoints-as-models see);
- ``state.opt_state``: the outer optimizer's state (`outer_optimizer`);
- ``state.comm["local"]``: ``{"params", "opt_state"}``, each replica's own parameters θ_r and
  inner optimizer state, every leaf ``[R, ...]`` with the replica axes on dim 0 (`local_init`,
  laid out by `local_shardings`).

One `local_step` is one inner step on every replica: in a region manual over the replica axes,
replica r takes the gradient of its own rows and updates θ_r with the inner optimizer. Between
synchronisations the replicas exchange only scalar metrics. Every H-th step (``(step + 1) % H
== 0``) the outer step follows: the outer gradient Δ = θ̄ − mean_r θ_r (one all-reduce of the
parameters), θ̄ ← the outer optimizer's update of θ̄ by Δ, and every replica restarts from the
new θ̄. Inner optimizer states stay per replica; they are never averaged.

``average`` is plain periodic model averaging (θ̄ ← mean_r θ_r: SGD with rate 1 on Δ);
``nesterov`` is DiLoCo (Douillard et al., 2023): SGD with Nesterov momentum on Δ. With H = 1,
``average`` and an inner optimizer linear in the gradient (SGD, momentum), the run is the
synchronous data-parallel one: the replicas' momenta differ, but their mean is the synchronous
momentum, and only the mean reaches θ̄.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshtrain.layout import manual_region
from meshtrain.replicas.config import OUTER_OPTIMIZERS
from meshtrain.replicas.stack import entry, own, replica_mean, stacked, stacked_shardings
from meshtrain.state import TrainState

# (params, rest, batch) -> ((loss, (rest, extra metrics)), grads): one replica's loss and gradient.
Compute = Callable[[dict, dict, Mapping[str, jax.Array]], tuple]


def outer_optimizer(name: str, lr: float, momentum: float) -> optax.GradientTransformation:
    """The optimizer that applies the outer gradient θ̄ − mean_r θ_r to θ̄ at a synchronisation.

    Args:
        name: ``"average"`` (θ̄ ← mean_r θ_r; `lr` and `momentum` are ignored) or
            ``"nesterov"`` (DiLoCo: SGD with Nesterov momentum).
        lr: the outer learning rate (``nesterov``).
        momentum: the outer momentum (``nesterov``).

    Returns:
        An optax transformation; its state is what ``state.opt_state`` holds under local SGD.
    """
    if name == "average":
        return optax.sgd(1.0)
    if name == "nesterov":
        return optax.sgd(lr, momentum=momentum, nesterov=True)
    raise ValueError(
        f"outer_optimizer={name!r}: choose from {', '.join(OUTER_OPTIMIZERS)} "
        "(average: plain periodic averaging; nesterov: DiLoCo)"
    )


def local_init(params: dict, opt_state, n: int) -> dict:
    """``state.comm["local"]`` at the start: every replica at `params` with `opt_state`.

    Args:
        params: the parameters (θ̄).
        opt_state: the inner optimizer's state for `params` (``tx.init(params)``).
        n: the number of replicas.

    Returns:
        ``{"params": ..., "opt_state": ...}``, every array leaf broadcast to ``[n, ...]``
        (optax's state structure kept). Jit it with `local_shardings` as its out_shardings to
        build it in place.
    """
    return {"params": stacked(params, n), "opt_state": stacked(opt_state, n)}


def local_shardings(param_shardings, opt_shardings, axes) -> dict:
    """Where ``state.comm["local"]`` lives: each leaf's own sharding with the replica `axes`
    removed from its spec and put on a new dim 0 (so ZeRO-1's optimizer layout works too).

    Args:
        param_shardings: the parameters' `NamedSharding`s.
        opt_shardings: the inner optimizer state's `NamedSharding`s.
        axes: the replica axes.

    Returns:
        A tree of `NamedSharding`s shaped like `local_init`'s result.
    """
    return {
        "params": stacked_shardings(param_shardings, axes),
        "opt_state": stacked_shardings(opt_shardings, axes),
    }


def local_step(
    compute: Compute,
    tx: optax.GradientTransformation,
    outer_tx: optax.GradientTransformation,
    state: TrainState,
    batch: Mapping[str, jax.Array],
    *,
    mesh: Mesh,
    axes,
    sync_every: int,
    skip_nonfinite: bool = True,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One local step on every replica, then the outer step when ``(state.step + 1) %
    sync_every == 0``. Call it inside `jax.jit` (it is pure).

    With `skip_nonfinite`, a replica whose loss or gradient norm is NaN or infinite keeps its
    own parameters and optimizer moments (its integer step counters still advance, as in
    `meshtrain.train.train_step`); the other replicas step as usual.

    Args:
        compute: ``(params, rest, batch) -> ((loss, (rest, extra)), grads)``, one replica's
            mean loss, other variables, float metrics and gradient on its rows.
        tx: the inner optimizer (each replica's).
        outer_tx: the outer optimizer (`outer_optimizer`).
        state: ``params`` = θ̄, ``opt_state`` = the outer state, ``comm["local"]`` from
            `local_init`.
        batch: global arrays; each replica takes its rows of dim 0, split over `axes`.
        mesh: the device mesh.
        axes: the replica axes (``rules.replica_axes(mesh_sizes(mesh))``); the model axes stay
            with the compiler.
        sync_every: H, the number of local steps between synchronisations.
        skip_nonfinite: skip a replica's update when its loss or gradient is not finite.

    Returns:
        The new state and replicated metrics: ``loss`` and the float ``extra`` metrics (means
        over the replicas), ``grad_norm`` (the mean over the replicas of each one's own
        gradient norm: no mean gradient is ever formed), ``skipped`` (1 when any replica
        skipped), ``synced`` (1 on a synchronising step). (`meshtrain.train.train_step` adds
        ``lr``, as for every step.)
    """
    axes = tuple(axes)
    if not axes:
        raise ValueError(
            "local SGD needs at least one replica axis (data, or fsdp under dp/zero1) of size > 1"
        )
    if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
        raise ValueError(
            f"sync_every={sync_every!r}: the steps between synchronisations must be a positive "
            "integer, e.g. 4"
        )
    local = state.comm.get("local")
    if local is None:
        raise ValueError('local_step: state.comm has no "local" entry; build it with local_init')
    rows = P(entry(axes))

    def inner(params_r, opt_r, rest, batch_r):
        params_r, opt_r = own(params_r), own(opt_r)
        (loss, (new_rest, extra)), grads = compute(params_r, rest, batch_r)
        updates, new_opt = tx.update(grads, opt_r, params_r)
        new_params = optax.apply_updates(params_r, updates)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if skip_nonfinite:
            new_params = _keep_if_not(finite, new_params, params_r)
            new_opt = _keep_if_not(finite, new_opt, opt_r)
            new_rest = _keep_if_not(finite, new_rest, rest)
        metrics = {
            **replica_mean(extra, axes),
            "loss": lax.pmean(loss, axes),
            "grad_norm": lax.pmean(grad_norm, axes),
            "skipped": lax.pmax((~finite).astype(jnp.int32), axes),
        }
        return stacked(new_params, 1), stacked(new_opt, 1), replica_mean(new_rest, axes), metrics

    run = manual_region(
        inner,
        mesh=mesh,
        axes=axes,
        in_specs=(rows, rows, P(), rows),
        out_specs=(rows, rows, P(), P()),
    )
    local_params, local_opt, rest, metrics = run(
        local["params"], local["opt_state"], state.rest, dict(batch)
    )

    def synchronise(carry):
        theta_bar, outer_state, local_params = carry
        mean = _mean_over(local_params, mesh, axes)
        delta = jax.tree.map(jnp.subtract, theta_bar, mean)  # the outer gradient
        updates, outer_state = outer_tx.update(delta, outer_state, theta_bar)
        theta_bar = optax.apply_updates(theta_bar, updates)
        return theta_bar, outer_state, _restart(theta_bar, local_params, mesh, axes)

    synced = (state.step + 1) % sync_every == 0
    carry = (state.params, state.opt_state, local_params)
    params, opt_state, local_params = lax.cond(synced, synchronise, lambda c: c, carry)
    metrics["synced"] = synced.astype(jnp.int32)
    comm = {**state.comm, "local": {"params": local_params, "opt_state": local_opt}}
    return TrainState(state.step + 1, params, opt_state, rest, comm), metrics


def _keep_if_not(ok: jax.Array, new, old):
    """`new` where `ok`, else `old`; integer leaves (optax's step counters) take `new` always."""

    def keep(n, o):
        return n if jnp.issubdtype(n.dtype, jnp.integer) else jnp.where(ok, n, o)

    return jax.tree.map(keep, new, old)


def _mean_over(stacked, mesh: Mesh, axes):
    """mean_r θ_r of a stacked tree: one all-reduce over the replica axes, in float32."""

    def body(tree):
        return jax.tree.map(
            lambda x: lax.pmean(x[0].astype(jnp.float32), axes).astype(x.dtype), tree
        )

    rows = P(entry(axes))
    return manual_region(body, mesh=mesh, axes=axes, in_specs=(rows,), out_specs=P())(stacked)


def _restart(theta_bar, like, mesh: Mesh, axes):
    """`theta_bar` on every replica, laid out like the stacked tree `like`."""
    rows = P(entry(axes))
    body = lambda tree: stacked(tree, 1)  # noqa: E731
    out = manual_region(body, mesh=mesh, axes=axes, in_specs=(P(),), out_specs=rows)(theta_bar)
    return jax.tree.map(lambda x, ref: x.astype(ref.dtype), out, like)
