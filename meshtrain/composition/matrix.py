"""The composition matrix: every feature against every other, each cell proven or refused.

A cell is an unordered pair of feature ids (`FEATURES`, listed by group in
`meshtrain.composition.features`) from different groups, or from the same group when that
group's features combine (``tp`` with every data strategy). A cell is **proven** when some
test carries ``@pytest.mark.pair(a, b)`` and checks that pair equal to one device (or to the
feature's documented reference); it is **refused** when a row of
`meshtrain.composition.REFUSALS` names it in ``cells``; a cell some row refuses only under a
setting that is no feature (``touches``: DiLoCo with a pipeline refused under global-norm
clipping) is **conditional** (`conditional`), and still needs its proof. The test suite and
the docs build read the markers and pass the proven cells in::

    assert missing(proofs) == []  # every cell proven or refused

`KNOWN_GAPS` lists the cells found not to work, with the failure, until a fix or a refusal
row settles them (`KNOWN_GAPS_BEYOND_PAIRS`: combinations of three or more whose pairs work).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

from meshtrain.composition.features import EXCLUSIVE, FEATURES, GROUPS

__all__ = [
    "EXCLUSIVE",
    "FEATURES",
    "GROUPS",
    "KNOWN_GAPS",
    "KNOWN_GAPS_BEYOND_PAIRS",
    "Cell",
    "cell",
    "cells",
    "conditional",
    "conditions",
    "missing",
    "refused",
]

Cell = tuple[str, str]

# Cells found not to work (cell → the configuration and the error), until a fix lands or a
# refusal row names them.
KNOWN_GAPS: dict[Cell, str] = {}

# Combinations of more than two features found not to work, though each of their pairs does.
KNOWN_GAPS_BEYOND_PAIRS: dict[tuple[str, ...], str] = {}


def cell(a: str, b: str) -> Cell:
    """The cell of features `a` and `b`, in `FEATURES` order (``cell("tp", "dp") == ("dp",
    "tp")``); raises ``ValueError`` on an unknown id or a pair that is not a cell."""
    order = list(FEATURES)
    for f in (a, b):
        if f not in FEATURES:
            raise ValueError(f"{f!r}: not a feature id; choose from {', '.join(order)}")
    if a == b or any({a, b} <= group for group in EXCLUSIVE):
        raise ValueError(f"({a!r}, {b!r}): one run has only one of them, so it is not a cell")
    return (a, b) if order.index(a) < order.index(b) else (b, a)


def cells() -> list[Cell]:
    """Every cell of the matrix, in `FEATURES` order."""
    return [
        (a, b)
        for a, b in itertools.combinations(FEATURES, 2)
        if not any({a, b} <= group for group in EXCLUSIVE)
    ]


def refused(refusals: Iterable | None = None) -> dict[Cell, str]:
    """Cell → the one-line refusal that names it (``first with second: reason``).

    Args:
        refusals: rows with ``first``, ``second``, ``reason`` and ``cells``; None:
            `meshtrain.composition.REFUSALS`.

    Returns:
        The refused cells; a cell two rows name keeps the first row's line.
    """
    out: dict[Cell, str] = {}
    for row in _rows(refusals):
        for a, b in row.cells:
            out.setdefault(cell(a, b), f"{row.first} with {row.second}: {row.reason}")
    return out


def _rows(refusals: Iterable | None) -> Iterable:
    """`refusals`, or `meshtrain.composition.REFUSALS` when None."""
    if refusals is None:
        from meshtrain.composition import REFUSALS

        return REFUSALS
    return refusals


def conditions(refusals: Iterable | None = None) -> list:
    """The rows that refuse a run under a condition rather than a cell: those naming no cell
    (``cells`` empty), in the table's order; the matrix page lists each with its condition.

    Args:
        refusals: as for `refused`.

    Returns:
        The rows, each with ``first``, ``second`` (the condition), ``reason``, ``field``,
        ``fix``, ``touches`` and ``by_default``.
    """
    return [row for row in _rows(refusals) if not row.cells]


def conditional(refusals: Iterable | None = None) -> dict[Cell, list]:
    """Cell → the rows that refuse it only under a condition (their ``touches``), for the cells
    no row refuses outright; a cell is conditional whether or not a test proves it.

    Args:
        refusals: as for `refused`.

    Returns:
        The conditional cells, in the order the rows name them.
    """
    rows = list(_rows(refusals))
    outright = refused(rows)
    out: dict[Cell, list] = {}
    for row in rows:
        for a, b in getattr(row, "touches", ()):
            c = cell(a, b)
            if c not in outright:
                out.setdefault(c, []).append(row)
    return out


def missing(proofs: Mapping[Cell, object], refusals: Iterable | None = None) -> list[Cell]:
    """The cells neither proven (a key of `proofs`) nor refused (see `refused`).

    Args:
        proofs: the proven cells, e.g. ``evidence(...).proofs``.
        refusals: as for `refused`.

    Returns:
        The cells with no evidence, in matrix order.
    """
    settled = set(proofs) | set(refused(refusals))
    return [c for c in cells() if c not in settled]
