"""Multi-process runs on JAX's own distributed runtime (`jax.distributed`).

Every process of a job calls `initialize` once, before any jax computation. It connects to
the coordinator (process 0), after which `jax.devices()` lists the devices of every process and
a mesh built by `meshtrain.make_mesh` spans them all. Where the settings come from, in order:

1. the `DistributedConfig` fields given;
2. the environment, as `meshtrain launch` sets it (and as a Kubernetes pod spec can):
   ``MESHTRAIN_COORDINATOR`` (host:port), ``MESHTRAIN_NUM_PROCESSES``,
   ``MESHTRAIN_PROCESS_ID``, ``MESHTRAIN_HEARTBEAT_TIMEOUT``, ``MESHTRAIN_INIT_TIMEOUT``,
   ``MESHTRAIN_SHUTDOWN_TIMEOUT``, ``MESHTRAIN_COLLECTIVE_TIMEOUT``;
3. JAX's cluster auto-detection (SLURM, Open MPI, Kubernetes JobSets, TPU pods).

Failure behaviour: the coordinator tracks a heartbeat from every process. When one process
dies, every other one stops within about ``heartbeat_timeout_s`` with JAX's message
``The following tasks are unhealthy (stopped sending heartbeats): <ids>`` (or, when the dead
one is process 0, ``Failed to send RPC to coordination service``), and a non-zero exit status.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import socket
import sys

import jax

from meshtrain import validate
from meshtrain._compat import jax_distributed_client
from meshtrain.problem import Problem

# XLA's settings of how long a collective may wait for its peers, by backend.
COLLECTIVE_TIMEOUT_FLAGS = (
    "xla_cpu_collective_timeout_seconds",  # gloo's send/receive timeout
    "xla_gpu_nccl_termination_timeout_seconds",  # NCCL: ends a collective stuck this long
)
# Fields that the environment may set, and their variables.
ENV_VARS = {
    "coordinator": "MESHTRAIN_COORDINATOR",
    "num_processes": "MESHTRAIN_NUM_PROCESSES",
    "process_id": "MESHTRAIN_PROCESS_ID",
    "heartbeat_timeout_s": "MESHTRAIN_HEARTBEAT_TIMEOUT",
    "init_timeout_s": "MESHTRAIN_INIT_TIMEOUT",
    "shutdown_timeout_s": "MESHTRAIN_SHUTDOWN_TIMEOUT",
    "collective_timeout_s": "MESHTRAIN_COLLECTIVE_TIMEOUT",
}
MODES = ("auto", "on", "off")
# Task counts of a launched step (srun, mpirun): "auto" joins a job when one is > 1. (Not
# SLURM_NTASKS: an sbatch script itself runs once, in a single process.)
_TASK_COUNT_VARS = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE")


class DistributedError(RuntimeError):
    """The processes of a job could not form one consistent job."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig(validate.Checked):
    """How a process joins a multi-process job. Unset fields come from the environment.

    Args:
        mode: "auto" joins a job when the environment describes one (``MESHTRAIN_*``,
            ``JAX_COORDINATOR_ADDRESS``, or an ``srun`` / ``mpirun`` step of several tasks);
            "on" always calls `jax.distributed.initialize` (JAX auto-detects the cluster);
            "off" runs as a single process.
        coordinator: "host:port" of process 0's coordinator; "" = environment / auto-detect.
        num_processes: processes in the job; 0 = environment / auto-detect.
        process_id: this process's index in [0, num_processes); -1 = environment / auto.
        heartbeat_timeout_s: a process silent this long is declared dead and every other
            process stops (non-zero exit).
        init_timeout_s: how long processes wait for all the others to join.
        shutdown_timeout_s: how long a finished process waits for the others at exit.
        collective_timeout_s: a collective that waits this long for a peer fails (the
            process then exits non-zero, and ``meshtrain launch --max-restarts`` restarts
            the job); sets XLA's ``xla_cpu_collective_timeout_seconds`` (gloo, CPU) and
            ``xla_gpu_nccl_termination_timeout_seconds`` (NCCL, GPU) unless ``XLA_FLAGS``
            already sets them; 0 leaves the backends' own.
    """

    mode: str = "auto"
    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1
    heartbeat_timeout_s: int = 30
    init_timeout_s: int = 120
    shutdown_timeout_s: int = 60
    collective_timeout_s: int = 600

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        v = validate
        problems = v.one_of("dist.mode", self.mode, MODES, example="on")
        if self.coordinator:
            problems += v.check(
                "dist.coordinator",
                self.coordinator,
                _split_address,
                self.coordinator,
                "dist coordinator",
            )
        problems += v.non_negative(
            "dist.num_processes", self.num_processes, example=2, note="0 = from environment"
        )
        problems += v.at_least(
            "dist.process_id", self.process_id, -1, example=0, note="-1 = from environment"
        )
        if v.is_int(self.num_processes) and v.is_int(self.process_id) and self.num_processes:
            problems += v.require(
                self.process_id < self.num_processes,
                "dist.process_id",
                self.process_id,
                f"with num_processes={self.num_processes}: process ids run from 0 to "
                f"{self.num_processes - 1}",
            )
        for name in ("heartbeat_timeout_s", "init_timeout_s", "shutdown_timeout_s"):
            problems += v.positive(
                f"dist.{name}", getattr(self, name), example=60, note="whole seconds"
            )
        return problems + v.non_negative(
            "dist.collective_timeout_s",
            self.collective_timeout_s,
            example=600,
            note="whole seconds; 0 = the backend's own",
        )

    @classmethod
    def from_env(cls, base: DistributedConfig | None = None) -> DistributedConfig:
        """`base` (default: the defaults) with its unset fields filled from ``MESHTRAIN_*``."""
        base = base or cls()
        defaults = cls()
        updates: dict = {}
        for field, var in ENV_VARS.items():
            raw = os.environ.get(var)
            if raw is None or getattr(base, field) != getattr(defaults, field):
                continue
            if field == "coordinator":
                updates[field] = raw
                continue
            try:
                updates[field] = int(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r}: must be an integer") from None
        return dataclasses.replace(base, **updates)

    def wanted(self) -> bool:
        """Whether this process should join a multi-process job."""
        if self.mode != "auto":
            return self.mode == "on"
        cfg = DistributedConfig.from_env(self)
        if cfg.coordinator or cfg.num_processes > 1 or os.environ.get("JAX_COORDINATOR_ADDRESS"):
            return True
        for var in _TASK_COUNT_VARS:
            raw = os.environ.get(var, "")
            if raw.isdigit() and int(raw) > 1:
                return True
        return False


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the job, as `initialize` found it."""

    process_id: int
    num_processes: int
    local_devices: int
    global_devices: int
    platform: str

    def __str__(self) -> str:
        return (
            f"process {self.process_id} of {self.num_processes} · {self.local_devices} local "
            f"{self.platform} devices · {self.global_devices} global devices"
        )


def with_collective_timeout(xla_flags: str, seconds: int) -> str:
    """`xla_flags` with each `COLLECTIVE_TIMEOUT_FLAGS` set to `seconds`, unless already set."""
    flags = xla_flags.split()
    for name in COLLECTIVE_TIMEOUT_FLAGS:
        if not any(f.lstrip("-").startswith(name + "=") for f in flags):
            flags.append(f"--{name}={seconds}")
    return " ".join(flags)


def _split_address(address: str, what: str) -> tuple[str, int]:
    """("host", port) from "host:port", or a ValueError naming `what`."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{what}={address!r}: expected host:port with a port in 1..65535, e.g. 10.0.0.1:12345"
        )
    return host.strip("[]"), int(port)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when `port` can be bound on `host` right now, as a coordinator binds it: with
    ``SO_REUSEADDR``, so a port whose last connection lingers in TIME_WAIT (a coordinator that
    just died, for about a minute) counts as free, and one something listens on does not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (free when this returns)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_local(host: str) -> bool:
    """Whether `host` names this machine (so process 0 will bind the coordinator port here)."""
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname()):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def is_initialized() -> bool:
    """Whether `jax.distributed.initialize` has run in this process."""
    return bool(jax.distributed.is_initialized())


