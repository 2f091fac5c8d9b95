"""A docutils table built from rows of strings, for the directives that render a table the
code holds (refused pairs, settings without effect)."""

from __future__ import annotations

from docutils import nodes


def _row(cells: tuple[str, ...], literal: tuple[bool, ...]) -> nodes.row:
    """A table row; the cells marked `literal` are shown as code."""
    row = nodes.row()
    for text, code in zip(cells, literal, strict=True):
        entry = nodes.entry()
        entry += nodes.paragraph("", "", nodes.literal(text, text) if code else nodes.Text(text))
        row += entry
    return row


def table(columns: tuple[str, ...], rows, literal: tuple[bool, ...]) -> nodes.table:
    """A table with a header of `columns` and one row per item of `rows`; the columns marked
    in `literal` are shown as code."""
    group = nodes.tgroup(cols=len(columns))
    group += [nodes.colspec(colwidth=1) for _ in columns]
    head, body = nodes.thead(), nodes.tbody()
    head += _row(columns, (False,) * len(columns))
    for cells in rows:
        body += _row(cells, literal)
    group += head
    group += body
    return nodes.table("", group)
