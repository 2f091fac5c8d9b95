"""The `meshtrain-no-effect` directive: the table of settings that count only while a feature
is on, generated from `meshtrain.effect.NEEDS` at build time, so the page lists exactly what
the run check refuses."""

from __future__ import annotations

from _tables import table
from docutils import nodes
from sphinx.util.docutils import SphinxDirective

COLUMNS = ("flag", "belongs to", "to make it count", "checked by")
WHERE = {"run": "the run check", "job": "meshtrain train"}


def rows() -> list[tuple[str, ...]]:
    """One row per setting: its flag, the feature it belongs to, the fix and what checks it."""
    from meshtrain.effect import NEEDS

    return [(n.flag, n.feature, n.fix, WHERE[n.scope]) for n in NEEDS]


class NoEffect(SphinxDirective):
    """The settings without effect while their feature is off, as a table."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        self.env.note_reread()  # the table comes from the code: read it again on every build
        return [table(COLUMNS, rows(), (True, False, False, False))]


def setup(app):
    """Registers the directive."""
    app.add_directive("meshtrain-no-effect", NoEffect)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
