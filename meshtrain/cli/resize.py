"""``python -m meshtrain.cli.resize``: the flags that move a ``meshtrain train`` job to fewer
processes (`meshtrain.launch.resize.resized`), for schedulers that start the processes
themselves, such as SLURM. Not a subcommand: ``meshtrain launch --min-nproc`` applies the same
rule itself."""

from __future__ import annotations

import argparse
import shlex
import sys

from meshtrain import cli
from meshtrain.launch.resize import resized


def main(argv: list[str] | None = None) -> int:
    """Prints the flags that move a ``meshtrain train`` job to fewer processes (for schedulers
    that start the processes themselves, such as SLURM):

        python -m meshtrain.cli.resize --nproc 4 --to 3 --devices-per-proc 8 -- FLAGS

    prints e.g. ``--mesh data=3,fsdp=8 --accum-steps 4``, to append to ``train FLAGS``.
    A job that cannot move is one line on stderr and exit code 2.
    """
    parser = argparse.ArgumentParser(
        prog="python -m meshtrain.cli.resize",
        description="the flags that move a meshtrain train job to fewer processes",
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
