"""The train step's replica cases: what ``run.sync`` changes in `meshtrain.train.train_step`.

Local SGD (and DiLoCo, gossip, federated averaging) replaces the whole step
(`local_train_step`); gradient compression and bounded staleness change only the gradient
the update applies (`synced_grads`). Both lay the step out on the replica sets of the active
layout (`active_sets`).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import optax

from meshtrain import layout
from meshtrain.mesh import mesh_sizes
from meshtrain.replicas.codecs import parse_compression
from meshtrain.replicas.config import SyncConfig
from meshtrain.replicas.local_sgd import Compute, local_step, outer_optimizer
from meshtrain.replicas.manual import reduced_grads
from meshtrain.replicas.sets import ReplicaSets, replica_sets
from meshtrain.replicas.staleness import delay
from meshtrain.state import TrainState


def active_sets(field: str) -> ReplicaSets:
    """The replica sets of the active layout on its mesh, for a step manual over the replicas.

    Args:
        field: the `SyncConfig` setting that asks for such a step, for the errors.

    Returns:
        `meshtrain.replicas.replica_sets` with ``mesh=``: the replica axes, ``expert`` for an
        MoE, and the pipeline's ``pipe``, whose loop then runs inside that step's region.

    Raises:
        ValueError: no layout is active, or its rules have no replica axes on its mesh.
    """
    active = layout.active()
    if active is None:
        raise ValueError(
            f"{field}: a step that synchronises the replicas itself must be traced under "
            "meshtrain.layout.activation_rules(mesh, rules) (jit_train_step does this)"
        )
    sets = replica_sets(active.rules, mesh_sizes(active.mesh), mesh=active.mesh)
    if not sets.axes:
        raise ValueError(
            f"{field}: rules {active.rules.name!r} have no replica axes on this mesh (every "
            "batch axis splits the parameters); use dp, zero1 or hsdp"
        )
    return sets


def local_train_step(
    compute: Compute,
    tx: optax.GradientTransformation,
    state: TrainState,
    batch: Mapping[str, jax.Array],
    *,
    sync: SyncConfig,
    skip_nonfinite: bool,
    param_specs=None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The whole train step under local SGD: `local_step` with the outer optimizer `sync`
    names, on the active layout's replica sets.

    Args:
        compute: one replica's loss and gradient (as for `local_step`).
        tx: the inner optimizer.
        state: the train state, its ``comm["local"]`` from `meshtrain.replicas.local_init`.
        batch: global arrays.
        sync: the run's `SyncConfig` (``sync.local``).
        skip_nonfinite: skip a replica's update when its loss or gradient is not finite.
        param_specs: the parameters' `PartitionSpec`s.

    Returns:
        `local_step`'s new state and metrics.
    """
    outer_tx = outer_optimizer(sync.outer_optimizer, sync.outer_lr, sync.outer_momentum)
    return local_step(
        compute,
        tx,
        outer_tx,
        state,
        batch,
        sets=active_sets("sync_every"),
        sync=sync,
        skip_nonfinite=skip_nonfinite,
        param_specs=param_specs,
    )


def synced_grads(
    compute: Compute,
    state: TrainState,
    batch: Mapping[str, jax.Array],
    *,
    sync: SyncConfig,
    param_specs=None,
):
    """The loss and the gradient a synchronous step applies under `sync`.

    With ``sync.grad_compression`` the replicas exchange their gradients by its codec
    (`reduced_grads`, error-feedback residuals in ``comm["residual"]``); with
    ``sync.staleness`` the gradient applied is the one computed that many steps before
    (`delay`, the ring in ``comm["stale"]``); otherwise `compute` on the whole batch.

    Args:
        compute: ``(params, rest, batch) -> ((loss, (rest, extra)), grads)``.
        state: the train state.
        batch: global arrays.
        sync: the run's `SyncConfig` (not ``sync.local``).
        param_specs: the parameters' `PartitionSpec`s (compression encodes shard by shard).

    Returns:
        ``((loss, (rest, extra)), grads, comm, ready)``: `compute`'s result with the gradient
        to apply, the new ``comm``, and whether that gradient exists yet (False for the first
        ``staleness`` steps, whose update must not apply; True without staleness).
    """
    comm = dict(state.comm)
    if sync.compresses:
        out, grads, residual = reduced_grads(
            compute,
            state.params,
            state.rest,
            batch,
            comm.get("residual"),
            sets=active_sets("grad_compression"),
            codec=parse_compression(sync.grad_compression),
            error_feedback=sync.error_feedback,
            param_specs=param_specs,
        )
        if residual is not None:
            comm["residual"] = residual
    else:
        out, grads = compute(state.params, state.rest, batch)
    ready: bool | jax.Array = True
    if sync.staleness:
        grads, comm["stale"], ready = delay(grads, comm["stale"], state.step)
    return out, grads, comm, ready
