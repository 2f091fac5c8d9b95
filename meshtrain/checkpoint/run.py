"""What a training run needs around its checkpoints: opening the directory, the save schedule,
the metadata, the NaN/Inf stop, and SIGTERM/SIGINT handling."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshtrain.checkpoint.manager import CheckpointConfig, CheckpointManager
from meshtrain.checkpoint.targets import mesh_meta


def open_for_run(config: CheckpointConfig | None, run_dir: str) -> CheckpointManager | None:
    """Opens a run's checkpoint directory for writing, before anything compiles.

    Returns:
        The manager, or None when `config` is None.

    Raises:
        ValueError: no directory is set, or it already holds checkpoints and the run does not
            resume (a fresh run never writes over an earlier one).
    """
    if config is None:
        return None
    directory = config.checkpoint_dir or (str(Path(run_dir) / "checkpoints") if run_dir else "")
    if not directory:
        raise ValueError(
            "checkpoint_dir='' and run_dir='': checkpoints need a directory; set one of them"
        )
    mgr = CheckpointManager(directory, config)
    steps = mgr.steps()
    if steps and not config.resume:
        mgr.close()
        raise ValueError(
            f"checkpoint directory {mgr.directory} already holds steps {steps}; pass "
            "--resume (CheckpointConfig(resume=True)) to continue that run, or choose another "
            "--run-dir / --checkpoint-dir"
        )
    return mgr


def due(config: CheckpointConfig, step: int, end: int) -> bool:
    """True when the periodic schedule saves after step `step` (the final step saves anyway)."""
    return bool(config.save_every) and step % config.save_every == 0 and step < end


def run_meta(trainer: Any, extra: Mapping | None = None) -> dict:
    """The JSON facts a trainer's checkpoint records: configs, mesh, rules, seed."""

    def as_dict(cfg):
        return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None

    model = trainer.model_config
    return {
        "config": {
            "model": {"kind": type(model).__name__, **(as_dict(model) or {})} if model else None,
            "train": as_dict(trainer.config),
            "optim": as_dict(trainer.optim),
            "checkpoint": as_dict(trainer.checkpoints.config) if trainer.checkpoints else None,
            **dict(extra or {}),
        },
        "mesh": mesh_meta(trainer.mesh),
        "rules": trainer.rules.name,
        "rng": {"seed": trainer.config.seed},
    }


class NonFiniteError(RuntimeError):
    """Training stopped: too many consecutive steps had a non-finite loss or gradient."""

    @classmethod
    def after(
        cls, streak: int, step: int, last_good: int, checkpoints: CheckpointManager | None
    ) -> NonFiniteError:
        """The error for `streak` bad steps ending at `step`; names the last good checkpoint."""
        where = "no checkpoints are kept"
        if checkpoints is not None:
            checkpoints.wait()
            good = [s for s in checkpoints.steps() if s <= last_good]
            where = (
                f"last good checkpoint: {checkpoints.path(good[-1])} (step {good[-1]})"
                if good
                else f"no checkpoint at or before step {last_good} in {checkpoints.directory}"
            )
        return cls(
            f"{streak} consecutive steps ({step - streak + 1}–{step}) had a non-finite loss or "
            f"gradient; their updates were skipped and training stopped after step {step}; "
            f"{where}"
        )


class StopSignals:
    """Turns the first SIGTERM/SIGINT into a request to stop after the current step.

    Inside the ``with`` block, the first signal sets `received` (its name); a second one
    exits the process at once with status 128 + signal number. Outside the main thread
    (where Python cannot install handlers) it does nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        """Records the first signal; a second one exits immediately."""
        if self.received is not None:
            print(f"meshtrain: second {signal.Signals(signum).name}: exiting now", flush=True)
            os._exit(128 + signum)
        self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
