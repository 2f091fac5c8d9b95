"""Mapping replica groups back to the mesh axes they run over.

A collective over mesh axes A (say ``('data', 'fsdp')``) has one replica group per index of
the other axes, each holding the devices that differ only in their A coordinates. For every
set of axes we build those groups and compare; a permute's (source, target) pairs map to the
axes in which source and target differ.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np


def axis_groups(sizes: Mapping[str, int], axes: Sequence[str]) -> frozenset[frozenset[int]]:
    """The replica groups of a collective over `axes` on a mesh of `sizes` (ids in order)."""
    names = list(sizes)
    ids = np.arange(int(np.prod(list(sizes.values())))).reshape([sizes[a] for a in names])
    chosen = [names.index(a) for a in axes]
    rest = [i for i in range(len(names)) if i not in chosen]
    size = int(np.prod([ids.shape[i] for i in chosen])) if chosen else 1
    flat = ids.transpose(rest + chosen).reshape(-1, size)
    return frozenset(frozenset(int(x) for x in g) for g in flat)


def axes_of_groups(
    groups: Sequence[Sequence[int]], sizes: Mapping[str, int], permute: bool = False
) -> tuple[str, ...] | None:
    """The mesh axes a collective's replica groups run over.

    Args:
        groups: replica groups of device ids (positions in ``mesh.devices.flat``), or a
            permute's (source, target) pairs.
        sizes: the mesh axis sizes, in mesh order.
        permute: `groups` are (source, target) pairs.

    Returns:
        The axes (in mesh order, size-1 axes left out), ``()`` for a collective within one
        device, or None when the groups match no set of axes (an irregular pattern).
    """
    names = [a for a, s in sizes.items() if s > 1]
    if permute:
        shape = list(sizes.values())
        differ: set[str] = set()
        for src, dst in groups:
            a, b = np.unravel_index(src, shape), np.unravel_index(dst, shape)
            differ |= {name for name, i, j in zip(sizes, a, b, strict=True) if i != j}
        return tuple(a for a in sizes if a in differ)
    target = frozenset(frozenset(g) for g in groups if g)
    if not target or all(len(g) <= 1 for g in target):
        return ()
    for r in range(1, len(names) + 1):
        for combo in itertools.combinations(names, r):
            if axis_groups(sizes, combo) == target:
                return combo
    return None
