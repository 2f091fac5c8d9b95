"""Per-replica values: trees stacked on a new dimension 0 split over the replica axes, and
replica-wide means inside regions manual over those axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.layout import axes_of, varying


def entry(axes: tuple[str, ...]):
    """The spec entry that splits one dimension over `axes`."""
    return axes[0] if len(axes) == 1 else tuple(axes)


def stacked(tree, n: int):
    """Every array leaf broadcast to ``[n, *leaf.shape]``."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


def own(tree):
    """Inside a region manual over the replica axes: this replica's ``[1, ...]`` blocks of a
    stacked tree, without dimension 0."""
    return jax.tree.map(lambda x: x[0], tree)


def stacked_shardings(shardings, axes):
    """Each `NamedSharding` with `axes` taken out of its spec and put on a new dimension 0 (so a
    ZeRO-1 optimizer state, split over the replica axes itself, stacks too)."""
    axes = tuple(axes)

    def strip(e):
        kept = tuple(a for a in axes_of(e) if a not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    def one(s: NamedSharding) -> NamedSharding:
        return NamedSharding(s.mesh, P(entry(axes), *(strip(e) for e in s.spec)))

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
