"""The ``pytest.mark.pair(a, b)`` markers of test files, read with `ast` (nothing is imported),
and the cells of the composition matrix they prove (`evidence`). The suite checks the matrix
with them and the docs build draws it; the library holds only the matrix itself
(`meshtrain.composition.matrix`).

A marker counts where it decorates a test function (``@pytest.mark.pair("a", "b")``, also
through a module-level name bound to such a mark) or sits in the ``marks=`` of a
``pytest.param`` among the function's ``parametrize`` values: written there, in a
module-level list the decorator names, or in a comprehension over literal values
(``[pytest.param(a, marks=pytest.mark.pair("packed", a)) for a in ("ring", "ulysses")]``,
f-strings of its names included) or over ``combinations`` of them (every two of a case's
features: ``[pair(a, b) for a, b in combinations(("dp", "tp", "remat"), 2)]``), also inside a
module-level function the values call, its parameters bound to the call's literal arguments
(``case(Case(...), ("dp", "tp", "remat"))`` returning such a ``pytest.param``)::

    for where, pair in markers("tests"):
        print(where, pair)  # tests/test_x.py::test_y ('packed', 'ring')

    found = evidence("tests")
    assert missing(found.proofs) == []  # every cell proven or refused
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

from meshtrain.composition.matrix import Cell, cell

__all__ = ["Evidence", "evidence", "markers"]

Env = Mapping[str, object]


class _Unreadable(Exception):
    """A marker argument that is not a literal value here."""


class Evidence(NamedTuple):
    """What the test files say about the matrix.

    Args:
        proofs: cell → the tests (``tests/file.py::function``) that carry its pair marker.
        bad: one line per pair marker that names no cell (unknown id, a feature with itself
            or two of one exclusive group, arguments that are not string literals).
    """

    proofs: dict[Cell, list[str]]
    bad: list[str]


def evidence(root: str | Path) -> Evidence:
    """The ``pair`` markers of the test files ``root/test_*.py`` (see `markers` for where a
    marker counts), as the cells they prove.

    Args:
        root: the folder of the test files.

    Returns:
        The proven cells and the markers that name no cell.
    """
    proofs: dict[Cell, list[str]] = {}
    bad: list[str] = []
    for where, found in markers(root):
        try:
            if isinstance(found, str):
                raise ValueError(found)
            c = cell(*found)
        except (TypeError, ValueError) as e:
            bad.append(f"{where}: {e}")
            continue
        if where not in proofs.setdefault(c, []):
            proofs[c].append(where)
    return Evidence(proofs, bad)


def markers(root: str | Path) -> list[tuple[str, tuple[str, ...] | str]]:
    """Every pair marker of the files ``root/test_*.py``.

    Args:
        root: the folder of the test files.

    Returns:
        ``(where, pair)`` per marker: `where` is ``folder/file.py::function``; `pair` the two
        strings, or a line saying why the marker cannot be read (arguments that are not two
        literal strings).
    """
    root = Path(root)
    out: list[tuple[str, tuple[str, ...] | str]] = []
    for path in sorted(root.glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        names = _module_names(tree)
        for fn in _test_functions(tree):
            where = f"{root.name}/{path.name}::{fn.name}"
            out += [(where, _resolve(call, names, env)) for call, env in _pair_marks(fn, names)]
    return out


def _module_names(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level ``NAME = value`` assignments (lists of cases, marks bound to names) and
    functions (helpers that build cases)."""
    out: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            out[node.target.id] = node.value
    return out


def _test_functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The ``test*`` functions at module level and in ``Test*`` classes."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, kinds) and node.name.startswith("test"):
            yield node
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            yield from (n for n in node.body if isinstance(n, kinds) and n.name.startswith("test"))


def _is_pair(func: ast.expr, names: Mapping[str, ast.expr]) -> bool:
    """Whether `func` is ``pytest.mark.pair`` / ``mark.pair`` or a module name bound to it."""
    if isinstance(func, ast.Name) and func.id in names:
        return _is_pair(names[func.id], {})
    if not (isinstance(func, ast.Attribute) and func.attr == "pair"):
        return False
    mark = func.value
    return (isinstance(mark, ast.Attribute) and mark.attr == "mark") or (
        isinstance(mark, ast.Name) and mark.id == "mark"
    )


def _is_param(call: ast.Call, names: Mapping[str, ast.expr]) -> bool:
    """Whether `call` is ``pytest.param(...)``."""
    return getattr(call.func, "attr", None) == "param"


def _find(node: ast.AST, names, env: Env, want, seen=()) -> Iterator[tuple[ast.Call, Env]]:
    """The calls inside `node` that `want`, each with the comprehension variables bound where
    it sits (a comprehension runs once per binding); module-level names are followed once."""
    if isinstance(node, ast.Call) and want(node, names):
        yield node, env
        return
    helper = _helper(node, names)
    if helper is not None and helper.name not in seen:
        bound = _arguments(helper, node, names, env)  # the helper's own scope
        for stmt in helper.body:
            yield from _find(stmt, names, bound, want, (*seen, helper.name))
        for arg in (*node.args, *(k.value for k in node.keywords)):
            yield from _find(arg, names, env, want, seen)
        return
    if isinstance(node, ast.ListComp | ast.GeneratorExp | ast.SetComp):
        # unreadable iterables: once, with the variables unbound (so a mark naming them is
        # reported rather than lost)
        for bound in _bindings(node.generators, names, env) or [env]:
            yield from _find(node.elt, names, bound, want, seen)
        return
    if isinstance(node, ast.Name) and node.id in names and node.id not in env:
        if node.id not in seen:
            yield from _find(names[node.id], names, env, want, (*seen, node.id))
        return
    for child in ast.iter_child_nodes(node):
        yield from _find(child, names, env, want, seen)


