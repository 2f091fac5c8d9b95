"""``meshtrain launch``: N local processes on loopback, the CPU stand-in for ``srun`` or a JobSet.

meshtrain launch --nproc 2 --devices-per-proc 4 -- train --mesh data=2,fsdp=2,tensor=2
meshtrain launch --nproc 2 -- python my_script.py   # calls mt.distributed.initialize()
meshtrain launch --nproc 2 --max-restarts 3 --min-nproc 1 -- train --save-every 20
"""

from __future__ import annotations

import dataclasses

import tyro

from meshtrain.cli import parsing
from meshtrain.cli.errors import UsageError

__all__ = ["LaunchSettings", "check_job", "main", "parse", "run", "split"]

EXAMPLE = "meshtrain launch --nproc 2 --devices-per-proc 4 -- train --steps 50"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchSettings:
    """Start N local processes of one jax.distributed job on 127.0.0.1: meshtrain launch
    [flags] -- COMMAND, where COMMAND is "train [train flags]" or any program (e.g. "python
    my_script.py") that calls meshtrain.distributed.initialize().

    Args:
        nproc: processes to start.
        devices_per_proc: simulated CPU devices per process (default: 8 // nproc, or
            train's --devices).
        port: coordinator port (0: a free one).
        heartbeat_timeout: seconds before a silent process is declared dead
            (MESHTRAIN_HEARTBEAT_TIMEOUT).
        grace: seconds between SIGTERM and SIGKILL on failure (without restarts).
        max_restarts: restart the job this many times after a process fails or hangs, from
            its newest checkpoint (a train command resumes by itself; another program
            reads MESHTRAIN_RESTART); 0: a failure ends the job.
        min_nproc: when a process fails this many starts in a row (its host is gone),
            continue on fewer processes, down to this many (a train job's data, then fsdp,
            axis shrinks and its accumulation grows, keeping the global batch); 0: never
            fewer than --nproc.
        restart_delay: seconds between stopping the processes and starting them again.
        command: what each process runs (the words after --).
    """

    nproc: int
    devices_per_proc: int | None = None
    port: int = 0
    heartbeat_timeout: int | None = None
    grace: float = 5.0
    max_restarts: int = 0
    min_nproc: int = 0
    restart_delay: float = 1.0
    command: tyro.conf.Suppress[tuple[str, ...]] = ()


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher flags, command): the command starts after ``--``, or at the first word that
    is neither a flag nor a flag's value."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 1 if "=" in argv[i] or argv[i] in ("-h", "--help") else 2
    return argv[:i], argv[i:]


def parse(argv: list[str]) -> LaunchSettings:
    """The settings the words after ``meshtrain launch`` give."""
    flags, command = split(list(argv))
    settings = parsing.parse("launch", LaunchSettings, flags, example=EXAMPLE)
    return dataclasses.replace(settings, command=tuple(command))


def run(settings: LaunchSettings) -> int:
    """Checks the launcher's settings and a train job's, then starts the processes and waits
    for them; returns the first failure's status, or 0."""
    from meshtrain import launch
    from meshtrain.cli.train import parse as read_job

    return launch.run(settings, read_job, check_job=check_job)


def check_job(words: list[str], nproc: int) -> None:
    """Parses and checks a train job once, as each of its `nproc` processes will read `words`
    (the words after ``train``, the launcher's ``--devices`` included), before any starts.

    Raises:
        UsageError: one line per mistake, each starting ``train``: a flag tyro cannot read,
            a config's own check, the CLI's checks (`meshtrain.cli.train.check`) and the run
            check (`meshtrain.check.check_run`) on the mesh all the processes make.
    """
    if "-h" in words or "--help" in words:
        return  # the job prints its help
    try:
        _check_train(words, nproc)
    except ValueError as e:  # a UsageError, or a RunCheckError: one problem a line
        raise UsageError("\n".join(f"train {line}" for line in str(e).splitlines())) from None


def _check_train(words: list[str], nproc: int) -> None:
    """`check_job`'s work: what ``meshtrain train`` checks before compiling, on the abstract
    model (nothing is allocated) and the axis sizes of the whole job's mesh."""
    from meshtrain.check import check_run
    from meshtrain.cli import train
    from meshtrain.data import make_dataset
    from meshtrain.hf import finetune
    from meshtrain.layout import rules_for
    from meshtrain.mesh import MeshConfig, host_layout, simulate_devices
    from meshtrain.problem import raise_if
    from meshtrain.state import abstract_model

    argv = train.config_flags(words)
    given = parsing.given(argv, train.TrainJob)
    job = train.parse(argv)
    train.check(job, given)
    simulate_devices(1)  # the launcher's own jax on the CPU, as its processes' (no GPU held)
    job = finetune.resolve(job, given)
    job = train._fresh_default_run_dir(job, lambda *_: None)  # as each process will
    sizes = MeshConfig.parse(job.mesh).sizes(nproc * job.devices)
    host_layout(sizes, nproc, job.devices)  # the axes across processes split evenly
    rules = rules_for(job.strategy, sizes, context_parallel=job.context_parallel)
    saves = job.save and bool(job.train.run_dir or job.checkpoint.checkpoint_dir)
    spec = train.run_spec(
        job, make_dataset(job.data), sizes, rules, checkpoint=job.checkpoint if saves else None
    )
    ctor, problems = spec.constructor()
    raise_if(problems + check_run(spec, abstract=abstract_model(ctor)))


def main(argv: list[str]) -> int:
    """``meshtrain launch ARGV``."""
    return run(parse(argv))
