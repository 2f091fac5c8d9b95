"""``meshtrain launch``: N local processes on loopback, the CPU stand-in for ``srun`` or a JobSet.

    meshtrain launch --nproc 2 --devices-per-proc 4 -- train --mesh data=2,fsdp=2,tensor=2
    meshtrain launch --nproc 2 -- python my_script.py   # calls mt.distributed.initialize()
    meshtrain launch --nproc 2 --max-restarts 3 --min-nproc 1 -- train --save-every 50

Each process gets ``MESHTRAIN_COORDINATOR=127.0.0.1:<free port>``, ``MESHTRAIN_NUM_PROCESSES``,
``MESHTRAIN_PROCESS_ID``, ``MESHTRAIN_RESTART`` and ``K`` simulated CPU devices. Their output
is streamed line by line with ``[p0]``, ``[p1]``, ... prefixes. When a process fails, the
others are stopped at once; with ``--max-restarts`` the job then starts again from its newest
checkpoint (`meshtrain.launch.supervise`), on fewer processes if one cannot come back
(``--min-nproc``, `meshtrain.launch.resize`). A SIGTERM to the launcher reaches every process,
and they stop together after one agreed step, which they save.
"""

from __future__ import annotations

import os
import sys

from meshtrain.distributed import port_is_free
from meshtrain.mesh import with_device_count
from meshtrain.validate import is_int, is_number

# Arguments after "--" that name a meshtrain subcommand run as ``python -m meshtrain.cli ...``.
SUBCOMMANDS = ("train",)
DEFAULT_DEVICES = 8  # simulated devices in all when neither --devices-per-proc nor --devices


def option_value(args: list[str], flag: str) -> str | None:
    """The value of ``--flag V`` or ``--flag=V`` in `args` (the last one given), else None."""
    found = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


def _seconds(flag: str, value, example: str) -> None:
    """Raises a one-line ValueError unless `value` is a finite number of seconds ≥ 0."""
    if not (is_number(value) and value >= 0):
        raise ValueError(
            f"launch {flag} {value}: must be ≥ 0 seconds, finite; e.g. {flag} {example}"
        )


def plan(settings) -> tuple[list[str], int]:
    """The per-process command and the devices each process simulates.

    Args:
        settings: a `meshtrain.cli.launch.LaunchSettings`.

    Raises:
        ValueError: a bad process count, device count, port, timing (grace, restart delay,
            heartbeat: finite, in range) or command.
    """
    command = list(settings.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("launch: no command; e.g. meshtrain launch --nproc 2 -- train")
    if settings.nproc < 1:
        raise ValueError(f"launch --nproc {settings.nproc}: must be ≥ 1")
    if settings.max_restarts < 0:
        raise ValueError(f"launch --max-restarts {settings.max_restarts}: must be ≥ 0")
    if not 0 <= settings.min_nproc <= settings.nproc:
        raise ValueError(
            f"launch --min-nproc {settings.min_nproc}: must be between 1 and --nproc "
            f"{settings.nproc} (0: never fewer processes)"
        )
    if settings.min_nproc and settings.min_nproc < settings.nproc and not settings.max_restarts:
        raise ValueError(
            f"launch --min-nproc {settings.min_nproc} needs restarts: a job resizes when it "
            "restarts; add --max-restarts N"
        )
    _seconds("--grace", settings.grace, "5")
    _seconds("--restart-delay", settings.restart_delay, "1")
    beat = settings.heartbeat_timeout
    if beat is not None and not (is_int(beat) and beat >= 1):
        raise ValueError(
            f"launch --heartbeat-timeout {beat}: must be a whole number of seconds ≥ 1; e.g. "
            "--heartbeat-timeout 30 (or leave it out: the job's --dist.heartbeat-timeout-s)"
        )
    if settings.port and not 0 < settings.port < 65536:
        raise ValueError(f"launch --port {settings.port}: must be in 1..65535")
    if settings.port and not port_is_free(settings.port):
        raise ValueError(
            f"launch --port {settings.port}: the port is already in use on 127.0.0.1; choose "
            "another, or leave --port out to pick a free one"
        )
    if command[0] in SUBCOMMANDS:
        given = option_value(command, "--devices")
        k = settings.devices_per_proc
        if given is not None:
            if k is not None and str(k) != given:
                raise ValueError(
                    f"launch --devices-per-proc {k} and train --devices {given} disagree; "
                    "give one of them"
                )
            if not given.isdigit():
                raise ValueError(f"train --devices {given!r}: must be a whole number")
            k = int(given)
        if k is None:
            k = max(1, DEFAULT_DEVICES // settings.nproc)
        if given is None:
            command = [command[0], "--devices", str(k), *command[1:]]
        command = [sys.executable, "-m", "meshtrain.cli", *command]
    else:
        k = settings.devices_per_proc or max(1, DEFAULT_DEVICES // settings.nproc)
    if k < 1:
        raise ValueError(f"launch --devices-per-proc {k}: must be ≥ 1")
    return command, k


def process_env(rank: int, nproc: int, port: int, devices: int, heartbeat: int | None) -> dict:
    """The environment of process `rank`."""
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=with_device_count(env.get("XLA_FLAGS", ""), devices),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        MESHTRAIN_COORDINATOR=f"127.0.0.1:{port}",
        MESHTRAIN_NUM_PROCESSES=str(nproc),
        MESHTRAIN_PROCESS_ID=str(rank),
    )
    if heartbeat is not None:
        env["MESHTRAIN_HEARTBEAT_TIMEOUT"] = str(heartbeat)
    return env


def run(settings, read_job=None, check_job=None) -> int:
    """Runs ``meshtrain launch``; returns the exit status (0, or the failure's).

    Args:
        settings: a `meshtrain.cli.launch.LaunchSettings`.
        read_job: reads a train command's words into its job, for resizing (see
            `meshtrain.launch.supervise.Supervisor`).
        check_job: ``check_job(words, nproc)`` checks a train command's words (those after
            ``train``, as each process gets them) before any process starts; raises
            ValueError (`meshtrain.cli.launch.check_job`).

    Raises:
        ValueError: see `plan` and `check_job`; before any process starts.
    """
    from meshtrain.launch.supervise import Supervisor

    command, devices = plan(settings)
    if check_job is not None and command[1:4] == ["-m", "meshtrain.cli", "train"]:
        check_job(command[4:], settings.nproc)
    return Supervisor(settings, command, devices, read_job).run()
