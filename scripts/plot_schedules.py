"""Draws the pipeline schedules' Gantt charts into docs/pipeline_schedules.png.

.venv/bin/python scripts/plot_schedules.py [--p 4] [--m 8] [--out docs/pipeline_schedules.png]
"""

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from meshtrain.pipeline import schedule_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--out", default="docs/pipeline_schedules.png")
    args = parser.parse_args()
    tables = [
        schedule_table("gpipe", args.p, args.m),
        schedule_table("circular", args.p, args.m, 2),
        schedule_table("1f1b", args.p, args.m),
        schedule_table("interleaved-1f1b", args.p, args.m, 2),
        schedule_table("zb-h1", args.p, args.m),
    ]
    fig, axes = plt.subplots(len(tables), 1, figsize=(12, 11), constrained_layout=True)
    for table, ax in zip(tables, axes, strict=True):
        table.plot(ax)
        ax.set_xlim(0, max(t.slots for t in tables))
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
