"""The `meshtrain-composition` directive: the composition matrix, generated at build time from
the test suite's ``pair`` markers and `meshtrain.composition.REFUSALS` (see
`meshtrain.composition.matrix`), as a grid of symbols, a list of every cell's evidence and a
list of the rows that refuse a run only under a condition (`page` builds it all).

The markers are read by the suite's own reader, ``tests/_pair_markers.py``: the library ships
without its tests, so the docs build, which runs from the repository, loads it from there."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

TESTS = Path(__file__).resolve().parents[2] / "tests"
SYMBOLS = {
    "proven": "✓",
    "conditional": "◐",
    "refused": "✗",
    "gap": "!",
    "open": "?",
    "same": "·",
    "self": "",
}
LEGEND = (
    "✓ a test proves the pair equal to one device; ◐ conditional: refused under a setting "
    "(named below, and marked where that setting is the default), proven without it; ✗ refused "
    "before compiling (the reason below); ! known not to work yet; ? no evidence yet; · one run "
    "has only one of the two."
)
CONDITIONS = (
    "Refused under a condition: these rows refuse a run by a setting that is no feature of the "
    "grid (the second feature names it), so they name no cell outright; the cells they touch "
    "are conditional (◐)."
)


def _markers():
    """The suite's marker reader, ``tests/_pair_markers.py``, loaded from its file."""
    name = "_pair_markers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
        assert spec is not None and spec.loader is not None, f"{TESTS / name}.py is missing"
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _status() -> tuple[dict, dict, dict, dict]:
    """(cell → tests, cell → refusal line, cell → conditional rows, cell → known gap)."""
    from meshtrain.composition import matrix as cm

    proofs = _markers().evidence(TESTS).proofs
    return proofs, cm.refused(), cm.conditional(), dict(cm.KNOWN_GAPS)


def _text(text: str, code: bool = False) -> nodes.paragraph:
    """A paragraph of `text` (as code when `code`)."""
    return nodes.paragraph("", "", nodes.literal(text, text) if code else nodes.Text(text))


def _table(head: list[str], rows: list[list[nodes.Node]], widths: list[int]) -> nodes.table:
    """A table with a header row; each cell given as a node."""
    group = nodes.tgroup(cols=len(head))
    group += [nodes.colspec(colwidth=w) for w in widths]
    thead, tbody = nodes.thead(), nodes.tbody()
    row = nodes.row()
    for text in head:
        entry = nodes.entry()
        entry += _text(text)
        row += entry
    thead += row
    for cells in rows:
        row = nodes.row()
        for node in cells:
            entry = nodes.entry()
            entry += node
            row += entry
        tbody += row
    group += thead
    group += tbody
    return nodes.table("", group)


def status(c, proofs, refused, conditional, gaps) -> str:
    """The status of cell `c`: refused, conditional, proven, gap or open (in that precedence)."""
    if c in refused:
        return "refused"
    if c in conditional:
        return "conditional"
    if c in proofs:
        return "proven"
    return "gap" if c in gaps else "open"


def _symbol(a: str, b: str, *found) -> str:
    """The grid's symbol for features `a` and `b` (`found` as for `status`)."""
    from meshtrain.composition import matrix as cm

    if a == b:
        return SYMBOLS["self"]
    try:
        c = cm.cell(a, b)
    except ValueError:
        return SYMBOLS["same"]
    return SYMBOLS[status(c, *found)]


def condition_text(row) -> str:
    """A conditional row's condition in one line, saying when the setting is the default."""
    default = " (the default setting: refused unless it is changed)" if row.by_default else ""
    return f"refused with {row.second}{default}: {row.reason}; {row.fix.format(model='gpt')}"


def _tests(tests: list[str]) -> nodes.paragraph:
    """The proving tests, as code, comma-separated."""
    what = nodes.paragraph()
    for i, test in enumerate(tests):
        what += [nodes.Text(", ")] if i else []
        what += nodes.literal(test, test)
    return what


