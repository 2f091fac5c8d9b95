"""Resolving logical dimension names to a `PartitionSpec`, with one divisibility policy.

The policy, used for parameters, optimizer state, batches, activation constraints and kernels
alike: for each named dimension, the rule's alternatives are tried in order; mesh axes of
size 1 and axes an earlier dimension already uses are left out; the first alternative whose
remaining axes divide the dimension wins. When none divides, it is an error that names the
dimension, its size, the axes and the fix. ``None`` (no split) always divides, so a rule such
as ``["tensor", None]`` replicates a dimension that ``tensor`` does not divide.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain._tree import path_str
from meshtrain.layout.rules import Entry, alternatives, axes_of, entry_of
from meshtrain.mesh import mesh_sizes
from meshtrain.problem import Problem

Names = Sequence[str | None]


def resolve(
    names: Names,
    table: Mapping[str, Entry],
    mesh: Mesh | Mapping[str, int],
    *,
    shape: Sequence[int] | None = None,
    where: str = "array",
) -> P:
    """The `PartitionSpec` that logical `names` map to under `table` on `mesh`.

    Args:
        names: one logical name (or None) per dimension.
        table: a rules table, e.g. ``rules.params`` or ``rules.activations``.
        mesh: the mesh, or its axis sizes.
        shape: the array's shape; when given, each dimension must divide by its axes (the
            policy above). Without it, the first alternative is taken unchecked.
        where: what the array is, for error messages.

    Returns:
        The spec; raises ValueError naming the dimension and the fix when it cannot be split.
    """
    sizes = mesh if isinstance(mesh, Mapping) else mesh_sizes(mesh)
    if shape is not None and len(names) != len(shape):
        raise ValueError(
            f"{where}: {len(names)} logical names {tuple(names)} for an array of rank "
            f"{len(shape)} (shape {tuple(shape)}); give one name (or None) per dimension"
        )
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(names):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(
                f"{where}: unknown logical axis {name!r}; the rules know "
                f"{', '.join(sorted(table))}; add {name!r} to the rules or rename it"
            )
        axes = _choose(name, table[name], sizes, used, None if shape is None else shape[dim])
        if axes is None:
            raise ValueError(_indivisible(where, dim, name, shape[dim], table[name], sizes, used))
        used.update(axes)
        spec.append(entry_of(axes))
    return P(*spec)


def _choose(name, entry: Entry, sizes, used, size: int | None) -> tuple[str, ...] | None:
    """The first alternative's live axes that divide `size` (any, without a size), or None."""
    for option in alternatives(entry):
        axes = tuple(a for a in axes_of(option) if sizes.get(a, 1) > 1 and a not in used)
        if size is None or size % math.prod(sizes[a] for a in axes) == 0:
            return axes
    return None


def _indivisible(where, dim, name, size, entry, sizes, used) -> str:
    """The error for a dimension that no alternative of its rule divides."""
    options = [
        tuple(a for a in axes_of(o) if sizes.get(a, 1) > 1 and a not in used)
        for o in alternatives(entry)
    ]
    ways = [math.prod(sizes[a] for a in axes) for axes in options]
    split = " or ".join(
        " × ".join(f"{a}={sizes[a]}" for a in axes) + f" = {w}"
        for axes, w in zip(options, ways, strict=True)
    )
    return (
        f"{where}: dimension {dim} ({name}={size}) is not divisible by mesh {split}; change "
        f"the size to a multiple of {ways[0]} or shard {name!r} over fewer devices"
    )


def state_specs(abstract_state: nnx.State, table: Mapping[str, Entry], mesh, *, warn=True):
    """Pure-dict tree of `PartitionSpec`s for every variable in `abstract_state`.

    Variables with no logical names are replicated; with ``warn`` one warning names them all.
    """
    specs: dict = {}
    unnamed = []
    for path, var in nnx.to_flat_state(abstract_state):
        shape = tuple(var.get_value().shape)
        names = var.get_metadata().get("out_sharding")
        where = f"parameter {path_str(path)!r} {shape}"
        if names:
            spec = resolve(tuple(names), table, mesh, shape=shape, where=where)
        else:
            spec = P()
            if isinstance(var, nnx.Param) and math.prod(shape) > 1:
                unnamed.append(path_str(path))
        node = specs
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = spec
    if unnamed and warn:
        warnings.warn(
            f"meshtrain: {len(unnamed)} parameter(s) have no logical axis names and will be "
            f"replicated on every device: {', '.join(unnamed)}. Annotate them with "
            "nnx.with_partitioning(init, names) to shard them.",
            stacklevel=3,
        )
    return specs


def state_problems(
    abstract_state: nnx.State, table: Mapping[str, Entry], sizes, *, strategy: str = "custom"
) -> list[Problem]:
    """Every variable that cannot be laid out under `table` on a mesh of `sizes` (no raise),
    each a `Problem` filed under ``strategy`` (the rules' name)."""
    problems = []
    for path, var in nnx.to_flat_state(abstract_state):
        names = var.get_metadata().get("out_sharding")
        if not names:
            continue
        shape = tuple(var.get_value().shape)
        try:
            resolve(tuple(names), table, sizes, shape=shape, where=f"parameter {path_str(path)!r}")
        except ValueError as e:
            problems.append(Problem("strategy", strategy, str(e)))
    return problems


def named(specs, mesh: Mesh):
    """Maps a tree of `PartitionSpec`s to `NamedSharding`s on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
