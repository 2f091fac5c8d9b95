"""Per-replica values: trees stacked on a new dimension 0 split over the replica axes, and
replica-wide means inside regions manual over those axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain._compat import varying_axes
from meshtrain.layout import axes_of, entry_of, varying
from meshtrain.replicas.sets import ReplicaSets


def entry(axes: tuple[str, ...]):
    """The spec entry that splits one dimension over `axes`."""
    return axes[0] if len(axes) == 1 else tuple(axes)


def stacked(tree, n):
    """Every array leaf broadcast to ``[n, *leaf.shape]``; `n` an int, or a tree of each
    leaf's own."""
    counts = jax.tree.map(lambda _: n, tree) if isinstance(n, int) else n
    return jax.tree.map(lambda x, r: jnp.broadcast_to(x, (r, *jnp.shape(x))), tree, counts)


def own(tree):
    """Inside a region manual over the replica axes: this replica's ``[1, ...]`` blocks of a
    stacked tree, without dimension 0."""
    return jax.tree.map(lambda x: x[0], tree)


def stacked_shardings(shardings, axes):
    """Each `NamedSharding` with its replica axes taken out of its spec and put on a new
    dimension 0 (so a ZeRO-1 optimizer state, split over the replica axes itself, stacks too).

    Args:
        shardings: a tree of `NamedSharding`s.
        axes: the replica axes, or a `meshtrain.replicas.ReplicaSets` (each leaf then over
            its own replica axes: an expert weight's stack keeps ``expert`` where it was).
    """
    sets = axes if isinstance(axes, ReplicaSets) else None

    def strip(e, over):
        return entry_of(tuple(a for a in axes_of(e) if a not in over))

    def one(s: NamedSharding) -> NamedSharding:
        over = tuple(axes) if sets is None else sets.leaf_axes(s.spec)
        return NamedSharding(s.mesh, P(entry(over), *(strip(e, over) for e in s.spec)))

    return jax.tree.map(one, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


def replica_mean(tree, axes: tuple[str, ...]):
    """Float leaves averaged over the replicas; other leaves their maximum (the same value on
    every replica, made so)."""

    def mean(x):
        x = varying(x, axes)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return lax.pmean(x, axes)
        return lax.pmax(x, axes)

    return jax.tree.map(mean, tree)


def settled(tree, axes, specs=None):
    """Leaves typed as varying over the stage `axes` whose values are the same on every stage
    (gradient accumulation's carry starts varying over every manual axis), made invariant
    again by their mean over those axes; leaves whose spec (`specs`, a tree like `tree`) splits
    them over an axis stay as they are over it."""
    axes = tuple(axes)
    if not axes:
        return tree
    specs = jax.tree.map(lambda _: None, tree) if specs is None else specs

    def one(x, spec):
        named = {a for e in (spec or ()) for a in axes_of(e)}
        over = tuple(a for a in axes if a not in named and a in varying_axes(x))
        return lax.pmean(x, over) if over else x

    return jax.tree.map(one, tree, specs)
