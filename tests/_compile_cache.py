"""The suite's shared compilation cache: one directory that jax's persistent compilation cache
writes every compiled program to, read by every process of a suite run (the xdist workers, the
CLI runs, the notebook kernels, the launched multi-process jobs, the benchmark scripts).

conftest.py calls `configure` before jax is imported. It sets jax's own environment variables
(``JAX_COMPILATION_CACHE_DIR``, and a minimum compile time and entry size of zero, so the
suite's many small programs are kept too); child processes inherit them with the rest of the
environment, so a program one process compiled is read from disk by the next that compiles
the same program. jax keys an entry by the program with its debug information stripped, the
jaxlib version, the XLA flags (the simulated device count excluded) and the compile options,
so a stale or foreign entry is never read: a changed program is a new key.

The directory is the run's own, ``build/jax-cache/run-<pid>`` (the pid of the run's first
process), removed when that process ends; a run that was killed leaves its directory to the
next run, which removes it. It does not persist between runs: jaxlib 0.12's CPU executables
read back from an earlier run's cache crash some programs' steps (a segmentation fault in the
pipelined MoE step of ``tests/test_moe_pipeline.py`` and in local SGD's step of
``tests/test_run.py``, measured 2026-11-28), though a second run would spend about half the
CPU seconds. ``MESHTRAIN_TEST_CACHE`` names a directory to keep between runs anyway (pruned to
`MAX_BYTES`, oldest entries first), or ``off`` for none.
"""

import atexit
import os
import shutil
from pathlib import Path

VARIABLE = "MESHTRAIN_TEST_CACHE"
RUNS = Path(__file__).resolve().parents[1] / "build" / "jax-cache"
MAX_BYTES = 4 << 30  # a whole suite run writes about 170 MiB: room for many versions
KEEP = 0.6  # pruning keeps this share of MAX_BYTES, the newest entries


def directory() -> Path | None:
    """The cache directory this process uses: ``MESHTRAIN_TEST_CACHE`` (set by the run's first
    process for the others), else this process's own run directory; None when it is ``off``."""
    value = os.environ.get(VARIABLE, "")
    if value.lower() == "off":
        return None
    return Path(value) if value else RUNS / f"run-{os.getpid()}"


def configure() -> Path | None:
    """Points jax (of this process and its children) at the run's cache; in the run's first
    process, makes the run's own directory (removed at exit) or prunes a chosen one. Call
    before jax is imported."""
    path = directory()
    if path is None:
        return None
    if VARIABLE not in os.environ:  # the run's first process (the controller): its own cache
        remove_ended_runs(RUNS)
        os.environ[VARIABLE] = str(path)  # the xdist workers inherit it
        atexit.register(shutil.rmtree, path, True)
    path.mkdir(parents=True, exist_ok=True)
    if "PYTEST_XDIST_WORKER" not in os.environ and path.parent != RUNS:
        prune(path)  # a directory kept between runs
    os.environ.update(
        {
            "JAX_COMPILATION_CACHE_DIR": str(path),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        }
    )
    return path


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
