"""Keeps out of the suite's compilation cache the programs jaxlib 0.12's CPU client cannot read
back: those with an all-reduce (or another collective that is not a collective permute) inside
a conditional's branch, and those with any collective compiled with XLA's
concurrency-optimised CPU scheduler on.

Executables read back from jax's persistent cache crash where the same program compiled afresh
runs (measured 2026-11-29 with jaxlib 0.12.0.1): one that all-reduces inside a ``lax.cond``
branch at its first execution that takes the branch (a segmentation fault in the in-process
all-reduce; local SGD's synchronising step), and one with collectives scheduled by the
concurrency-optimised scheduler now and then (an abort or a segmentation fault; the
expert-parallel MoE layer in 7 of 10 read-backs, the pipelined MoE step). With
``--xla_cpu_enable_concurrency_optimized_scheduler=false`` (in the suite's ``XLA_FLAGS``) only
the first kind crashed. Collective permutes inside branches (every pipeline schedule sends
activations that way) read back and ran: the 40 such programs of the pipeline, offload and
replica files, in two read-back runs. So every process of a suite run writes to the cache only
executables whose optimised HLO reaches no collective other than a collective permute from a
conditional's branches, and has no collective at all unless the process runs with that flag:
the rest is compiled afresh each time it is needed.

`install` wraps jax's cache writer when `jax._src.compiler` is imported (or at once when it
already is). conftest.py installs it in the test processes; the run's other Python processes
(the CLI runs, notebook kernels, launched jobs, benchmark scripts) get it from
``tests/_site/sitecustomize.py``, which `_compile_cache.configure` puts on ``PYTHONPATH``.
"""

import importlib.abc
import importlib.util
import os
import re
import sys

COMPILER = "jax._src.compiler"
SCHEDULER_OFF = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
_COLLECTIVE = re.compile(
    r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|collective-permute"
    r"|collective-broadcast)(-start)?\("
)
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
_CALLED = re.compile(
    r"(?:calls|to_apply|body|condition|true_computation|false_computation|branch_computations"
    r"|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)


def branch_collectives(hlo: str) -> list[str]:
    """The conditionals' branch computations of the HLO module text `hlo` from which a
    collective other than a collective permute is reachable (empty when none)."""
    calls: dict[str, set[str]] = {}
    has_collective: set[str] = set()
    branches: set[str] = set()
    current = None
    for line in hlo.splitlines():
        if current is None:
            if header := _HEADER.match(line):
                current = header.group(1)
                calls[current] = set()
            continue
        if line.startswith("}"):
            current = None
            continue
        called = {
            name.strip().lstrip("%")
            for group in _CALLED.findall(line)
            for name in group.strip("{}").split(",")
        }
        calls[current] |= called
        if " conditional(" in line:
            branches |= {n for n in called if n}
        if any(m.group(1) != "collective-permute" for m in _COLLECTIVE.finditer(line)):
            has_collective.add(current)
    return sorted(b for b in branches if _reaches(b, calls, has_collective))


def _reaches(name: str, calls: dict[str, set[str]], targets: set[str]) -> bool:
    """Whether computation `name` or one it calls (transitively) is in `targets`."""
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n in targets:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(calls.get(n, ()))
    return False


def cacheable(executable) -> bool:
    """Whether the compiled `executable` may be written to the cache: no collective but
    collective permutes in a conditional's branches, and none at all unless this process's
    ``XLA_FLAGS`` switch the concurrency-optimised scheduler off."""
    scheduler_off = SCHEDULER_OFF in os.environ.get("XLA_FLAGS", "").split()
    for module in executable.hlo_modules():
        hlo = module.to_string()
        if branch_collectives(hlo) or (not scheduler_off and _COLLECTIVE.search(hlo)):
            return False
    return True


def _patch(compiler) -> None:
    """Wraps `compiler._cache_write` so that it skips executables that are not `cacheable`
    (a jax without that function is left as it is)."""
    write = getattr(compiler, "_cache_write", None)
    if write is None or getattr(write, "_meshtrain_guard", False):
        return

    def guarded(cache_key, compile_time_secs, module_name, backend, executable, *rest):
        if cacheable(executable):
            write(cache_key, compile_time_secs, module_name, backend, executable, *rest)

    guarded._meshtrain_guard = True
    compiler._cache_write = guarded


class _OnImport(importlib.abc.MetaPathFinder):
    """Patches jax's compiler module right after it is first imported."""

    def find_spec(self, name, path, target=None):
        if name != COMPILER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Guards this process's cache writes: now if jax's compiler is imported, else at its
    import."""
    if COMPILER in sys.modules:
        _patch(sys.modules[COMPILER])
    elif not any(isinstance(f, _OnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnImport())
