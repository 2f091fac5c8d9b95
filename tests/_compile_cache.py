"""The suite's shared compilation cache: one directory that jax's persistent compilation cache
writes every compiled program to, read by every process of a suite run (the xdist workers, the
CLI runs, the notebook kernels, the launched multi-process jobs, the benchmark scripts) and by
the next run on the same machine.

conftest.py calls `configure` before jax is imported. It sets jax's own environment variables
(``JAX_COMPILATION_CACHE_DIR``, and a minimum compile time and entry size of zero, so the
suite's many small programs are kept too); child processes inherit them with the rest of the
environment, so a program one process compiled is read from disk by the next that compiles
the same program. jax keys an entry by the program with its debug information stripped (so a
clone in another folder reads the same entries), the jaxlib version, the XLA flags (the
simulated device count excluded) and the compile options: a changed program is a new key, and
a stale or foreign entry is never read.

The directory is kept between runs, ``$XDG_CACHE_HOME/meshtrain/test-xla-cache`` (else
``~/.cache/...``), pruned to `MAX_BYTES` (oldest entries first) by each run's first process.
``MESHTRAIN_TEST_CACHE`` names another directory, ``run`` for one of the run's own (under
``build/jax-cache``, removed when the run ends: the cold run of a fresh machine), or ``off``
for none. Programs that jaxlib 0.12's CPU client cannot read back are never written
(`_cache_guard`); `configure` puts ``tests/_site`` on ``PYTHONPATH`` so that the run's other
Python processes keep them out too.
"""

import atexit
import os
import shutil
from pathlib import Path

import _cache_guard

VARIABLE = "MESHTRAIN_TEST_CACHE"
RUNS = Path(__file__).resolve().parents[1] / "build" / "jax-cache"
SITE = Path(__file__).resolve().parent / "_site"  # its sitecustomize installs `_cache_guard`
MAX_BYTES = 4 << 30  # a whole suite run writes about 130 MiB: room for many versions
KEEP = 0.6  # pruning keeps this share of MAX_BYTES, the newest entries
AT_START: dict = {}  # what the cache held when the run's first process started: `contents`


def kept() -> Path:
    """The directory kept between runs when ``MESHTRAIN_TEST_CACHE`` names none."""
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(home) / "meshtrain" / "test-xla-cache"


def directory() -> Path | None:
    """The cache directory this process uses: the one ``MESHTRAIN_TEST_CACHE`` names (the run's
    first process sets it for the others), this process's own run directory for ``run``, None
    for ``off``, else the `kept` one."""
    value = os.environ.get(VARIABLE, "")
    if value.lower() == "off":
        return None
    if value.lower() == "run":
        return RUNS / f"run-{os.getpid()}"
    return Path(value) if value else kept()


def configure() -> Path | None:
    """Points jax (of this process and its children) at the run's cache and guards what it
    writes (`_cache_guard`); in the run's first process, prunes a kept directory or makes the
    run's own (removed at exit). Call before jax is imported."""
    path = directory()
    if path is None:
        return None
    value = os.environ.get(VARIABLE, "")
    if not value or value.lower() == "run":  # this process picks the run's directory
        remove_ended_runs(RUNS)
        os.environ[VARIABLE] = str(path)  # the xdist workers and child processes inherit it
        if path.parent == RUNS:
            atexit.register(shutil.rmtree, path, True)
    path.mkdir(parents=True, exist_ok=True)
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the run's controller
        if path.parent != RUNS:
            prune(path)  # a directory kept between runs
        AT_START.update(contents(path))
    _cache_guard.install()
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p != str(SITE)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, entries)])
    os.environ.update(
        {
            "JAX_COMPILATION_CACHE_DIR": str(path),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        }
    )
    return path


def contents(path: Path) -> dict:
    """The programs (entries) a cache directory holds and their bytes."""
    sizes = []
    for entry in path.glob("*-cache"):
        try:
            sizes.append(entry.stat().st_size)
        except FileNotFoundError:  # another process removed it
            continue
    return {"programs": len(sizes), "bytes": sum(sizes)}


def remove_ended_runs(runs: Path) -> list[Path]:
    """Removes what runs that have ended left under `runs` (a killed run's directory, entries of
    an older layout); a running run's directory stays. Returns what it removed."""
    removed = []
    for entry in runs.iterdir() if runs.is_dir() else []:
        pid = entry.name.removeprefix("run-")
        if entry.is_dir() and pid.isdigit() and _alive(int(pid)):
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    """Whether process `pid` runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True


def prune(path: Path, max_bytes: int = MAX_BYTES) -> int:
    """Deletes the oldest entries of `path` until at most `KEEP` of `max_bytes` remain, when
    the directory holds more than `max_bytes`; returns the bytes deleted."""
    entries = []
    for entry in path.iterdir():
        try:
            st = entry.stat()
        except FileNotFoundError:  # another process removed it
            continue
        if entry.is_file():
            entries.append((st.st_mtime, st.st_size, entry))
    total = sum(size for _, size, _ in entries)
    if total <= max_bytes:
        return 0
    deleted = 0
    for _, size, entry in sorted(entries, key=lambda e: e[0]):
        if total - deleted <= KEEP * max_bytes:
            break
        entry.unlink(missing_ok=True)
        deleted += size
    return deleted
