"""The train state's ``comm`` part: what synchronising less keeps per replica, and its layout.

- ``comm["residual"]``: error feedback, one residual per replica and parameter;
- ``comm["local"]``: local SGD, each replica's own parameters and inner optimizer state;
- ``comm["stale"]``: bounded staleness, the gradients still in flight;
- ``comm["consensus"]``: gossip, the replicas' mean distance to their average at the last
  outer step.

Per-replica leaves are stacked on a new dimension 0 that is split over the replica axes, so a
device holds its own replica's copy and nothing more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.layout import Rules
from meshtrain.mesh import mesh_sizes
from meshtrain.replicas.config import SyncConfig
from meshtrain.replicas.local_sgd import local_init, local_shardings, outer_optimizer
from meshtrain.replicas.manual import residual_init
from meshtrain.replicas.sets import replica_sets
from meshtrain.replicas.stack import stacked_shardings
from meshtrain.replicas.staleness import stale_init
from meshtrain.state import TrainState, abstract_target


def replicas(mesh: Mesh, rules: Rules) -> tuple[tuple[str, ...], int]:
    """The sync axes of `rules` on `mesh` (`replica_sets`), and how many devices they hold."""
    sets = replica_sets(rules, mesh_sizes(mesh))
    return sets.axes, sets.devices


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
        ``(state, shardings)`` with ``comm`` filled in; under local SGD (and gossip and
        federated averaging) ``opt_state`` becomes the outer optimizer's and the inner one
        moves, per replica, into ``comm["local"]``; gossip adds ``comm["consensus"]``.
        An abstract `state` gives an abstract result.
    """
    if sync is None or not (sync.keeps_residual or sync.local or sync.staleness):
        return state, shardings
    sets = replica_sets(rules, mesh_sizes(mesh))
    specs = jax.tree.map(lambda s: s.spec, shardings.params, is_leaf=_is_sharding)
    counts = jax.tree.map(sets.count, specs, is_leaf=_is_spec)
    opt_counts = jax.tree.map(
        lambda s: sets.count(s.spec), shardings.opt_state, is_leaf=_is_sharding
    )
    outer_tx = outer_optimizer(sync.outer_optimizer, sync.outer_lr, sync.outer_momentum)
    replicated = NamedSharding(mesh, P())

    def build(params, opt_state):
        comm = {}
        if sync.keeps_residual:
            comm["residual"] = residual_init(params, counts)
        if sync.staleness:
            comm["stale"] = stale_init(params, sync.staleness)
        if sync.local:
            comm["local"] = local_init(params, opt_state, counts, opt_counts)
            opt_state = outer_tx.init(params)
        if sync.gossips:
            comm["consensus"] = jnp.zeros((), jnp.float32)
        return opt_state, comm

    comm_sh = {}
    if sync.keeps_residual:
        comm_sh["residual"] = stacked_shardings(shardings.params, sets)
    if sync.staleness:
        comm_sh["stale"] = jax.tree.map(
            lambda s: NamedSharding(mesh, P(None, *s.spec)), shardings.params
        )
    if sync.gossips:
        comm_sh["consensus"] = replicated
    opt_sh = shardings.opt_state
    if sync.local:
        comm_sh["local"] = local_shardings(shardings.params, shardings.opt_state, sets)
        abstract_outer = jax.eval_shape(outer_tx.init, state.params)
        opt_sh = optax.tree_map_params(
            outer_tx,
            lambda _, s: s,
            abstract_outer,
            shardings.params,
            transform_non_params=lambda _: replicated,
            is_leaf=_is_sharding,
        )
    new_sh = shardings._replace(opt_state=opt_sh, comm=comm_sh)
    if isinstance(jax.tree.leaves(state.params)[0], jax.ShapeDtypeStruct):
        opt_state, comm = jax.eval_shape(build, state.params, state.opt_state)
        return abstract_target(state._replace(opt_state=opt_state, comm=comm), new_sh), new_sh
    opt_state, comm = jax.jit(build, out_shardings=(opt_sh, comm_sh))(state.params, state.opt_state)
    return state._replace(opt_state=opt_state, comm=comm), new_sh


def _is_sharding(x) -> bool:
    """A `NamedSharding` leaf."""
    return isinstance(x, NamedSharding)


def _is_spec(x) -> bool:
    """A `PartitionSpec` leaf."""
    return isinstance(x, P)
