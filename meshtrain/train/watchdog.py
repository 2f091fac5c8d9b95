"""The hang watchdog: a process that stops completing steps while alive is ended, so that
its launcher can restart the job.

A thread watches the time since the last completed step. Once it exceeds
``max(factor × the median step time, floor_s)``, the watchdog writes every thread's Python
stack to ``<run_dir>/hangs/`` (stderr without a run directory), reports a ``hang`` event and
exits the process with status `HANG_EXIT`. It arms only after the first step (which
compiles), and a `suspended` block (the first evaluation, which compiles too) is not timed.
A watchdog that fires asks the job's other processes for their stacks
(`meshtrain.train.events.dump_request`; the launcher asks too) and waits up to `PEER_WAIT_S`
for them before it exits: a hang's cause may be a peer, and process 0's exit can end its
peers' distributed runtime before the launcher's request reaches them. A process asked writes
its stacks there too, and goes on.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

from meshtrain.train import events

HANG_EXIT = 124  # the status of a process ended by the watchdog (as timeout(1) uses)
PEER_WAIT_S = 3.0  # how long a watchdog that fired waits for the other processes' stacks
_WINDOW = 64  # step times the median is taken over


class Watchdog:
    """Ends this process when no step completes for ``max(factor × median, floor_s)`` s.

    Args:
        factor: how many median step times without a step count as a hang.
        floor_s: the least time that counts as a hang; 0 turns the watchdog off.
        run_dir: where ``hangs/p<rank>-step<N>.txt`` goes; empty: stderr.
        rank: this process's index in its job.
        processes: how many processes the job has (whose stacks a firing watchdog asks for).
        clock: seconds, monotonic (tests pass a fake one).
        exit: called with `HANG_EXIT` once the stacks are written (tests pass a recorder).
    """

    def __init__(
        self,
        factor: float,
        floor_s: float,
        *,
        run_dir: str = "",
        rank: int = 0,
        processes: int = 1,
        clock=time.monotonic,
        exit=os._exit,
    ):
        self.factor, self.floor_s = factor, floor_s
        self.run_dir, self.rank, self.processes = run_dir, rank, processes
        self._clock, self._exit = clock, exit
        self._times: deque[float] = deque(maxlen=_WINDOW)
        self._last: float | None = None  # when the last step completed; None: not armed
        self._step = 0
        self._suspended = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: str | None = None  # the dump's path once the watchdog fired
        self._request = events.dump_request()
        self._answered = False

    @property
    def enabled(self) -> bool:
        """Whether the watchdog watches at all (``floor_s > 0``)."""
        return self.floor_s > 0

    def bound(self) -> float:
        """Seconds without a completed step that count as a hang, from the steps seen so far."""
        median = statistics.median(self._times) if self._times else 0.0
        return max(self.factor * median, self.floor_s)

    def step_done(self, step: int, *, timed: bool = True) -> None:
        """Step `step` completed; `timed` False keeps its duration out of the median (a step
        that also evaluated)."""
        now = self._clock()
        with self._lock:
            if self._last is not None and timed:
                self._times.append(now - self._last)
            self._last, self._step = now, step

    @contextlib.contextmanager
    def suspended(self):
        """Inside this block (say, a first evaluation that compiles) no hang is declared; the
        clock restarts at its end."""
        with self._lock:
            self._suspended += 1
        try:
            yield
        finally:
            with self._lock:
                self._suspended -= 1
                if self._last is not None:
                    self._last = self._clock()

    def check(self) -> bool:
        """Fires (stacks, event, exit) when the bound is exceeded; True if it fired."""
        with self._lock:
            if self._last is None or self._suspended or self.fired:
                return False
            idle, bound, step = self._clock() - self._last, self.bound(), self._step
            if idle <= bound:
                return False
            why = f"no step completed for {idle:.1f} s after step {step} (bound {bound:.1f} s)"
            self.fired = self._dump(why, f"p{self.rank}-step{step}.txt")
        events.report("hang", rank=self.rank, step=step, idle_s=idle, stacks=self.fired)
        self._ask_peers()
        print(
            f"meshtrain: watchdog: process {self.rank} completed no step for {idle:.0f} s "
            f"after step {step} (bound {bound:.0f} s = max({self.factor:g} × median step "
            f"time, {self.floor_s:g} s)); every thread's stack is in {self.fired}; exiting "
            f"with status {HANG_EXIT} so the launcher restarts the job",
            file=sys.stderr,
            flush=True,
        )
        self._exit(HANG_EXIT)
        return True

    def answer_request(self) -> bool:
        """Writes the stacks the launcher asked for, once; True if it did now."""
        if self._answered or not self._request or not os.path.exists(self._request):
            return False
        self._answered = True
        with self._lock:
            step, since = self._step, self._last
        idle = f"{self._clock() - since:.1f} s" if since is not None else "before any step"
        why = f"asked after another process hung ({idle} since step {step})"
        path = self._dump(why, f"p{self.rank}-step{step}-asked.txt")
        events.report("stacks", rank=self.rank, step=step, stacks=path)
        return True

    def _ask_peers(self) -> None:
        """Asks the other processes for their stacks; waits up to `PEER_WAIT_S` for them."""
        log = os.environ.get(events.EVENTS_VAR, "")
        if self.processes < 2 or not self._request or not log:
            return
        self._answered = True  # this process's stacks are written already
        Path(self._request).touch()
        others = set(range(self.processes)) - {self.rank}
        deadline = time.monotonic() + PEER_WAIT_S
        while time.monotonic() < deadline:
            answered = {e.get("rank") for e in events.read(log) if e.get("event") == "stacks"}
            if others <= answered:
                return
            time.sleep(0.05)

    def _dump(self, why: str, name: str) -> str:
        """Writes every thread's stack to ``<run_dir>/hangs/<name>`` (or stderr); returns
        where."""
        header = f"process {self.rank}: {why}\n\n"
        if not self.run_dir:
            sys.stderr.write(header)
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            return "stderr"
        path = Path(self.run_dir) / "hangs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(header)
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        return str(path)

    def _watch(self) -> None:
        """The thread: checks a few times per bound until stopped."""
        while not self._done.wait(min(1.0, max(0.05, self.floor_s / 10))):
            self.answer_request()
            if self.check():
                return

    def __enter__(self) -> Watchdog:
        if self.enabled:
            self._thread = threading.Thread(target=self._watch, name="meshtrain-watchdog")
            self._thread.daemon = True
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