def _helper(node: ast.AST, names) -> ast.FunctionDef | None:
    """The module-level function `node` calls, if it is a call to one."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        fn = names.get(node.func.id)
        return fn if isinstance(fn, ast.FunctionDef) else None
    return None


def _arguments(fn: ast.FunctionDef, call: ast.Call, names, env: Env) -> Env:
    """`fn`'s parameters bound to the literal arguments of `call` (others left unbound)."""
    given = dict(zip((a.arg for a in fn.args.args), call.args, strict=False))
    given |= {k.arg: k.value for k in call.keywords if k.arg}
    out: dict[str, object] = {}
    for name, node in given.items():
        try:
            out[name] = _value(node, names, env)
        except _Unreadable:
            continue
    return out


def _bindings(generators: list[ast.comprehension], names, env: Env) -> list[Env]:
    """Each binding of a comprehension's variables over literal iterables; none when a
    generator iterates something else or filters with ``if``."""
    out: list[Env] = [env]
    for gen in generators:
        if gen.ifs or gen.is_async:
            return []
        try:
            values = _iterated(gen.iter, names, env)
        except _Unreadable:
            return []
        if not isinstance(values, list | tuple | set | frozenset):
            return []
        grown: list[Env] = []
        for bound, value in itertools.product(out, values):
            try:
                grown.append({**bound, **_assign(gen.target, value)})
            except _Unreadable:
                return []
        out = grown
    return out


def _iterated(node: ast.expr, names, env: Env) -> object:
    """What a comprehension iterates: a literal value, or ``combinations(literal, r)``
    (`itertools.combinations`, by that name or as an attribute)."""
    func = node.func if isinstance(node, ast.Call) else None
    if getattr(func, "id", getattr(func, "attr", None)) != "combinations":
        return _value(node, names, env)
    if len(node.args) != 2 or node.keywords:
        raise _Unreadable
    items, r = (_value(a, names, env) for a in node.args)
    if not isinstance(items, list | tuple) or not isinstance(r, int):
        raise _Unreadable
    return list(itertools.combinations(items, r))


def _assign(target: ast.expr, value: object) -> dict[str, object]:
    """The names `target` binds to `value` (a name, or a tuple of names unpacking it)."""
    if isinstance(target, ast.Name):
        return {target.id: value}
    if isinstance(target, ast.Tuple) and isinstance(value, tuple | list):
        if len(target.elts) == len(value):
            out: dict[str, object] = {}
            for t, v in zip(target.elts, value, strict=True):
                out |= _assign(t, v)
            return out
    raise _Unreadable


def _value(node: ast.expr, names, env: Env, seen=()) -> object:
    """A literal value: constants, tuples/lists/sets of them, f-strings, bound names."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        if node.id in names and node.id not in seen:
            return _value(names[node.id], names, env, (*seen, node.id))
        raise _Unreadable
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        items = [_value(e, names, env, seen) for e in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.JoinedStr):
        parts = []
        for part in node.values:
            if isinstance(part, ast.FormattedValue) and part.conversion == -1:
                if part.format_spec is not None:
                    raise _Unreadable
                parts.append(str(_value(part.value, names, env, seen)))
            else:
                parts.append(str(_value(part, names, env, seen)))
        return "".join(parts)
    raise _Unreadable


def _resolve(call: ast.Call, names, env: Env) -> tuple[str, ...] | str:
    """The two strings of a pair marker, or why they cannot be read."""
    try:
        values = tuple(_value(a, names, env) for a in call.args)
    except _Unreadable:
        values = ()
    if len(values) != 2 or call.keywords or not all(isinstance(v, str) for v in values):
        shown = ", ".join(ast.unparse(a) for a in call.args)
        return f"pair({shown}): give exactly two feature ids as literal strings"
    return tuple(str(v) for v in values)


def _pair_marks(fn, names) -> list[tuple[ast.Call, Env]]:
    """The pair marks of one test function: its decorators (pair marks, directly or through a
    module-level name) and the ``marks=`` of the ``pytest.param`` cases of its ``parametrize``
    decorators."""
    found: list[tuple[ast.Call, Env]] = []
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Call) and _is_pair(dec.func, names):
            found.append((dec, {}))
        elif isinstance(dec, ast.Name) and dec.id in names:
            found += _find(names[dec.id], names, {}, _pair_call, (dec.id,))
        elif isinstance(dec, ast.Call) and getattr(dec.func, "attr", None) == "parametrize":
            for value in (*dec.args[1:], *(k.value for k in dec.keywords)):
                for param, env in _find(value, names, {}, _is_param):
                    for kw in param.keywords:
                        if kw.arg == "marks":
                            found += _find(kw.value, names, env, _pair_call)
    return found


def _pair_call(call: ast.Call, names) -> bool:
    """Whether `call` is a pair mark."""
    return _is_pair(call.func, names)
