"""Run and checkpoint directories: which one a run writes to, what must hold before it does,
and opening the checkpoint directory.

A *run* is a directory holding ``metrics.jsonl`` or committed checkpoint steps (directly, or
in its ``checkpoints/``). A fresh run never writes into, inside or around an earlier one:
`directory_problems` finds each such case before anything compiles.
"""

from __future__ import annotations

import os
from pathlib import Path

from meshtrain.checkpoint.manager import CheckpointConfig, CheckpointManager
from meshtrain.metrics import METRICS_FILE
from meshtrain.problem import Problem, raise_if

_SEARCH_DEPTH = 3  # how deep below a directory to look for earlier runs
_SEARCH_LIMIT = 2000  # directories visited at most in that search


def checkpoint_directory(config: CheckpointConfig | None, run_dir: str) -> str:
    """The checkpoint directory: ``checkpoint_dir``, else ``<run_dir>/checkpoints``, else ""."""
    if config is None:
        return ""
    return config.checkpoint_dir or (str(Path(run_dir) / "checkpoints") if run_dir else "")


def saved_steps(path: Path) -> list[int]:
    """Committed checkpoint steps directly in `path` (digit-named directories), sorted."""
    try:
        return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and p.is_dir())
    except OSError:
        return []


def holds_run(path: Path) -> bool:
    """Whether `path` is an earlier run: metrics, or checkpoint steps here or in checkpoints/."""
    return (
        (path / METRICS_FILE).is_file()
        or bool(saved_steps(path))
        or bool(saved_steps(path / "checkpoints"))
    )


def _run_above(path: Path) -> Path | None:
    """The nearest strict ancestor of `path` that holds a run, or None."""
    for parent in path.absolute().parents:
        if parent.is_dir() and holds_run(parent):
            return parent
    return None


def _run_below(path: Path, skip: set[Path]) -> Path | None:
    """A run strictly below `path` (a bounded search), other than those in `skip`."""
    if not path.is_dir():
        return None
    frontier, visited = [path], 0
    for _ in range(_SEARCH_DEPTH):
        nxt = []
        for d in frontier:
            try:
                children = [c for c in d.iterdir() if c.is_dir() and not c.is_symlink()]
            except OSError:
                continue
            for c in children:
                visited += 1
                if visited > _SEARCH_LIMIT:
                    return None
                if c.absolute() not in skip and holds_run(c):
                    return c
                nxt.append(c)
        frontier = nxt
    return None


def _writable(field: str, path: Path) -> Problem | None:
    """A problem when `path` is a file, or cannot be written or created."""
    flag = f"--{field.split('.')[-1].replace('_', '-')}"
    if path.exists() and not path.is_dir():
        return Problem(field, str(path), f"is a file, not a directory; give {flag} a directory")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return Problem(field, str(path), f"{probe} is a file, so it cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == path else f"cannot be created: {probe} is not writable"
        return Problem(field, str(path), f"{what}; choose a directory you can write to")
    return None


def directory_problems(*, run_dir: str, checkpoint: CheckpointConfig | None) -> list[Problem]:
    """What is wrong with where a run would write, before anything compiles.

    Args:
        run_dir: the run directory (metrics.jsonl; ``checkpoints/`` by default); "" for none.
        checkpoint: the checkpoint settings; None when the run keeps no checkpoints.

    Returns:
        A `Problem` for a directory that is a file or not writable, for checkpoints with no
        directory, for a fresh run into a checkpoint directory that already holds steps, and
        for a fresh run inside, or around, an earlier run.
    """
    ckpt = checkpoint_directory(checkpoint, run_dir)
    if checkpoint is not None and not ckpt:
        return [
            Problem(
                "checkpoint.checkpoint_dir",
                "",
                "checkpoints need a directory, but run_dir is empty too; set --run-dir or "
                "--checkpoint-dir, or turn checkpoints off (--no-save)",
            )
        ]
    dirs = [
        (f, Path(p))
        for f, p in (("train.run_dir", run_dir), ("checkpoint.checkpoint_dir", ckpt))
        if p
    ]
    problems = [p for p in (_writable(f, d) for f, d in dirs) if p]
    if problems:
        return problems[:1] if not checkpoint or not checkpoint.checkpoint_dir else problems
    steps = saved_steps(Path(ckpt)) if ckpt else []
    if steps and checkpoint.resume:
        return []  # continuing that run
    if steps:
        return [
            Problem(
                "checkpoint.checkpoint_dir",
                str(Path(ckpt).absolute()),
                f"already holds steps {steps}; pass --resume to continue that run, or choose "
                "another --run-dir / --checkpoint-dir",
            )
        ]
    # A fresh start: nothing may be written inside, at or around an earlier run.
    own = {Path(p).absolute() for _, p in dirs} | {Path(run_dir).absolute() / "checkpoints"}
    for field, path in dirs:
        if field == "checkpoint.checkpoint_dir" and (path / METRICS_FILE).is_file():
            return [
                Problem(
                    field,
                    str(path),
                    "is an earlier run's directory (it holds metrics.jsonl); give the "
                    "checkpoints a directory of their own",
                )
            ]
        above = _run_above(path)
        if above is not None and above.absolute() not in own:
            return [
                Problem(
                    field,
                    str(path),
                    f"is inside the earlier run {above}; choose a directory outside it "
                    "(or --resume that run with --run-dir pointing at it)",
                )
            ]
        below = _run_below(path, own)
        if below is not None:
            return [
                Problem(
                    field,
                    str(path),
                    f"contains the earlier run {below}; choose a new or empty directory",
                )
            ]
    return []


def open_for_run(config: CheckpointConfig | None, run_dir: str) -> CheckpointManager | None:
    """Opens a run's checkpoint directory for writing, after `directory_problems`.

    Returns:
        The manager, or None when `config` is None.

    Raises:
        RunCheckError: the directory cannot be used (see `directory_problems`).
    """
    if config is None:
        return None
    raise_if(directory_problems(run_dir=run_dir, checkpoint=config))
    return CheckpointManager(checkpoint_directory(config, run_dir), config)
