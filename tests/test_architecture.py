"""The layers of the architecture picture (docs/contributing/architecture.md) hold: each
module imports meshtrain modules of its own layer or below, never above. A new import that
breaks a seam (say, `state` reaching up into `train`) fails here."""

import ast
import pathlib

import meshtrain

ROOT = pathlib.Path(meshtrain.__file__).parent
KERNELS = ROOT.parent / "kernels"

# Lowest first; the "Architecture" page's picture, bottom to top.
LAYERS = [
    [
        "meshtrain._compat",
        "meshtrain._tree",
        "meshtrain._units",
        "meshtrain._log",
        "meshtrain._switch",
        "meshtrain.problem",
        "meshtrain.validate",
        "meshtrain.filevalues",
        "meshtrain.mesh",
    ],
    ["meshtrain.layout"],
    ["meshtrain.kernels", "meshtrain.context_parallel", "meshtrain.precision"],
    [
        "meshtrain.models",
        "meshtrain.state",
        "meshtrain.data",
        "meshtrain.metrics",
        "meshtrain.distributed",
        "meshtrain.loss",
        "meshtrain.optim",
    ],  # fmt: skip
    # The cost model reads pipeline schedule tables (the lockstep bubble).
    [
        "meshtrain.pipeline",
        "meshtrain.checkpoint",
        "meshtrain.replicas",
        "meshtrain.offload",
        "meshtrain.costmodel",
    ],
    [
        "meshtrain.train",
        "meshtrain.run",
        "meshtrain.check",
        "meshtrain.composition",
        "meshtrain.effect",
    ],
    [
        "meshtrain.lower",
        "meshtrain.hf",
        "meshtrain.launch",
        "meshtrain.cli",
        "meshtrain.generate",
        "meshtrain.comm",
        "meshtrain.plan",
        "meshtrain.fit",
        "meshtrain",
    ],  # fmt: skip
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _unit(module: str) -> str:
    """The layer entry a module belongs to (its package, or itself)."""
    while module not in RANK:
        module = module.rpartition(".")[0]
    return module


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        yield ".".join(p for p in parts if p != "__init__") or "meshtrain", path
    for path in sorted(KERNELS.glob("*.py")):
        name = "meshtrain.kernels" + ("" if path.stem == "__init__" else f".{path.stem}")
        yield name, path


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "meshtrain":  # `from meshtrain import x` imports x alone
                yield node.module
            for alias in node.names:
                yield f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def test_every_module_sits_in_a_layer():
    for name, _ in _modules():
        assert _unit(name) in RANK, f"{name}: add it to LAYERS (and to the architecture picture)"


def test_no_module_imports_from_a_layer_above_its_own():
    wrong = []
    for name, path in _modules():
        mine = RANK[_unit(name)]
        for target in _imports(path):
            if not target.startswith("meshtrain") or target == "meshtrain.kernels._common":
                continue
            try:
                theirs = RANK[_unit(target)]
            except KeyError:
                continue  # a name imported from a module, checked through the module itself
            if theirs > mine:
                wrong.append(f"{name} (layer {mine}) imports {target} (layer {theirs})")
    assert not wrong, "\n".join(sorted(set(wrong)))


def _package(module: str) -> str:
    """The package (or top-level module) of meshtrain a module belongs to."""
    return ".".join(module.split(".")[:2])


def test_no_package_reaches_itself_through_the_imports_of_others():
    """Layers allow imports within a layer; this forbids a ring of them (``run`` importing
    ``train`` importing ``run``), which would leave no order to read or load them in."""
    graph: dict[str, set[str]] = {}
    for name, path in _modules():
        for target in _imports(path):
            if target.startswith("meshtrain.") and _package(target) != _package(name):
                graph.setdefault(_package(name), set()).add(_package(target))
    rings = []
    for start in sorted(graph):
        path_to = {nxt: [start, nxt] for nxt in graph[start]}
        todo = list(path_to)
        while todo:
            here = todo.pop()
            for nxt in graph.get(here, ()):
                if nxt not in path_to:
                    path_to[nxt] = [*path_to[here], nxt]
                    todo.append(nxt)
        if start in path_to:
            rings.append(" → ".join(path_to[start]))
    assert not rings, "import cycles between packages:\n" + "\n".join(rings)


# The sizes a reader can hold: outside the kernels no function over LONGEST lines and at most
# MOST_LONG over LONG; no module over MODULE lines anywhere.
LONGEST, LONG, MOST_LONG, MODULE = 120, 80, 5, 600


def _function_lengths():
    for name, path in _modules():
        if _unit(name) == "meshtrain.kernels":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield f"{name}.{node.name}", node.end_lineno - node.lineno + 1


def test_functions_outside_the_kernels_stay_short():
    lengths = sorted(_function_lengths(), key=lambda item: -item[1])
    too_long = [f"{n}: {k} lines" for n, k in lengths if k > LONGEST]
    assert not too_long, f"over {LONGEST} lines; split into named stages: {too_long}"
    long = [f"{n}: {k} lines" for n, k in lengths if k > LONG]
    assert len(long) <= MOST_LONG, f"more than {MOST_LONG} functions over {LONG} lines: {long}"


def test_no_module_is_longer_than_a_reader_can_hold():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules()}
    over = {name: n for name, n in sizes.items() if n > MODULE}
    assert not over, f"modules over {MODULE} lines; split them by role: {over}"


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and its functions."""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }


def _path_operands(node: ast.AST) -> list[ast.expr]:
    """The values `node` would use as a path: both sides of ``/``, a call's arguments, and a
    function's defaults."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return [node.left, node.right]
    if isinstance(node, ast.Call):
        return [*node.args, *(k.value for k in node.keywords)]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        return [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
    return []


def _reaches_tests(path: pathlib.Path, suite: set[str]) -> list[str]:
    """What in one module imports from the test suite or names a path in it: an import of
    `tests` or of a module of the suite (`suite`), a string holding ``tests/``, or ``"tests"``
    joined to a path, passed to a call or given as a default (docstrings aside)."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] in suite]
            found += [(line, f"imports {name}") for name in names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in suite:
                found.append((line, f"imports from {node.module}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docs and ("tests/" in node.value or "tests\\" in node.value):
                found.append((line, f"names the path {node.value!r}"))
        if any(isinstance(o, ast.Constant) and o.value == "tests" for o in _path_operands(node)):
            found.append((line, 'uses "tests" as a path'))
    return [f"{path.relative_to(ROOT.parent)}:{n}: {what}" for n, what in found]


def test_the_package_reads_nothing_of_the_test_suite():
    """An installed wheel has no tests/: no module of meshtrain/ or kernels/ imports from the
    suite (tests, conftest, tests/_*.py) or opens a path under it."""
    tests = ROOT.parent / "tests"
    suite = {"tests", *(p.stem for p in tests.glob("*.py"))}  # conftest, _helpers, ...
    wrong = [line for _, path in _modules() for line in _reaches_tests(path, suite)]
    assert not wrong, "\n".join(wrong)


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists packages by hand: a new one left out installs everywhere but from
    the editable checkout (the GPU bundle and the lowest-versions venv import a wheel)."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"][
            "packages"
        ]
    )
    found = {
        ".".join(("meshtrain", *p.parent.relative_to(ROOT).parts))
        for p in ROOT.rglob("__init__.py")
    }
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
