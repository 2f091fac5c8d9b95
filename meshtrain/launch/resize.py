"""Re-deriving a `meshtrain train` job for fewer processes: the batch axes shrink (data
first, then fsdp) and gradient accumulation grows by the same factor, so the global batch,
each microbatch's rows per device and the model's own axes (pipe, expert, seq, tensor) stay
as they were."""

from __future__ import annotations

import math
from fractions import Fraction

from meshtrain.mesh import AXES, DATA, FSDP, MeshConfig


class CannotResize(ValueError):
    """The job has no layout on fewer processes that keeps its global batch."""


def _per_replica_state(sync) -> str:
    """What the replicas' own state holds under `sync` ("" when nothing)."""
    if sync.local:
        scheme = "gossip" if sync.gossips else "federated" if sync.federates else "local SGD"
        return f"each replica's parameters and inner optimizer state ({scheme})"
    if sync.keeps_residual:
        return "error-feedback residuals (gradient compression)"
    if sync.staleness:
        return "the gradients still in flight (staleness)"
    return ""


def shrink(sizes: dict[str, int], factor: int) -> dict[str, int] | None:
    """`sizes` with data × fsdp divided by `factor`, data first; None when it cannot be."""
    take_data = math.gcd(sizes[DATA], factor)
    rest = factor // take_data
    if sizes[FSDP] % rest:
        return None
    return {**sizes, DATA: sizes[DATA] // take_data, FSDP: sizes[FSDP] // rest}


def resized(job, nproc: int, to: int, devices: int) -> tuple[str, int]:
    """The mesh and accumulation steps of `job` on `to` processes instead of `nproc`.

    Args:
        job: the `meshtrain.cli.train.TrainJob` the processes run.
        nproc: the processes it was laid out for.
        to: the processes left.
        devices: devices per process.

    Returns:
        (mesh, accum_steps): e.g. ("data=1,fsdp=2,tensor=2", 2).

    Raises:
        CannotResize: the devices lost are not a whole factor of data × fsdp, the global
            batch does not split into the larger number of microbatches, or the run keeps
            state per replica (local SGD, error feedback, staleness).
    """
    ratio = Fraction(nproc, to)
    if ratio.denominator != 1:
        raise CannotResize(f"{nproc} → {to} processes is not a whole factor")
    kept = _per_replica_state(job.sync)
    if kept:
        raise CannotResize(
            f"the run keeps {kept}, one slice per data-parallel replica, and fewer devices "
            "mean fewer replicas: no rule says how their slices merge (resume it on the same "
            "mesh, or start it without that setting)"
        )
    before = MeshConfig.parse(job.mesh).sizes(nproc * devices)
    factor = ratio.numerator
    after = shrink(before, factor)
    if after is None:
        raise CannotResize(
            f"mesh {job.mesh}: data × fsdp = {before[DATA]} × {before[FSDP]} cannot shrink by "
            f"{factor} (only the batch axes shrink)"
        )
    accum = job.train.accum_steps * factor
    rows = job.data.batch_size
    split = after[DATA] * after[FSDP] * accum
    if rows % split:
        raise CannotResize(
            f"global batch {rows} does not split into {accum} microbatches over "
            f"data × fsdp = {after[DATA] * after[FSDP]}"
        )
    mesh = ",".join(f"{a}={after[a]}" for a in AXES if after[a] != 1) or "data=1"
    return mesh, accum


def main(argv: list[str] | None = None) -> int:
    """Prints the flags that move a ``meshtrain train`` job to fewer processes (for schedulers
    that start the processes themselves, such as SLURM):

        python -m meshtrain.launch.resize --nproc 4 --to 3 --devices-per-proc 8 -- FLAGS

    prints e.g. ``--mesh data=3,fsdp=8 --accum-steps 4``, to append to ``train FLAGS``.
    A job that cannot move is one line on stderr and exit code 2.
    """
    import argparse
    import shlex
    import sys

    from meshtrain import cli

    parser = argparse.ArgumentParser(
        prog="python -m meshtrain.launch.resize", description=main.__doc__.splitlines()[0]
    )
    parser.add_argument("--nproc", type=int, required=True, help="processes the job ran on")
    parser.add_argument("--to", type=int, required=True, help="processes left")
    parser.add_argument("--devices-per-proc", type=int, required=True, help="devices each")
    parser.add_argument("train", nargs=argparse.REMAINDER, help="-- then the train flags")
    args = parser.parse_args(argv)
    flags = args.train[1:] if args.train[:1] == ["--"] else args.train
    for name in ("nproc", "to", "devices_per_proc"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be ≥ 1")
    if args.to > args.nproc:
        parser.error(f"--to {args.to}: more than --nproc {args.nproc}; only shrinking is planned")
    try:
        job = cli.parse(["train", *flags])
        mesh, accum = resized(job, args.nproc, args.to, args.devices_per_proc)
    except (ValueError, SystemExit) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(shlex.join(["--mesh", mesh, "--accum-steps", str(accum)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
