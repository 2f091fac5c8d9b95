"""Where `prepare_corpus` may write, decided before anything is read, written or deleted.

A corpus goes into a new or empty directory, or over an earlier corpus of the same input
files (a rerun refreshes it, or finds it up to date). A directory holding another corpus or
other files takes one only with ``overwrite=True``. A training run's directory, and a
directory inside the inputs (a rerun would read the corpus back as input), never do.
"""

from __future__ import annotations

import os

from meshtrain.metrics.writers import METRICS_FILE
from meshtrain.problem import Problem


def destination_problems(
    out_dir: str,
    inputs: list[str],
    files: list[str],
    *,
    written: tuple[str, ...],
    earlier_inputs: list[str] | None,
    overwrite: bool = False,
) -> list[Problem]:
    """Why `out_dir` cannot take the corpus of `files` (empty when it can).

    Args:
        out_dir: the output directory.
        inputs: the inputs as given (files or directories).
        files: the input files they expand to.
        written: the names prepare writes in `out_dir` (and their ``.tmp`` forms).
        earlier_inputs: the input files of the corpus already in `out_dir` (from its
            manifest), or None when it holds none.
        overwrite: allow a directory holding another corpus or other files.

    Returns:
        One problem filed under ``out_dir``, naming the fix; none when the corpus can go there.
    """
    out = os.path.realpath(out_dir)
    if os.path.exists(out) and not os.path.isdir(out):
        return _refused(out_dir, "is a file; give a new or empty directory")
    for path in inputs:
        real = os.path.realpath(path)
        if os.path.isdir(real) and (out == real or out.startswith(real + os.sep)):
            return _refused(
                out_dir,
                f"lies inside the input {path!r}, so a rerun would read the corpus back as "
                "input; give an output directory outside the inputs",
            )
    ours = set(written) | {name + ".tmp" for name in written}
    for path in files:
        real = os.path.realpath(path)
        if os.path.dirname(real) == out and os.path.basename(real) in ours:
            return _refused(
                out_dir,
                f"the input {path!r} is a file prepare writes here; give an output directory "
                "that holds no inputs",
            )
    entries = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if not entries:
        return []
    if _holds_run(out):
        return _refused(
            out_dir,
            "holds a training run (metrics or checkpoints); give a new or empty directory "
            "for the corpus",
        )
    if earlier_inputs is not None:
        if _same_files(earlier_inputs, files) or overwrite:
            return []
        first = earlier_inputs[0] if earlier_inputs else "nothing"
        return _refused(
            out_dir,
            f"holds another corpus (of {len(earlier_inputs)} input file(s), e.g. {first!r}); "
            "give a new or empty directory, or overwrite=True (--overwrite) to replace it",
        )
    others = [name for name in entries if name not in ours]
    if others and not overwrite:
        more = f" and {len(others) - 1} more" if len(others) > 1 else ""
        return _refused(
            out_dir,
            f"is not empty (it holds {others[0]!r}{more}); give a new or empty directory, or "
            "overwrite=True (--overwrite) to write the corpus beside them",
        )
    return []


def _refused(out_dir: str, message: str) -> list[Problem]:
    """The one problem of a destination, filed under ``out_dir``."""
    return [Problem("out_dir", out_dir, message)]


def _holds_run(directory: str) -> bool:
    """Whether `directory` holds a training run: metrics, checkpoints/, or checkpoint steps."""
    if os.path.isfile(os.path.join(directory, METRICS_FILE)):
        return True
    if os.path.isdir(os.path.join(directory, "checkpoints")):
        return True
    return any(
        name.isdigit() and os.path.isdir(os.path.join(directory, name))
        for name in os.listdir(directory)
    )


def _same_files(a: list[str], b: list[str]) -> bool:
    """Whether two lists of paths name the same files (in any order)."""
    return sorted(os.path.realpath(p) for p in a) == sorted(os.path.realpath(p) for p in b)
