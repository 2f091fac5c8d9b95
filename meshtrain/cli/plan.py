"""``meshtrain plan``: pick a mesh for a GPT, print the reasoning, optionally write it out.

meshtrain plan --model 1.3b --devices 64 --device h100 --device-memory 80GB
meshtrain plan --model mixtral-8x7b --devices 64 --device h100
meshtrain plan --model tiny --devices 8 --device cpu-sim --device-memory 4MB --write plan.json
meshtrain train --config plan.json --steps 2
meshtrain plan --scaling --plot docs/scaling.png
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from meshtrain import validate
from meshtrain.cli import parsing
from meshtrain.cli.errors import UsageError
from meshtrain.problem import Problem

__all__ = ["PlanSettings", "check", "main", "parse", "run"]

EXAMPLE = "meshtrain plan --model 1.3b --devices 64"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSettings(validate.Checked):
    """Search pipe × data × fsdp × expert × tensor layouts, strategies, remat and microbatches
    for a GPT or a mixture of experts; rank by modelled step time; confirm memory by compiling.

    Args:
        model: a GPT size (tiny, 125m, 350m, 1.3b, 7b) or an MoE preset (moe-tiny,
            mixtral-8x7b).
        dispatch: an MoE's dispatch, capacity or dropless (default: the preset's).
        devices: devices to plan for.
        hosts: hosts (0: the profile's node size).
        device: device profile: h100, h200, gh200, a100, tpu-v5e, cpu-sim.
        device_memory: memory per device, e.g. 80GB (default: the profile's).
        batch: global batch (0: 2 per device).
        seq_len: tokens per sequence (0: the size's).
        dtype: compute dtype (default: bfloat16, float32 on cpu-sim).
        offload: also try host offload (remat residuals, and the optimizer state of a
            layout over the cap) on profiles with a host-link figure.
        gossip: price every layout with gossip over this graph (ring, torus, exponential,
            complete) instead of the gradient's all-reduce; with --sync-every.
        client_fraction: price every layout with federated averaging sampling this share of
            the replicas per round; with --sync-every.
        sync_every: H: the steps between the replicas' means (local SGD alone, or gossip's or
            a federated round's). The planner never picks these itself: they change the
            optimisation, not only the speed.
        top: candidates to print.
        confirm: best candidates to compile.
        write: save the winner as a train config (JSON) for meshtrain train --config.
        overwrite: let --write replace a file that exists.
        json: print JSON instead of a table.
        scaling: project 8 → 1024 devices for 1.3b and 7b (DP, FSDP, the planner's pick).
        plot: with --scaling: save the plot here.
    """

    model: str = "1.3b"
    dispatch: str = ""
    devices: int = 8
    hosts: int = 0
    device: str = "h100"
    device_memory: str = ""
    batch: int = 0
    seq_len: int = 0
    dtype: str = ""
    offload: bool = True
    gossip: str = ""
    client_fraction: float = 0.0
    sync_every: int = 0
    top: int = 5
    confirm: int = 2
    write: str = ""
    overwrite: bool = False
    json: bool = False
    scaling: bool = False
    plot: str = ""

    def problems(self) -> list[Problem]:
        """A federated share that is not a finite number in [0, 1] (0: none priced)."""
        return validate.in_range(
            "client_fraction", self.client_fraction, 0, 1, example=0.1, note="0: none priced"
        )


def check(settings: PlanSettings) -> None:
    """Refuses a ``--write`` that would replace a file or cannot be a file, before planning."""
    if not settings.write:
        return
    path = Path(settings.write)
    if path.is_dir():
        raise UsageError(
            f"--write {settings.write}: a directory; give a file name, e.g. "
            f"--write {path / 'plan.json'}"
        )
    if path.exists() and not settings.overwrite:
        raise UsageError(
            f"--write {settings.write}: the file exists; add --overwrite to replace it, or "
            "choose another name"
        )
    if not path.parent.is_dir():
        raise UsageError(
            f"--write {settings.write}: no directory {path.parent}; create it, or write elsewhere"
        )


def run(settings: PlanSettings) -> int:
    """Plans (or projects, with ``--scaling``) and prints; returns the exit code."""
    from meshtrain.plan import command

    check(settings)
    return command.run(settings)


def parse(argv: list[str]) -> PlanSettings:
    """The settings the words after ``meshtrain plan`` give."""
    return parsing.parse("plan", PlanSettings, argv, example=EXAMPLE)


def main(argv: list[str]) -> int:
    """``meshtrain plan ARGV``."""
    return run(parse(argv))
