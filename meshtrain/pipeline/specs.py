"""The stage blocks' specs at the pipeline region's edge, and their gradients' reduction.

Inside the region only its manual axes appear in a spec; with ``gather_once`` the weights
enter whole over the gathered axes, and their gradients are reduce-scattered back over them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from meshtrain.layout import axes_of, entry_of


def _filtered(spec: P, keep: Callable[[str], bool]) -> P:
    """`spec` with only the mesh axes `keep` accepts: an entry left with one axis names it
    alone, one left with none is None."""
    entries = []
    for entry in spec:
        entries.append(entry_of(tuple(a for a in axes_of(entry) if keep(a))))
    return P(*entries)


def _is_spec(x) -> bool:
    """A `PartitionSpec` leaf."""
    return isinstance(x, P)


def only(specs, axes) -> dict:
    """`specs` with only the mesh axes in `axes` kept."""
    return jax.tree.map(lambda s: _filtered(s, lambda a: a in axes), specs, is_leaf=_is_spec)


def without(specs, axes) -> dict:
    """`specs` with `axes` dropped: the blocks as the region takes them, gathered over them."""
    return jax.tree.map(lambda s: _filtered(s, lambda a: a not in axes), specs, is_leaf=_is_spec)


def reduce_grads(grads: dict, specs: dict, rows: tuple[str, ...], gathered: tuple[str, ...]):
    """`reduce_grad` of every block gradient with its spec."""
    return jax.tree.map(
        lambda g, spec: reduce_grad(g, spec, rows, gathered), grads, specs, is_leaf=_is_spec
    )


def reduce_grad(g: jax.Array, spec: P, rows: tuple[str, ...], gathered: tuple[str, ...]):
    """A block's gradient summed over the row shards that share it: summed over every row axis
    its spec does not split (the experts' own shards keep theirs), and reduce-scattered over
    the gathered axes back to the dimension they split."""
    g = _sum_over(g, tuple(a for a in rows if a not in _axes(spec)))
    for dim, entry in enumerate(spec):
        scatter = tuple(a for a in axes_of(entry) if a in gathered)
        if scatter:
            g = lax.psum_scatter(g, scatter, scatter_dimension=dim, tiled=True)
    return g


def _axes(spec: P) -> set[str]:
    """The mesh axes a spec splits over."""
    return {a for entry in spec for a in axes_of(entry)}


def _sum_over(g: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`g` summed over `axes` (unchanged when there are none)."""
    return lax.psum(g, axes) if axes else g
