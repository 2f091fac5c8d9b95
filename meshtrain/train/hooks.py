"""What the training loop does around its steps: the save schedule, the stop after too many
non-finite steps, and SIGTERM/SIGINT handling."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable

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

    Inside the ``with`` block, the first signal sets `received` (its name) and starts the
    `at_first` callbacks; a second one exits the process at once with status 128 + signal
    number. A thread watches for signals through `signal.set_wakeup_fd`, so both happen even
    while the main thread waits inside a computation that never returns (Python runs its own
    handlers only between the main thread's bytecodes). Outside the main thread (where Python
    cannot install handlers) it does nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}
        self._first: list[Callable[[str], None]] = []
        self._wakeup: tuple[socket.socket, socket.socket, int] | None = None
        self._thread: threading.Thread | None = None

    def at_first(self, callback: Callable[[str], None]) -> None:
        """Calls ``callback(name)`` in a thread of its own when the first signal arrives."""
        self._first.append(callback)

    def _handle(self, signum, frame) -> None:
        """Records the first signal (the watching thread exits on a second one)."""
        if self.received is None:
            self.received = signal.Signals(signum).name

    def _watch(self, reader: socket.socket) -> None:
        """The thread: starts the callbacks on the first signal, exits on the second."""
        seen = 0
        while data := reader.recv(64):
            for signum in data:
                if signum not in self.SIGNALS:
                    continue
                seen += 1
                name = signal.Signals(signum).name
                if seen > 1:
                    print(f"meshtrain: second {name}: exiting now", flush=True)
                    os._exit(128 + signum)
                for callback in self._first:
                    threading.Thread(target=callback, args=(name,), daemon=True).start()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            before = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._wakeup = (reader, writer, before)
            self._thread = threading.Thread(
                target=self._watch, args=(reader,), name="meshtrain-signals", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._wakeup is not None:
            reader, writer, before = self._wakeup
            signal.set_wakeup_fd(before)
            writer.close()  # the thread reads what is left, then the end
            if self._thread is not None:
                self._thread.join(timeout=5)
            reader.close()
            self._wakeup = self._thread = None
