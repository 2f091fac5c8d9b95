"""The `meshtrain-cli` directive: the CLI reference, generated from the CLI at build time.

It reads `meshtrain.cli.COMMANDS` (subcommand name → one-line summary) and captures the help
each subcommand prints for `meshtrain NAME --help`, so the reference cannot drift from the
flags the command really takes.
"""

from __future__ import annotations

import contextlib
import io
import os

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

WIDTH = "100"  # help is wrapped at this width, whatever terminal builds the docs


@contextlib.contextmanager
def _columns(width: str):
    """COLUMNS set to `width` for tyro and rich, restored afterwards."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = width
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def command_help(name: str | None) -> str:
    """What `meshtrain NAME --help` (`meshtrain --help` for None) prints, stdout and stderr."""
    from meshtrain import cli

    argv = [name, "--help"] if name else ["--help"]
    out = io.StringIO()
    with _columns(WIDTH), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = cli.main(argv)
        except SystemExit as stop:
            status = stop.code
    if status not in (0, None):
        shown = " ".join(["meshtrain", *argv])
        raise RuntimeError(f"{shown} exited with {status}:\n{out.getvalue()}")
    return out.getvalue()


def commands() -> dict[str, str]:
    """The subcommands, in the order `meshtrain --help` lists them."""
    from meshtrain import cli

    return dict(cli.COMMANDS)


def _literal(text: str) -> nodes.literal_block:
    """A block of captured help, shown as plain text."""
    block = nodes.literal_block(text, text)
    block["language"] = "text"
    return block


class CliReference(SphinxDirective):
    """`meshtrain --help`, then one section per subcommand: its summary and its `--help`."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        self.env.note_reread()  # the help comes from the code: read it again on every build
        out: list[nodes.Node] = [_literal(command_help(None))]
        for name, summary in commands().items():
            section = nodes.section(ids=[f"meshtrain-{name}"], names=[f"meshtrain {name}"])
            section += nodes.title(text=f"meshtrain {name}")
            if summary:
                section += nodes.paragraph(text=summary)
            section += _literal(command_help(name))
            out.append(section)
        return out


def setup(app):
    """Register the directive with Sphinx."""
    app.add_directive("meshtrain-cli", CliReference)
    return {"parallel_read_safe": True, "version": "1"}