def _evidence(c, proofs, refused, conditional, gaps) -> tuple[str, list[nodes.Node]]:
    """Cell `c`'s status word and its evidence."""
    kind = status(c, proofs, refused, conditional, gaps)
    if kind == "refused":
        return "refused", [_text(refused[c])]
    if kind == "conditional":
        out: list[nodes.Node] = [
            _text(f"{row.first}: {condition_text(row)}") for row in conditional[c]
        ]
        if c in proofs:
            out += [_text("without it:"), _tests(proofs[c])]
        else:
            out += [_text("without it: no test yet")]
        return "conditional", out
    if kind == "proven":
        return "proven", [_tests(proofs[c])]
    if kind == "gap":
        return "known gap", [_text(gaps[c])]
    return "open", [_text("no test and no refusal yet")]


def _entry(nodes_: list[nodes.Node]) -> nodes.Node:
    """One table cell holding several paragraphs."""
    if len(nodes_) == 1:
        return nodes_[0]
    box = nodes.container()
    box += nodes_
    return box


def page(proofs, refused, conditional, gaps, conditions) -> list[nodes.Node]:
    """The matrix page's nodes: legend, grid, features, every cell's evidence, the rows refused
    under a condition and the combinations of more than two features known not to work.

    Args:
        proofs: cell → the tests proving it.
        refused: cell → the refusal line (`meshtrain.composition.matrix.refused`).
        conditional: cell → the rows refusing it under a condition (`...matrix.conditional`).
        gaps: cell → the known failure.
        conditions: the rows naming no cell (`...matrix.conditions`).
    """
    from meshtrain.composition import matrix as cm

    found = (proofs, refused, conditional, gaps)
    ids = list(cm.FEATURES)
    grid = [[_text(a, code=True), *(_text(_symbol(a, b, *found)) for b in ids)] for a in ids]
    out: list[nodes.Node] = [_text(LEGEND), _table(["", *ids], grid, [4] + [1] * len(ids))]
    features = [
        [_text(group), _text(f, code=True), _text(line)]
        for group, members in cm.GROUPS.items()
        for f, line in members.items()
    ]
    out.append(_table(["group", "feature", "what it is"], features, [2, 2, 8]))
    rows = []
    for a, b in cm.cells():
        word, what = _evidence((a, b), *found)
        rows.append([_text(a, code=True), _text(b, code=True), _text(word), _entry(what)])
    out.append(_table(["feature", "with", "status", "evidence"], rows, [2, 2, 1, 8]))
    listed = []
    for row in conditions:
        touched = ", ".join(f"({a}, {b})" for a, b in row.touches) or "none"
        condition = row.second + (" (the default)" if row.by_default else "")
        listed.append(
            [
                _text(row.first),
                _text(condition),
                _text(row.reason),
                _text(row.field.format(model="gpt"), code=True),
                _text(row.fix.format(model="gpt")),
                _text(touched),
            ]
        )
    out.append(_text(CONDITIONS))
    head = ["first feature", "condition", "why", "setting named", "fix", "cells touched"]
    out.append(_table(head, listed, [2, 2, 4, 2, 3, 2]))
    beyond = [
        [_text(" + ".join(features)), _text(why)]
        for features, why in cm.KNOWN_GAPS_BEYOND_PAIRS.items()
    ]
    if beyond:
        out.append(_text("Combinations of more than two features known not to work yet:"))
        out.append(_table(["features", "what fails"], beyond, [3, 9]))
    return out


class Composition(SphinxDirective):
    """The matrix: a symbol grid, then each cell with its evidence."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from meshtrain.composition import matrix as cm

        self.env.note_reread()  # generated from the tests and the code: read on every build
        return page(*_status(), cm.conditions())


def setup(app):
    """Registers the directive."""
    app.add_directive("meshtrain-composition", Composition)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
