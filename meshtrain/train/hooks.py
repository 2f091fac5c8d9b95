"""What the training loop does around its steps: the save schedule, the stop after too many
non-finite steps, and SIGTERM/SIGINT handling."""

from __future__ import annotations

import os
import signal
import threading

from meshtrain.checkpoint import CheckpointManager


def save_due(save_every: int, step: int, end: int) -> bool:
    """True when the periodic schedule saves after step `step` (the final step saves anyway)."""
    return bool(save_every) and step % save_every == 0 and step < end


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
