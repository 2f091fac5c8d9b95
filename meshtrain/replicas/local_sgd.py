"""Local SGD and DiLoCo: replicas that step on their own data and synchronise every H steps;
gossip and federated averaging run in the same step.

Under local SGD the train state holds:

- ``state.params``: θ̄, the parameters at the last synchronisation (what evaluation, export,
  sampling and checkpoints-as-models see);
- ``state.opt_state``: the outer optimizer's state (`outer_optimizer`);
- ``state.comm["local"]``: ``{"params", "opt_state"}``, each replica's own parameters θ_r and
  inner optimizer state, every leaf ``[R, ...]`` with the replica axes on dim 0 (`local_init`,
  laid out by `local_shardings`). For a mixture of experts R is the leaf's own
  (`meshtrain.replicas.sets`): an expert weight has one copy per data replica, a dense weight
  one per device over data and expert; each is averaged over its own copies.

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

Gossip (`meshtrain.replicas.gossip`) mixes each replica's parameters with its neighbours'
after every local step and makes θ̄ the replicas' mean at the outer step without restarting
them; federated averaging (`meshtrain.replicas.federated`) averages only a round's sampled
clients at the outer step, and starts every client's round with fresh optimizer moments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshtrain.context_parallel import whole_model_in_region
from meshtrain.layout import axes_of, manual_region, rows_apart
from meshtrain.replicas import federated
from meshtrain.replicas import gossip as graphs
from meshtrain.replicas.config import OUTER_OPTIMIZERS, SyncConfig
from meshtrain.replicas.sets import ReplicaSets
from meshtrain.replicas.stack import (
    entry,
    own,
    replica_mean,
    settled,
    stacked,
    stacked_shardings,
)
from meshtrain.state import TrainState

# (params, rest, batch) -> ((loss, (rest, extra metrics)), grads): one replica's loss and gradient.
Compute = Callable[[dict, dict, Mapping[str, jax.Array]], tuple]


def outer_optimizer(name: str, lr: float, momentum: float) -> optax.GradientTransformation:
    """The optimizer that applies the outer gradient θ̄ − mean_r θ_r to θ̄ at a synchronisation.

    Args:
        name: ``"average"`` (θ̄ ← mean_r θ_r; `lr` and `momentum` are ignored),
            ``"nesterov"`` (DiLoCo: SGD with Nesterov momentum) or ``"adam"`` (FedAdam: Adam
            with β₂ = 0.99 and ε = 1e-3, Reddi et al., "Adaptive Federated Optimization",
            2021).
        lr: the outer learning rate (``nesterov``, ``adam``).
        momentum: the outer momentum (``nesterov``; Adam's β₁).

    Returns:
        An optax transformation; its state is what ``state.opt_state`` holds under local SGD.
    """
    if name == "average":
        return optax.sgd(1.0)
    if name == "nesterov":
        return optax.sgd(lr, momentum=momentum, nesterov=True)
    if name == "adam":
        return optax.adam(lr, b1=momentum, b2=0.99, eps=1e-3)
    raise ValueError(
        f"outer_optimizer={name!r}: choose from {', '.join(OUTER_OPTIMIZERS)} "
        "(average: plain periodic averaging; nesterov: DiLoCo; adam: FedAdam)"
    )


def local_init(params: dict, opt_state, n, opt_n=None) -> dict:
    """``state.comm["local"]`` at the start: every replica at `params` with `opt_state`.

    Args:
        params: the parameters (θ̄).
        opt_state: the inner optimizer's state for `params` (``tx.init(params)``).
        n: the number of replicas: an int, or a tree like `params` of each leaf's own
            (`meshtrain.replicas.ReplicaSets.count`).
        opt_n: the same for `opt_state` (default: `n`, which must then be an int).

    Returns:
        ``{"params": ..., "opt_state": ...}``, every array leaf broadcast to ``[n, ...]``
        (optax's state structure kept). Jit it with `local_shardings` as its out_shardings to
        build it in place.
    """
    return {
        "params": stacked(params, n),
        "opt_state": stacked(opt_state, n if opt_n is None else opt_n),
    }


def local_shardings(param_shardings, opt_shardings, axes) -> dict:
    """Where ``state.comm["local"]`` lives: each leaf's own sharding with the replica `axes`
    removed from its spec and put on a new dim 0 (so ZeRO-1's optimizer layout works too).

    Args:
        param_shardings: the parameters' `NamedSharding`s.
        opt_shardings: the inner optimizer state's `NamedSharding`s.
        axes: the replica axes, or a `meshtrain.replicas.ReplicaSets` (each leaf over its own).

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
    sets: ReplicaSets,
    sync: SyncConfig | int,
    skip_nonfinite: bool = True,
    param_specs=None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One local step on every replica, then the outer step when ``(state.step + 1) % H == 0``
    (H = ``sync.sync_every``). Call it inside `jax.jit` (it is pure).

    Two settings of `sync` change what the replicas exchange (module docstrings of
    `meshtrain.replicas.gossip` and `meshtrain.replicas.federated`):

    - ``gossip``: after its local step each replica mixes its parameters with its neighbours' on
      the graph (mixing step t = ``state.step``), each leaf among its own copies (an MoE's
      expert weights on the graph over the data replicas, its dense weights over data and
      expert); at the outer step θ̄ becomes the replicas' mean, the replicas go on from their
      own, and ``comm["consensus"]`` keeps their mean distance to it;
    - ``client_fraction``: the round ``state.step // H`` samples its clients from
      ``client_seed`` and the round; the outer gradient is θ̄ minus the sampled clients' mean;
      every client starts a round from θ̄ with fresh optimizer moments (its step counters go
      on).

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
        batch: global arrays; each replica takes its rows of dim 0, split over ``sets.axes``.
        sets: the layout of the step (`meshtrain.replicas.replica_sets` with ``mesh=``):
            ``sets.mesh``, the device mesh; ``sets.axes``, the sync axes (the replica axes,
            and ``expert`` for a mixture of experts; the model axes stay with the compiler);
            ``sets.split``, those of them that split some parameters (``expert``: each leaf
            has its own replicas, over the axes it is not split over); ``sets.stages``,
            ``("pipe",)`` under pipelines (the regions are manual over the stages too, each
            stage stepping its own layers; nothing is averaged over them).
        sync: the settings (``sync_every``, H, the local steps between synchronisations;
            ``gossip``; ``client_fraction`` and ``client_seed``); an int H is
            ``SyncConfig(sync_every=H)``.
        skip_nonfinite: skip a replica's update when its loss or gradient is not finite.
        param_specs: the parameters' `PartitionSpec`s (required when ``sets.split`` is not
            empty).

    Returns:
        The new state and replicated metrics: ``loss`` and the float ``extra`` metrics (means
        over the replicas), ``grad_norm`` (the mean over the replicas of each one's own
        gradient norm: no mean gradient is ever formed), ``skipped`` (1 when any replica
        skipped), ``synced`` (1 on a synchronising step). (`meshtrain.train.train_step` adds
        ``lr``, as for every step.)
    """
    sync, sync_every, local = _checked(sets, sync, state)
    mesh, specs = sets.mesh_for("local_step"), sets.specs(state.params, param_specs)
    inner = _replica_step(compute, tx, sets, specs, sync, skip_nonfinite)
    region = _local_region(inner, tx, mesh, sets, specs, local["opt_state"])
    step = jnp.asarray(state.step, jnp.int32)
    local_params, local_opt, rest, metrics = region(
        local["params"], local["opt_state"], state.rest, dict(batch), step
    )
    synced = (step + 1) % sync_every == 0
    consensus = state.comm.get("consensus", jnp.zeros((), jnp.float32))
    carry = (state.params, state.opt_state, local_params, consensus)
    synchronise = _outer_step(outer_tx, mesh, sets, specs, sync, step)
    params, opt_state, local_params, consensus = lax.cond(synced, synchronise, lambda c: c, carry)
    metrics["synced"] = synced.astype(jnp.int32)
    comm = {**state.comm, "local": {"params": local_params, "opt_state": local_opt}}
    if "consensus" in state.comm:
        comm["consensus"] = metrics["consensus"] = consensus
    return TrainState(state.step + 1, params, opt_state, rest, comm), metrics


def _checked(
    sets: ReplicaSets, sync: SyncConfig | int, state: TrainState
) -> tuple[SyncConfig, int, dict]:
    """`sync` as a `SyncConfig`, its H, and ``state.comm["local"]``; refused where no local
    step runs."""
    if not sets.axes:
        raise ValueError(
            "local SGD needs at least one replica axis (data, or fsdp under dp/zero1) of size > 1"
        )
    sync = SyncConfig(sync_every=sync) if isinstance(sync, int) else sync
    sync_every = sync.sync_every
    if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
        raise ValueError(
            f"sync_every={sync_every!r}: the steps between synchronisations must be a positive "
            "integer, e.g. 4"
        )
    local = state.comm.get("local")
    if local is None:
        raise ValueError('local_step: state.comm has no "local" entry; build it with local_init')
    return sync, sync_every, local


def _replica_step(compute: Compute, tx, sets: ReplicaSets, specs, sync: SyncConfig, skip: bool):
    """One replica's inner step, per device in the region: ``(params_r, opt_r, rest, batch_r,
    step) -> (params_r, opt_r, rest, metrics)`` (`skip`: keep a non-finite replica's own)."""
    axes = sets.axes

    def inner(params_r, opt_r, rest, batch_r, step):
        params_r, opt_r = own(params_r), own(opt_r)
        if sync.client_fraction is not None:  # a round starts with fresh moments (FedAvg's)
            opt_r = _fresh_moments(tx, params_r, opt_r, step % sync.sync_every == 0)
        # each device trains a copy of its own until the next average
        with rows_apart(), whole_model_in_region():
            (loss, (new_rest, extra)), grads = compute(params_r, rest, batch_r)
        loss, new_rest, extra = settled((loss, new_rest, extra), sets.stages)
        grads = _served_share(settled(grads, sets.stages, specs), specs, sets)
        updates, new_opt = tx.update(grads, opt_r, params_r)
        new_params = optax.apply_updates(params_r, updates)
        grad_norm = _norm(grads, specs, sets)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if skip:
            new_params = _keep_if_not(finite, new_params, params_r)
            new_opt = _keep_if_not(finite, new_opt, opt_r)
            new_rest = _keep_if_not(finite, new_rest, rest)
        if sync.gossip is not None:
            new_params = _gossip(new_params, specs, sets, sync.gossip, step)
        metrics = {
            **replica_mean(extra, axes),
            "loss": lax.pmean(loss, axes),
            "grad_norm": lax.pmean(grad_norm, axes),
            "skipped": lax.pmax((~finite).astype(jnp.int32), axes),
        }
        return stacked(new_params, 1), stacked(new_opt, 1), replica_mean(new_rest, axes), metrics

    return inner


def _gossip(params, specs, sets: ReplicaSets, topology: str, step):
    """One gossip mixing step of this replica's `params`, each leaf among its own copies: on
    the graph over the leaf's replica axes (an MoE's expert weights over the data replicas,
    its dense weights over every device of data and expert), leaves of the same axes mixed
    together."""
    leaves, tree = jax.tree.flatten(params)
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, spec in enumerate(tree.flatten_up_to(specs)):
        groups.setdefault(sets.leaf_axes(spec), []).append(i)
    mixed = list(leaves)
    for axes, idx in groups.items():
        sizes = {a: sets.sizes[a] for a in axes}
        out = graphs.mix([leaves[i] for i in idx], topology, sizes, step)
        for i, x in zip(idx, out, strict=True):
            mixed[i] = x
    return tree.unflatten(mixed)


def _served_share(grads, specs, sets: ReplicaSets):
    """`grads` scaled to this replica's share: a leaf split over a sync axis holds the gradient
    of every row its shard served."""
    scale = jax.tree.map(lambda s: sets.count(s) / sets.devices, specs, is_leaf=_is_spec)
    return jax.tree.map(lambda g, c: g * c if c != 1 else g, grads, scale)


def _local_region(inner, tx, mesh: Mesh, sets: ReplicaSets, specs, opt_state):
    """`inner` as a region manual over the sync axes, laid out for ``comm["local"]`` (whose
    inner optimizer state is `opt_state`) and each replica's rows of the batch."""
    param_in = _tree_specs(sets.stacked_spec, specs)
    opt_in = optax.tree_map_params(
        tx,
        lambda _, spec: sets.stacked_spec(spec),
        opt_state,
        specs,
        transform_non_params=lambda _: sets.stacked_spec(None),
        is_leaf=_is_spec,
    )
    return manual_region(
        inner,
        mesh=mesh,
        axes=sets.manual,
        in_specs=(param_in, opt_in, P(), P(entry(sets.axes)), P()),
        out_specs=(param_in, opt_in, P(), P()),
    )


def _outer_step(outer_tx, mesh: Mesh, sets: ReplicaSets, specs, sync: SyncConfig, step):
    """The synchronisation, a `lax.cond` branch: ``(θ̄, outer state, stacked θ_r, consensus)``
    after the outer update by θ̄ − mean_r θ_r (of the sampled clients' under federated
    averaging); every replica restarts from θ̄ unless they gossip."""
    sizes = {a: sets.sizes[a] for a in sets.axes}

    def synchronise(carry):
        theta_bar, outer_state, local_params, _ = carry
        weight = None
        if sync.client_fraction is not None:  # a client is a replica of the expert weights too
            rnd, clients = step // sync.sync_every, math.prod(sizes[a] for a in _clients(sets))
            weight = federated.sampled_mask(rnd, clients, sync.client_fraction, sync.client_seed)
        gossip = sync.gossip is not None
        mean, distance = _average(local_params, mesh, sets, specs, weight, gossip)
        delta = jax.tree.map(jnp.subtract, theta_bar, mean)  # the outer gradient
        updates, outer_state = outer_tx.update(delta, outer_state, theta_bar)
        theta_bar = optax.apply_updates(theta_bar, updates)
        if not gossip:  # every replica restarts from θ̄
            local_params = _restart(theta_bar, local_params, mesh, sets, specs)
        return theta_bar, outer_state, local_params, distance

    return synchronise


def _clients(sets: ReplicaSets) -> tuple[str, ...]:
    """Federated averaging's client axes: the sync axes that split no parameter (under an
    MoE's ``expert`` split, a client is a data replica, its expert devices included)."""
    return tuple(a for a in sets.axes if a not in sets.split)


def _fresh_moments(tx, params, opt, start: jax.Array):
    """`opt` with its float leaves back at ``tx.init(params)``'s where `start` (its integer
    step counters, and with them the learning-rate schedule, go on)."""
    fresh = tx.init(params)

    def pick(o, f):
        return o if jnp.issubdtype(o.dtype, jnp.integer) else jnp.where(start, f, o)

    return jax.tree.map(pick, opt, fresh)


def _keep_if_not(ok: jax.Array, new, old):
    """`new` where `ok`, else `old`; integer leaves (optax's step counters) take `new` always."""

    def keep(n, o):
        return n if jnp.issubdtype(n.dtype, jnp.integer) else jnp.where(ok, n, o)

    return jax.tree.map(keep, new, old)


def _norm(grads, specs, sets: ReplicaSets) -> jax.Array:
    """This replica's whole gradient norm: a leaf split over a manual axis it is not reduced
    over (a pipeline stage's layers, an MoE's expert shard) adds its shards' squares."""

    def squares(g, spec):
        x = jnp.sum(jnp.square(g.astype(jnp.float32)))
        named = {a for e in (spec or ()) for a in axes_of(e)}
        over = tuple(a for a in sets.manual if a in named and a not in sets.leaf_axes(spec))
        return lax.psum(x, over) if over else x

    total = sum(jax.tree.leaves(jax.tree.map(squares, grads, specs)), jnp.zeros((), jnp.float32))
    return jnp.sqrt(total)


def _average(stacked, mesh: Mesh, sets: ReplicaSets, specs, weight=None, distance=False):
    """mean_r θ_r of a stacked tree (one all-reduce per leaf over its replica axes, in
    float32; with `weight`, a ``[replicas]`` array, the weighted mean Σ w_r θ_r / Σ w_r), and
    with `distance` the replicas' mean distance to it, ‖θ_r − mean‖ over every leaf (else 0)."""

    def body(tree, w):
        w_r = None if w is None else w[lax.axis_index(_clients(sets))]
        total = jnp.zeros((), jnp.float32)

        def one(x, s):
            nonlocal total
            x, over = x[0].astype(jnp.float32), sets.leaf_axes(s)
            m = lax.pmean(x, over) if w_r is None else federated.weighted_mean(x, w_r, over)
            if distance:
                named = {a for e in (s or ()) for a in axes_of(e)}
                split = tuple(a for a in sets.manual if a in named and a not in over)
                squares = jnp.sum(jnp.square(x - m))
                total = total + (lax.psum(squares, split) if split else squares)
            return m

        means = jax.tree.map(one, tree, specs)
        means = jax.tree.map(lambda m, x: m.astype(x.dtype), means, tree)
        return means, lax.pmean(jnp.sqrt(total), sets.axes) if distance else total

    ins, outs = _tree_specs(sets.stacked_spec, specs), _tree_specs(sets.block_spec, specs)
    region = manual_region(
        body, mesh=mesh, axes=sets.manual, in_specs=(ins, P()), out_specs=(outs, P())
    )
    return region(stacked, weight)


def _restart(theta_bar, like, mesh: Mesh, sets: ReplicaSets, specs):
    """`theta_bar` on every replica, laid out like the stacked tree `like`."""
    body = lambda tree: stacked(tree, 1)  # noqa: E731
    ins, outs = _tree_specs(sets.block_spec, specs), _tree_specs(sets.stacked_spec, specs)
    region = manual_region(body, mesh=mesh, axes=sets.manual, in_specs=(ins,), out_specs=outs)
    out = region(theta_bar)
    return jax.tree.map(lambda x, ref: x.astype(ref.dtype), out, like)


def _tree_specs(fn, specs):
    """`fn` of every spec of `specs` (None leaves: replicated)."""
    return jax.tree.map(fn, specs, is_leaf=_is_spec)


def _is_spec(x) -> bool:
    """A leaf of a tree of specs (None: replicated)."""
    return x is None or isinstance(x, P)
