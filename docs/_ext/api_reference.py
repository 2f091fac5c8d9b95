"""The `meshtrain-api` directive: a module's public API, documented name by name.

`.. meshtrain-api:: meshtrain.lower` documents every name in that module's `__all__`, in that
order, with autodoc (classes with their public members, functions, constants, submodules).
The reference follows `__all__`, so a name added to the public API appears without an edit
here, and one removed from it disappears.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

# The public modules in the order of the reference; a name re-exported by a later one (the
# lower tier's `constrain`, say) is described there too, but indexed under the first only.
PUBLIC = ("meshtrain", "meshtrain.lower", "meshtrain.hf", "meshtrain.kernels")

# A Markdown-style `name` in a docstring (not a role's :role:`name`, not ``name``).
_CODE = re.compile(r"(?<![`:\w])`([^`\n]+)`(?![`])(\w?)")


def _earlier(module_name: str, obj: object) -> bool:
    """Whether a public module before this one already exports the same object."""
    for earlier in PUBLIC[: PUBLIC.index(module_name)] if module_name in PUBLIC else ():
        module = importlib.import_module(earlier)
        if any(getattr(module, n) is obj for n in module.__all__):
            return True
    return False


def autodoc_lines(module_name: str) -> list[str]:
    """The reStructuredText autodoc directives for every name in the module's `__all__`."""
    module = importlib.import_module(module_name)
    lines: list[str] = []
    for name in module.__all__:
        obj = getattr(module, name)
        target = f"{module_name}.{name}"
        again = ["   :no-index:"] if _earlier(module_name, obj) else []
        if isinstance(obj, types.ModuleType):
            summary = (inspect.getdoc(obj) or "").split("\n", 1)[0]
            lines += [f".. py:data:: {target}", *again, "", f"   The module ``{obj.__name__}``."]
            lines += [f"   {code_literals(summary)}" if summary else "", ""]
        elif inspect.isclass(obj):
            lines += [f".. autoclass:: {target}", "   :members:", *again, ""]
        elif callable(obj):
            lines += [f".. autofunction:: {target}", *again, ""]
        else:
            value = " ".join(repr(obj).split())
            lines += [f".. py:data:: {target}", *again, "", f"   Value: ``{value}``", ""]
    return lines


def code_literals(text: str) -> str:
    """Markdown-style `code` (as the docstrings write it) as reStructuredText literals."""
    return _CODE.sub(lambda m: f"``{m[1]}``" + (f"\\ {m[2]}" if m[2] else ""), text)


def literal_docstrings(app, what, name, obj, options, lines):
    """autodoc-process-docstring: the docstrings' Markdown-style code becomes literals."""
    lines[:] = [code_literals(line) for line in lines]


class ApiReference(SphinxDirective):
    """Expands to autodoc directives for the module named in the argument."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        module_name = self.arguments[0]
        self.env.note_reread()  # the docstrings live in the code: read them again on every build
        content = StringList(autodoc_lines(module_name), source=f"<api {module_name}>")
        holder = nodes.section()
        holder.document = self.state.document
        nested_parse_with_titles(self.state, content, holder)
        return holder.children


def setup(app):
    """Register the directive with Sphinx."""
    app.add_directive("meshtrain-api", ApiReference)
    app.connect("autodoc-process-docstring", literal_docstrings, priority=400)
    return {"parallel_read_safe": True, "version": "1"}
