"""What a pipeline schedule costs when every stage runs the same program in lockstep.

meshtrain pipelines in pure SPMD: all stages run the same program, slot by slot, so a slot
lasts as long as the slowest pass any stage runs in it. The papers' bubble counts slots as if
every pass took one unit; here each pass costs its own work, in units of one chunk's forward:

    FWD 1 · BWD 2 (input and weight gradient) · zb-h1: BWD 1 (input gradient), WGT 1 · idle 0

gpipe's and circular's backward ticks are whole backwards (2). A slot costs the most any stage
spends in it (an all-idle slot costs 0); the step takes the sum over slots, and each stage's
useful work is 3·m·v units (m microbatches through v chunks, forward and whole backward).

Where this departs from the papers: 1f1b's steady state pairs one stage's forward with another
stage's backward in the same slot, so in lockstep each such slot costs a backward (2), and its
bubble is larger than (p−1)/(m+p−1). gpipe runs its forwards together and its backwards
together, so lockstep costs it nothing beyond its closed form; zb-h1's passes all cost one
unit, so its closed form (p−1)/(3m+p−1) holds too.
"""

from __future__ import annotations

import functools

from meshtrain.pipeline import schedules
from meshtrain.pipeline.schedules import BWD, FWD, WGT

# Work of one pass in units of one chunk's forward.
_COSTS = {FWD: 1.0, BWD: 2.0, WGT: 1.0}
_ZB_COSTS = {FWD: 1.0, BWD: 1.0, WGT: 1.0}


def pass_costs(schedule: str) -> dict[int, float]:
    """Work of each phase of `schedule` in units of one chunk's forward (idle costs nothing).

    Args:
        schedule: a name from `meshtrain.pipeline.schedules.SCHEDULES`.

    Returns:
        ``{FWD: 1, BWD: 2, WGT: 1}``, or for zb-h1 (backward split in two) ``{FWD: 1,
        BWD: 1, WGT: 1}``.
    """
    return dict(_ZB_COSTS if schedule == "zb-h1" else _COSTS)


def lockstep_time(table: schedules.ScheduleTable) -> float:
    """Units of work a step takes when every slot lasts as long as its slowest stage's pass.

    Args:
        table: the schedule's table (`meshtrain.pipeline.schedules.schedule_table`).

    Returns:
        Σ over slots of the largest pass cost in that slot (see `pass_costs`).
    """
    costs = pass_costs(table.schedule)
    total = 0.0
    for row in table.phase:
        total += max((costs.get(int(ph), 0.0) for ph in row), default=0.0)
    return total


def lockstep_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The bubble fraction of `schedule` when its stages run in lockstep (SPMD).

    A slot lasts its slowest stage's pass, so 1f1b's slots that pair one stage's forward with
    another's backward cost a backward each (see the module docstring).

    Args:
        schedule: the schedule's name.
        p: pipeline stages.
        m: microbatches per step.
        v: chunks per stage (circular and interleaved-1f1b; 1 for the others).

    Returns:
        1 − useful / time, with useful = 3·m·v units per stage and time = `lockstep_time`.

    Raises:
        ValueError: the schedule has no table for (p, m, v), or its table does not give
            every stage 3·m·v units of work.
    """
    v = _chunks(schedule, v)
    table = _table(schedules.schedule_table, schedule, p, m, v)
    useful = 3.0 * m * v
    costs = pass_costs(schedule)
    for s in range(p):
        work = sum(costs.get(int(ph), 0.0) for ph in table.phase[:, s])
        if work != useful:
            raise ValueError(
                f"schedule={schedule!r}: its table gives stage {s} {work:g} units of work, not "
                f"3·m·v = {useful:g} (p={p}, m={m}, v={v}); the table does not run every "
                "microbatch's forward, backward and weight gradient once"
            )
    return 1.0 - useful / lockstep_time(table)


def held_microbatches(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Activation memory a stage holds at its peak, in microbatches of the whole stage's
    activations.

    The table's ``in_flight()`` counts (microbatch, chunk) pairs whose forward ran and whose
    last backward pass (the weight gradient in zb-h1) did not yet; a chunk is 1/v of the
    stage, so the stage holds in_flight / v microbatches' worth: m for gpipe and circular
    (every forward before any backward), p for 1f1b.

    Args:
        schedule, p, m, v: as for `lockstep_bubble`.

    Returns:
        Microbatches' worth of the stage's activations held at once.
    """
    v = _chunks(schedule, v)
    return _table(schedules.schedule_table, schedule, p, m, v).in_flight() / v


def _chunks(schedule: str, v: int) -> int:
    """Chunks per stage: `v` for the chunked schedules (circular, interleaved-1f1b), else 1."""
    return v if schedule in schedules.CHUNKED else 1


@functools.lru_cache(maxsize=256)
def _table(build, schedule: str, p: int, m: int, v: int) -> schedules.ScheduleTable:
    """`build(schedule, p, m, v)`, kept: a planner asks for the same few tables many times."""
    return build(schedule, p, m, v)
