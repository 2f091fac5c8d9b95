"""``meshtrain launch``: N local processes on loopback, the CPU stand-in for ``srun`` or a JobSet.

    meshtrain launch --nproc 2 --devices-per-proc 4 -- train --mesh data=2,fsdp=2,tensor=2
    meshtrain launch --nproc 2 -- python my_script.py   # calls mt.distributed.initialize()

Each process gets ``MESHTRAIN_COORDINATOR=127.0.0.1:<free port>``, ``MESHTRAIN_NUM_PROCESSES``,
``MESHTRAIN_PROCESS_ID`` and ``K`` simulated CPU devices. Their output is streamed line by
line with ``[p0]``, ``[p1]``, ... prefixes. The first process to fail decides the exit status,
and the others are stopped at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from meshtrain.distributed import free_port, port_is_free
from meshtrain.mesh import with_device_count

# Arguments after "--" that name a meshtrain subcommand run as ``python -m meshtrain.cli ...``.
SUBCOMMANDS = ("train",)
DEFAULT_DEVICES = 8  # simulated devices in all when neither --devices-per-proc nor --devices


def option_value(args: list[str], flag: str) -> str | None:
    """The value of ``--flag V`` or ``--flag=V`` in `args`, else None."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def plan(settings) -> tuple[list[str], int]:
    """The per-process command and the devices each process simulates.

    Args:
        settings: a `meshtrain.cli.launch.LaunchSettings` (nproc, devices_per_proc, port,
            command).

    Raises:
        ValueError: a bad process count, device count, port or command.
    """
    command = list(settings.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("launch: no command; e.g. meshtrain launch --nproc 2 -- train")
    if settings.nproc < 1:
        raise ValueError(f"launch --nproc {settings.nproc}: must be ≥ 1")
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


def _env(rank: int, nproc: int, port: int, devices: int, heartbeat: int | None) -> dict:
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


def _pump(rank: int, stream, lock: threading.Lock) -> None:
    """Copies `stream` to stdout line by line, prefixed with ``[p<rank>]``."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            sys.stdout.write(f"[p{rank}] {line}\n")
            sys.stdout.flush()
    stream.close()


def _describe(code: int) -> str:
    """Describes an exit status: "exit code 3" or "killed by SIGKILL"."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every live process group, then SIGKILL after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while wait and time.monotonic() < deadline and any(p.poll() is None for p in live):
            time.sleep(0.05)
    for p in procs:
        p.wait()


def run(settings) -> int:
    """Runs ``meshtrain launch``; returns the exit status (0, or the first failure's).

    Args:
        settings: a `meshtrain.cli.launch.LaunchSettings`.

    Raises:
        ValueError: see `plan`; before any process starts.
    """
    opts = settings
    command, devices = plan(settings)
    port = opts.port or free_port()
    say = lambda msg: print(f"[launch] {msg}", flush=True)  # noqa: E731
    say(
        f"{opts.nproc} processes × {devices} CPU devices · coordinator 127.0.0.1:{port} · "
        f"{' '.join(command)}"
    )
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps = []
    status = 0
    try:
        for rank in range(opts.nproc):
            p = subprocess.Popen(
                command,
                env=_env(rank, opts.nproc, port, devices, opts.heartbeat_timeout),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so a stop reaches its children
            )
            procs.append(p)
            t = threading.Thread(target=_pump, args=(rank, p.stdout, lock), daemon=True)
            t.start()
            pumps.append(t)
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                pumps[rank].join(timeout=2)  # its last lines first, then the verdict
                others = [r for r, c in enumerate(codes) if c is None]
                say(
                    f"process {rank} failed ({_describe(code)})"
                    + (f"; stopping process(es) {', '.join(map(str, others))}" if others else "")
                )
                _stop(procs, opts.grace)
                status = code if code > 0 else 128 - code
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        say("interrupted; stopping all processes")
        _stop(procs, opts.grace)
        status = 130
    for t in pumps:
        t.join(timeout=5)
    if status == 0:
        say(f"all {opts.nproc} processes finished")
    return status
