"""A checkpoint step's ``digests`` item: what it records at save, and the checks at restore.

The item is JSON, saved with the step's other items and committed with them::

    {"version": 1,
     "arrays": {"params/head/kernel": [d1, d2, [16, 4], "float32"], ...},
     "data": "<hash of the data item>", "meta": "<hash of the meta item>"}

``d1, d2`` are `meshtrain.checkpoint.digests.array_digests` of each array leaf (paths spelt as
`meshtrain.checkpoint.targets.layout_mismatch` spells them); ``data`` and ``meta`` are
`json_digest` of those items. A step whose restored bytes disagree with its record raises
`ChangedBytes`, which the manager treats like any other unreadable step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from meshtrain._tree import path_str
from meshtrain.checkpoint.digests import array_digests, json_digest

VERSION = 1
_SHOWN = 3  # arrays named in a message at most

Layout = dict[str, tuple[tuple[int, ...], str]]  # path → (shape, dtype)


class ChangedBytes(ValueError):
    """A checkpoint step's bytes differ from those its digests recorded when it was saved."""


def layout(tree: Any) -> Layout:
    """Path → (shape, dtype) of every array leaf of `tree` (arrays or shape structs)."""
    return {
        path_str(p): (tuple(int(n) for n in x.shape), str(x.dtype))
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def record(items: Any, data: Mapping, meta: Mapping) -> dict:
    """The ``digests`` item for a step holding the state `items` and JSON items `data`, `meta`.

    Every process of a multi-process job must call it (the array digests are one global
    computation).
    """
    digests = array_digests(items)
    arrays = {k: [*digests[k], list(shape), dtype] for k, (shape, dtype) in layout(items).items()}
    return {
        "version": VERSION,
        "arrays": arrays,
        "data": json_digest(data),
        "meta": json_digest(meta),
    }


class Record:
    """A parsed ``digests`` item: the arrays' digests and layout, the JSON items' hashes."""

    def __init__(self, raw: Any):
        try:
            if raw.get("version") != VERSION:
                raise ValueError(f"version {raw.get('version')!r}, not {VERSION}")
            self.digests = {str(k): (int(v[0]), int(v[1])) for k, v in raw["arrays"].items()}
            self.layout: Layout = {
                str(k): (tuple(int(n) for n in v[2]), str(v[3])) for k, v in raw["arrays"].items()
            }
            self.data, self.meta = str(raw["data"]), str(raw["meta"])
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as e:
            raise ChangedBytes(
                f"its digests item cannot be parsed ({type(e).__name__}: {e})"
            ) from None

    def check(self, items: Any, data: Any, meta: Any) -> None:
        """Raises `ChangedBytes` naming what differs between restored items and this record."""
        differ = []
        have = layout(items)
        if have != self.layout:
            odd = sorted(
                k for k in have.keys() | self.layout.keys() if have.get(k) != self.layout.get(k)
            )
            differ.append(f"its digests record other arrays than its state holds ({_names(odd)})")
        else:
            digests = array_digests(items)
            odd = sorted(k for k, d in digests.items() if d != self.digests[k])
            if len(odd) == 1:
                differ.append(f"array {odd[0]} differs from its digest at save")
            elif odd:
                differ.append(
                    f"{len(odd)} of {len(digests)} arrays differ from their digests at save "
                    f"({_names(odd)})"
                )
        for name, saved, item in (("data", self.data, data), ("meta", self.meta, meta)):
            if json_digest(item) != saved:
                differ.append(f"its {name} item differs from its digest at save")
        if differ:
            raise ChangedBytes("its bytes changed: " + "; ".join(differ))


def _names(paths: list[str]) -> str:
    """The first few of `paths`, and how many more."""
    more = f" and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else ""
    return ", ".join(paths[:_SHOWN]) + more
