"""The `meshtrain-refusals` directive: the table of refused pairs of features, generated from
`meshtrain.composition.REFUSALS` at build time, so the page lists exactly what the run check
refuses."""

from __future__ import annotations

from _tables import table
from docutils import nodes
from sphinx.util.docutils import SphinxDirective

COLUMNS = ("first feature", "second feature", "why", "setting named", "fix")


def rows() -> list[tuple[str, ...]]:
    """One row per refusal: the two features, the reason, the setting and the fix."""
    from meshtrain.composition import REFUSALS

    return [
        (r.first, r.second, r.reason, r.field.format(model="gpt"), r.fix.format(model="gpt"))
        for r in REFUSALS
    ]


class Refusals(SphinxDirective):
    """The refused pairs as a table."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        self.env.note_reread()  # the table comes from the code: read it again on every build
        return [table(COLUMNS, rows(), (False, False, False, True, False))]


def setup(app):
    """Registers the directive."""
    app.add_directive("meshtrain-refusals", Refusals)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
