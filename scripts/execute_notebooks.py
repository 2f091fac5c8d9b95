"""Executes the notebooks in place, so the docs site renders their outputs.

Each notebook runs top to bottom in a fresh python3 kernel started from this interpreter, in
the repository root, without ``XLA_FLAGS`` (the notebook's own ``mt.simulate_devices`` sets
the device count), exactly as ``tests/test_notebooks.py`` runs them. The saved outputs are
what a reader sees on the notebook's page; the test checks they are complete and clean.
Paths under the repository are saved relative to it (the kernel's working directory), so
the outputs do not depend on where the repository was checked out.

    python scripts/execute_notebooks.py                    # every notebook
    python scripts/execute_notebooks.py notebooks/07_moe.ipynb
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def execute(path: Path) -> float:
    """Runs `path` in place; returns the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    client = NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    start = time.perf_counter()
    client.execute(env=env)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # the runner's timings change on every run
        for out in cell.get("outputs", []):
            _relative(out)
    nbformat.write(nb, path)
    return time.perf_counter() - start


def _relative(out) -> None:
    """Rewrites the repository's absolute path in one output to a relative one, in place."""
    root = str(ROOT) + os.sep
    if "text" in out:
        out["text"] = out["text"].replace(root, "")
    for kind, value in out.get("data", {}).items():
        if kind.startswith("text/") and isinstance(value, str):
            out["data"][kind] = value.replace(root, "")


def main(argv: list[str] | None = None) -> int:
    """Executes the notebooks named (default: all of notebooks/)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path)
    paths = parser.parse_args(argv).paths or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        print(f"{path.name}: {execute(path):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
