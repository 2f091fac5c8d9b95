"""One start of a job's processes: each in its own process group, its output streamed line
by line with a ``[p<rank>]`` prefix, and stopped as a group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time


def describe(code: int) -> str:
    """Describes an exit status: "exit code 3" or "killed by SIGKILL"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _pump(rank: int, stream, lock: threading.Lock) -> None:
    """Copies `stream` to stdout line by line, prefixed with ``[p<rank>]``."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            sys.stdout.write(f"[p{rank}] {line}\n")
            sys.stdout.flush()
    stream.close()


class Generation:
    """The processes of one start of the job.

    Args:
        command: what every process runs.
        envs: one environment per process (its rank is its index).
        lock: serialises the output lines of every generation.
    """

    def __init__(self, command: list[str], envs: list[dict], lock: threading.Lock):
        self.procs: list[subprocess.Popen] = []
        self._pumps: list[threading.Thread] = []
        for rank, env in enumerate(envs):
            p = subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so a stop reaches its children
            )
            self.procs.append(p)
            t = threading.Thread(target=_pump, args=(rank, p.stdout, lock), daemon=True)
            t.start()
            self._pumps.append(t)

    def codes(self) -> list[int | None]:
        """Each process's exit status, None while it runs."""
        return [p.poll() for p in self.procs]

    def signal(self, sig: int) -> None:
        """Sends `sig` to every live process group."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, grace: float) -> None:
        """SIGTERM to every live process group, then SIGKILL after `grace` seconds (at once
        with 0)."""
        if grace > 0:
            self.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(c is None for c in self.codes()):
                time.sleep(0.05)
        self.signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def flush(self, rank: int | None = None, timeout: float = 2.0) -> None:
        """Waits for the output of process `rank` (every process: None) to be printed."""
        for r, t in enumerate(self._pumps):
            if rank is None or r == rank:
                t.join(timeout=timeout)
