"""Faults the resilience tests inject into the processes `meshtrain launch` starts.

On ``PYTHONPATH``, Python imports this module at start-up in every process. It acts only in
a launched process (``MESHTRAIN_PROCESS_ID`` set):

- ``FAULT_GONE_RANK=r`` and ``FAULT_GONE_MARKER=path``: once `path` exists, process `r` exits
  with status 1 as it starts, as if its host were gone;
- SIGUSR1 makes the process hang where its main thread is: it stays alive and stops stepping.
"""

import os
import signal
import time

RANK = os.environ.get("MESHTRAIN_PROCESS_ID")


def _hang(signum, frame):
    print("fault: hanging now", flush=True)
    while True:
        time.sleep(3600)


if RANK is not None:
    marker = os.environ.get("FAULT_GONE_MARKER", "")
    if os.environ.get("FAULT_GONE_RANK") == RANK and marker and os.path.exists(marker):
        print(f"fault: the host of process {RANK} is gone", flush=True)
        os._exit(1)
    signal.signal(signal.SIGUSR1, _hang)
