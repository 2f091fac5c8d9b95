"""The `meshtrain-composition` directive: the composition matrix, generated at build time from
the test suite's ``pair`` markers and `meshtrain.composition.REFUSALS` (see
`meshtrain.composition.matrix`), as a grid of symbols and a list of every cell's evidence.

The markers are read by the suite's own reader, ``tests/_pair_markers.py``: the library ships
without its tests, so the docs build, which runs from the repository, loads it from there."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

TESTS = Path(__file__).resolve().parents[2] / "tests"
SYMBOLS = {"proven": "✓", "refused": "✗", "gap": "!", "open": "?", "same": "·", "self": ""}
LEGEND = (
    "✓ a test proves the pair equal to one device; ✗ refused before compiling (the reason "
    "below); ! known not to work yet; ? no evidence yet; · one run has only one of the two."
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


def _status() -> tuple[dict, dict, dict]:
    """(cell → tests, cell → refusal line, cell → known gap)."""
    from meshtrain.composition import matrix as cm

    return _markers().evidence(TESTS).proofs, cm.refused(), dict(cm.KNOWN_GAPS)


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


def _symbol(a: str, b: str, proofs, refused, gaps) -> str:
    """The grid's symbol for features `a` and `b`."""
    from meshtrain.composition import matrix as cm

    if a == b:
        return SYMBOLS["self"]
    try:
        c = cm.cell(a, b)
    except ValueError:
        return SYMBOLS["same"]
    if c in proofs:
        return SYMBOLS["proven"]
    if c in refused:
        return SYMBOLS["refused"]
    return SYMBOLS["gap"] if c in gaps else SYMBOLS["open"]


class Composition(SphinxDirective):
    """The matrix: a symbol grid, then each cell with its evidence."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from meshtrain.composition import matrix as cm

        self.env.note_reread()  # generated from the tests and the code: read on every build
        proofs, refused, gaps = _status()
        ids = list(cm.FEATURES)
        grid = [
            [_text(a, code=True), *(_text(_symbol(a, b, proofs, refused, gaps)) for b in ids)]
            for a in ids
        ]
        out: list[nodes.Node] = [
            _text(LEGEND),
            _table(["", *ids], grid, [4] + [1] * len(ids)),
        ]
        features = [
            [_text(group), _text(f, code=True), _text(line)]
            for group, members in cm.GROUPS.items()
            for f, line in members.items()
        ]
        out.append(_table(["group", "feature", "what it is"], features, [2, 2, 8]))
        rows = []
        for a, b in cm.cells():
            c = (a, b)
            if c in proofs:
                what = nodes.paragraph()
                for i, test in enumerate(proofs[c]):
                    what += [nodes.Text(", ")] if i else []
                    what += nodes.literal(test, test)
                status = "proven"
            elif c in refused:
                what, status = _text(refused[c]), "refused"
            elif c in gaps:
                what, status = _text(gaps[c]), "known gap"
            else:
                what, status = _text("no test and no refusal yet"), "open"
            rows.append([_text(a, code=True), _text(b, code=True), _text(status), what])
        out.append(_table(["feature", "with", "status", "evidence"], rows, [2, 2, 1, 8]))
        beyond = [
            [_text(" + ".join(features)), _text(why)]
            for features, why in cm.KNOWN_GAPS_BEYOND_PAIRS.items()
        ]
        if beyond:
            out.append(_text("Combinations of more than two features known not to work yet:"))
            out.append(_table(["features", "what fails"], beyond, [3, 9]))
        return out


def setup(app):
    """Registers the directive."""
    app.add_directive("meshtrain-composition", Composition)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
