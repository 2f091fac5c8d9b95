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

The directory is ``build/jax-cache`` in the checkout, so it persists between runs on the same
machine (a second run compiles little) and a fresh clone starts empty (CI's case). Between
runs it is pruned to `MAX_BYTES`, oldest entries first. ``MESHTRAIN_TEST_CACHE`` names
another directory, or ``off`` for none.
"""

import os
from pathlib import Path

VARIABLE = "MESHTRAIN_TEST_CACHE"
DEFAULT = Path(__file__).resolve().parents[1] / "build" / "jax-cache"
MAX_BYTES = 4 << 30  # a whole suite run writes about 2 GiB
KEEP = 0.6  # pruning keeps this share of MAX_BYTES, the newest entries


def directory() -> Path | None:
    """The cache directory this run uses, or None when ``MESHTRAIN_TEST_CACHE=off``."""
    value = os.environ.get(VARIABLE, "")
    if value.lower() == "off":
        return None
    return Path(value) if value else DEFAULT


def configure() -> Path | None:
    """Points jax (of this process and its children) at the shared cache; prunes it when this
    is the run's first process. Call before jax is imported."""
    path = directory()
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller (or a run without workers)
        prune(path)
    os.environ.update(
        {
            "JAX_COMPILATION_CACHE_DIR": str(path),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        }
    )
    return path


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
