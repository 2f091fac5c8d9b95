"""The train state's ``comm`` part: what synchronising less keeps per replica, and its layout.

- ``comm["residual"]``: error feedback, one residual per replica and parameter;
- ``comm["local"]``: local SGD, each replica's own parameters and inner optimizer state;
- ``comm["stale"]``: bounded staleness, the gradients still in flight.

Per-replica leaves are stacked on a new dimension 0 that is split over the replica axes, so a
device holds its own replica's copy and nothing more.
"""

from __future__ import annotations

import math

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.layout import Rules
from meshtrain.mesh import mesh_sizes
from meshtrain.replicas.config import SyncConfig
from meshtrain.replicas.local_sgd import local_init, local_shardings, outer_optimizer
from meshtrain.replicas.manual import residual_init
from meshtrain.replicas.stack import stacked_shardings
from meshtrain.replicas.staleness import stale_init
from meshtrain.state import TrainState, abstract_target


def replicas(mesh: Mesh, rules: Rules) -> tuple[tuple[str, ...], int]:
    """The replica axes of `rules` on `mesh`, and how many replicas they hold."""
    sizes = mesh_sizes(mesh)
    axes = rules.replica_axes(sizes)
    return axes, math.prod(sizes[a] for a in axes)


def with_sync(
    sync: SyncConfig | None,
    tx: optax.GradientTransformation,
    state: TrainState,
    shardings: TrainState,
    mesh: Mesh,
    rules: Rules,
) -> tuple[TrainState, TrainState]:
    """The state a run with `sync` starts from, and its shardings.

    Args:
        sync: the settings (None: synchronous, nothing added).
        tx: the optimizer `state`'s ``opt_state`` belongs to (local SGD's inner optimizer).
        state: a state as `init_train_state` builds it, or its abstract form
            (`jax.ShapeDtypeStruct`s, as for compiling ahead of time or a restore target).
        shardings: its shardings.
        mesh: the device mesh.
        rules: the layout rules.

    Returns:
        ``(state, shardings)`` with ``comm`` filled in; under local SGD ``opt_state`` becomes
        the outer optimizer's and the inner one moves, per replica, into ``comm["local"]``.
        An abstract `state` gives an abstract result.
    """
    if sync is None or not (sync.keeps_residual or sync.local or sync.staleness):
        return state, shardings
    axes, n = replicas(mesh, rules)
    outer_tx = outer_optimizer(sync.outer_optimizer, sync.outer_lr, sync.outer_momentum)
    replicated = NamedSharding(mesh, P())

    def build(params, opt_state):
        comm = {}
        if sync.keeps_residual:
            comm["residual"] = residual_init(params, n)
        if sync.staleness:
            comm["stale"] = stale_init(params, sync.staleness)
        if sync.local:
            comm["local"] = local_init(params, opt_state, n)
            opt_state = outer_tx.init(params)
        return opt_state, comm

    comm_sh = {}
    if sync.keeps_residual:
        comm_sh["residual"] = stacked_shardings(shardings.params, axes)
    if sync.staleness:
        comm_sh["stale"] = jax.tree.map(
            lambda s: NamedSharding(mesh, P(None, *s.spec)), shardings.params
        )
    opt_sh = shardings.opt_state
    if sync.local:
        comm_sh["local"] = local_shardings(shardings.params, shardings.opt_state, axes)
        abstract_outer = jax.eval_shape(outer_tx.init, state.params)
        opt_sh = optax.tree_map_params(
            outer_tx,
            lambda _, s: s,
            abstract_outer,
            shardings.params,
            transform_non_params=lambda _: replicated,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
    new_sh = shardings._replace(opt_state=opt_sh, comm=comm_sh)
    if isinstance(jax.tree.leaves(state.params)[0], jax.ShapeDtypeStruct):
        opt_state, comm = jax.eval_shape(build, state.params, state.opt_state)
        return abstract_target(state._replace(opt_state=opt_state, comm=comm), new_sh), new_sh
    opt_state, comm = jax.jit(build, out_shardings=(opt_sh, comm_sh))(state.params, state.opt_state)
    return state._replace(opt_state=opt_state, comm=comm), new_sh
