"""What a training process tells the launcher that supervises it, one JSON line per event.

``meshtrain launch`` sets ``MESHTRAIN_EVENTS`` to a file; each process appends to it:

- ``start``: the run is built and (on a restart) resumed: its ``step`` and ``run_dir``
  (process 0);
- ``first_step``: the first step of this start is done (process 0);
- ``hang``: the watchdog found no step done in time: ``stacks`` names the dump (any process);
- ``stop``: a SIGTERM/SIGINT was agreed on: this process saved ``step`` and exits 0 (every
  process);
- ``stacks``: the process wrote its stacks because the launcher or another process's watchdog
  asked (`dump_request`), after that process hung.

Without ``MESHTRAIN_EVENTS`` nothing is written. `read` returns the events written so far.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

EVENTS_VAR = "MESHTRAIN_EVENTS"
RESTART_VAR = "MESHTRAIN_RESTART"  # how many times the launcher has restarted the job


def restart_count() -> int:
    """How many times ``meshtrain launch`` has restarted this job (0: the first start)."""
    raw = os.environ.get(RESTART_VAR, "0")
    return int(raw) if raw.isdigit() else 0


def dump_request(events_file: str | None = None) -> str:
    """The file whose existence asks every process for its stacks, beside `events_file`
    (default: ``MESHTRAIN_EVENTS``; "" when there is none)."""
    path = events_file or os.environ.get(EVENTS_VAR)
    return f"{path}.dump" if path else ""


def report(event: str, **fields) -> None:
    """Appends ``{"event": event, "time": ..., "pid": ..., **fields}`` to the events file."""
    path = os.environ.get(EVENTS_VAR)
    if not path:
        return
    line = json.dumps({"event": event, "time": time.time(), "pid": os.getpid(), **fields})
    # One write of one line in append mode: lines of several processes never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def read(path: str | Path, skip: int = 0) -> list[dict]:
    """The events in `path` after the first `skip` complete lines (none if it is absent)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # a last line without its newline is still being written
    return [json.loads(line) for line in lines[skip:] if line.strip()]
