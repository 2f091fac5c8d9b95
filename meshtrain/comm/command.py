"""``meshtrain inspect [train flags] [--json]``: compile the step a ``meshtrain train`` with the
same flags would run, and print what it communicates (nothing runs, nothing is allocated)."""

from __future__ import annotations

import sys


def run(job, as_json: bool = False) -> int:
    """Inspects the step of a parsed `TrainJob`; prints a table (or one JSON line)."""
    from meshtrain.comm.inspector import inspect
    from meshtrain.layout import rules_for
    from meshtrain.mesh import make_mesh, simulate_devices
    from meshtrain.run import RunSpec

    if job.devices:
        simulate_devices(job.devices)
    mesh = make_mesh(job.mesh)
    run = RunSpec(
        model=job.model_config(),
        data=job.data,
        mesh=mesh,
        rules=rules_for(job.strategy, mesh),
        train=job.train,
        optim=job.optim,
        pipeline=job.pipeline,
        sync=job.sync,
    )
    report = inspect(run)
    if as_json:
        print(report.to_json())
    else:
        report.print()
    return 0


if __name__ == "__main__":
    from meshtrain.cli import main

    sys.exit(main(["inspect", *sys.argv[1:]]))
