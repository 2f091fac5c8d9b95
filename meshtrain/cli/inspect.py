"""``meshtrain inspect [train flags] [--json]``: compile the step a ``meshtrain train`` with the
same flags would run, and print what it communicates (nothing runs, nothing is allocated)."""

from __future__ import annotations

import dataclasses

from meshtrain.cli import configfile, parsing, train

__all__ = ["InspectJob", "main", "parse", "run"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class InspectJob(train.TrainJob):
    """Compile the step that meshtrain train with the same flags would run, and print the
    collectives it communicates, their bytes and the modelled time (nothing runs).

    Args:
        json: print one JSON line instead of the table.
    """

    json: bool = False


def run(job: InspectJob, given: frozenset[str] = frozenset()) -> int:
    """Inspects the step of a parsed job; prints a table (or one JSON line)."""
    from meshtrain.comm.inspector import inspect
    from meshtrain.hf import finetune
    from meshtrain.layout import rules_for
    from meshtrain.mesh import make_mesh, simulate_devices

    train.check(job, given)
    job = finetune.resolve(job, given)  # --init-from: the checkpoint's model
    if job.devices:
        simulate_devices(job.devices)
    mesh = make_mesh(job.mesh)
    rules = rules_for(job.strategy, mesh, context_parallel=job.context_parallel)
    report = inspect(train.run_spec(job, job.data, mesh, rules))
    if job.json:
        print(report.to_json())
    else:
        report.print()
    return 0


def parse(argv: list[str]) -> InspectJob:
    """The job the words after ``meshtrain inspect`` give (``--config`` expanded)."""
    return train.parse(argv, InspectJob, "inspect")


def main(argv: list[str]) -> int:
    """``meshtrain inspect ARGV``: parses the train flags (and ``--json``), inspects."""
    file = configfile.read(argv, InspectJob)
    argv = file.argv if file else argv
    with configfile.relabelled(file):  # a value of the file is refused as the file's
        return run(parse(argv), parsing.given(argv, InspectJob))