def _supported_kwargs(kwargs: dict) -> dict:
    """The subset of `kwargs` that this jax's `jax.distributed.initialize` accepts."""
    params = inspect.signature(jax.distributed.initialize).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _check_counts(config: DistributedConfig) -> None:
    """Fails on every process when the processes were told different process counts."""
    actual, me, told = jax.process_count(), jax.process_index(), config.num_processes
    client = jax_distributed_client()
    client.key_value_set(f"meshtrain/num_processes/{me}", str(told or actual))
    if not told or told == actual:
        timeout_ms = config.init_timeout_s * 1000
        seen = {
            i: int(client.blocking_key_value_get(f"meshtrain/num_processes/{i}", timeout_ms))
            for i in range(actual)
        }
    else:
        seen = {me: told}
    wrong = {i: n for i, n in seen.items() if n != actual}
    if wrong:
        told_text = ", ".join(f"process {i} was told {n}" for i, n in wrong.items())
        raise DistributedError(
            f"mismatched process counts: {actual} processes joined coordinator "
            f"{config.coordinator or '(auto-detected)'}, but {told_text}; start every process "
            "with the same MESHTRAIN_NUM_PROCESSES / --dist.num-processes"
        )


def initialize(config: DistributedConfig | None = None, *, verbose: bool = True) -> ProcessInfo:
    """Joins this process to a multi-process job on `jax.distributed`.

    Call it once per process, first thing (after `meshtrain.simulate_devices` when simulating
    CPU devices), before any jax computation. Calling it again returns the same information.

    Args:
        config: explicit settings; unset fields come from ``MESHTRAIN_*`` variables, then
            from JAX's cluster auto-detection (SLURM, Open MPI, Kubernetes).
        verbose: print one line per process: its id, local and global device counts.

    Returns:
        This process's `ProcessInfo`.

    Raises:
        ValueError: a setting is malformed, or process 0's coordinator port is taken.
        DistributedError: the processes disagree on the process count, or the job could not form.
    """
    cfg = DistributedConfig.from_env(config)
    if not is_initialized():
        if cfg.num_processes and cfg.process_id < 0:
            raise ValueError(
                f"dist num_processes={cfg.num_processes} but no process_id: set "
                "MESHTRAIN_PROCESS_ID (or --dist.process-id) on every process"
            )
        if cfg.coordinator and cfg.process_id == 0:
            host, port = _split_address(cfg.coordinator, "dist coordinator")
            if _is_local(host) and not port_is_free(port):
                raise ValueError(
                    f"dist coordinator={cfg.coordinator}: port {port} is already in use on "
                    "this machine; choose a free port (meshtrain launch picks one itself)"
                )
        if cfg.collective_timeout_s:
            os.environ["XLA_FLAGS"] = with_collective_timeout(
                os.environ.get("XLA_FLAGS", ""), cfg.collective_timeout_s
            )
        # CPU devices exchange collectives over TCP with gloo; GPUs and TPUs ignore this.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        kwargs = _supported_kwargs(
            dict(
                coordinator_address=cfg.coordinator or None,
                num_processes=cfg.num_processes or None,
                process_id=None if cfg.process_id < 0 else cfg.process_id,
                initialization_timeout=cfg.init_timeout_s,
                heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
                shutdown_timeout_seconds=cfg.shutdown_timeout_s,
            )
        )
        if cfg.coordinator and cfg.num_processes and cfg.process_id >= 0:
            # All given: no cluster detection, which would also narrow each process to one
            # GPU (from SLURM_LOCALID and the like); each process keeps all its devices.
            kwargs.update(_supported_kwargs({"cluster_detection_method": "deactivate"}))
        if verbose and cfg.num_processes:
            print(
                f"meshtrain: process {cfg.process_id} of {cfg.num_processes} joining "
                f"{cfg.coordinator or 'the auto-detected coordinator'}; all processes must "
                f"join within {cfg.init_timeout_s} s",
                file=sys.stderr,
                flush=True,
            )
        try:
            jax.distributed.initialize(**kwargs)
        except ValueError as e:  # JAX found no cluster and was given too little to go on
            raise ValueError(
                f"jax.distributed could not start: {e}. Give MESHTRAIN_COORDINATOR, "
                "MESHTRAIN_NUM_PROCESSES and MESHTRAIN_PROCESS_ID (or --dist.* flags), or run "
                "under SLURM / Open MPI / a Kubernetes JobSet"
            ) from None
        _check_counts(cfg)
    local = jax.local_devices()
    info = ProcessInfo(
        process_id=jax.process_index(),
        num_processes=jax.process_count(),
        local_devices=len(local),
        global_devices=jax.device_count(),
        platform=local[0].platform,
    )
    if verbose:
        print(f"meshtrain: {info}", flush=True)
    return info
