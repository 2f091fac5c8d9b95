"""Per-replica leaves: a tree stacked on a new dimension 0 split over the replica axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.layout import axes_of


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
