"""Pipeline schedules as tables: for every time slot and stage, which microbatch runs, in which
phase, through which chunk of layers.

A *slot* is the time one stage takes to run one microbatch through one chunk of its layers in one
phase: a forward (FWD), a backward (BWD) or, in zb-h1 only, a weight gradient (WGT), each counted
as one unit. In zb-h1 BWD is the input gradient alone, on the critical path, and WGT the weight
gradient of the same microbatch and chunk, which can wait; elsewhere BWD is the whole backward.
Stage s holds the local chunks r = 0 .. v−1, global chunk r·p + s; a stage's output reaches its
neighbour one slot later. Counting slots (all phases alike) gives the bubble fractions the
papers quote, for p stages, m microbatches and v chunks per stage:

    gpipe             all forwards, then all backwards                    (p−1)/(m+p−1)
    circular          gpipe with v chunks per stage, round robin          (p−1)/(v·m+p−1)
    1f1b              after a warm-up, one backward, one forward          (p−1)/(m+p−1)
    interleaved-1f1b  1f1b over v chunks per stage (Megatron-LM's order)  (p−1)/(v·m+p−1)
    zb-h1             1f1b with the weight gradients deferred (Qi et al.) (p−1)/(3m+p−1)

In flight (the most (microbatch, chunk) pairs a stage holds residuals for): m for gpipe, v·m
for circular, p for 1f1b and zb-h1, v·p for interleaved-1f1b (p microbatches' worth of a stage's
activations, each chunk being 1/v of them).

For gpipe and circular the table is what `jax.grad` of the forward loop executes: the forward
ticks, then the same ticks in reverse as backwards. For the others it is the schedule the
hand-written executor runs, slot by slot.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from meshtrain import validate
from meshtrain.problem import Problem, raise_if

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved-1f1b", "zb-h1")
# What a stage does in a slot. BWD is the whole backward, except in zb-h1, which splits it
# into BWD (the input gradient, on the critical path) and WGT (the weight gradient, deferred).
IDLE, FWD, BWD, WGT = 0, 1, 2, 3
# The schedules the hand-written executor (`meshtrain.pipeline.spmd.scheduled`) runs; the
# others are a forward loop that `jax.grad` differentiates.
HAND_SCHEDULED = ("1f1b", "interleaved-1f1b", "zb-h1")
# The schedules that hold several chunks of layers per stage (``repeats`` of them).
CHUNKED = ("circular", "interleaved-1f1b")


def closed_form_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The bubble fraction the literature gives for `schedule` with p stages, m microbatches
    and v chunks per stage, in slots of one chunk's forward, backward or weight-gradient pass:

        gpipe, 1f1b          (p−1)/(m+p−1)
        circular, interleaved-1f1b   (p−1)/(v·m+p−1)
        zb-h1                (p−1)/(3m+p−1)   (forward, input and weight gradients one slot each)
    """
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    v = v if schedule in CHUNKED else 1
    return (p - 1) / (v * m + p - 1)


@dataclasses.dataclass(frozen=True, eq=False)
class ScheduleTable:
    """Who does what, slot by slot.

    Attributes:
        schedule, stages, microbatches, repeats: what the table was built for (p, m, v).
        phase: [slots, p] int, `IDLE`, `FWD`, `BWD` or `WGT` (zb-h1 only).
        micro: [slots, p] int, the microbatch (−1 when idle).
        chunk: [slots, p] int, the stage's local chunk r (global chunk r·p + stage); −1 idle.
    """

    schedule: str
    stages: int
    microbatches: int
    repeats: int
    phase: np.ndarray
    micro: np.ndarray
    chunk: np.ndarray

    @property
    def slots(self) -> int:
        """Length of the schedule in slots."""
        return self.phase.shape[0]

    @property
    def bubble_fraction(self) -> float:
        """Idle slots over all slots, counted from the table."""
        return float(np.mean(self.phase == IDLE))

    @property
    def closed_form_bubble(self) -> float:
        """The bubble fraction the literature gives for this schedule."""
        return closed_form_bubble(self.schedule, self.stages, self.microbatches, self.repeats)

    def in_flight(self) -> int:
        """Most (microbatch, chunk) pairs any stage holds residuals for: forward done, last
        backward pass (WGT where the table has weight-gradient slots, else BWD) not yet."""
        last = WGT if np.any(self.phase == WGT) else BWD
        held = np.cumsum(self.phase == FWD, axis=0) - np.cumsum(self.phase == last, axis=0)
        return int(held.max())

    def plot(self, ax=None, *, title: str | None = None):
        """Draws the table as a Gantt chart (stages down, slots across) with matplotlib.

        Returns:
            The matplotlib axes.
        """
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        if ax is None:
            _, ax = plt.subplots(figsize=(max(6, self.slots * 0.22), 0.45 * self.stages + 1))
        p, v = self.stages, self.repeats
        shades = np.linspace(0.45, 0.85, v)
        colors = {
            FWD: plt.cm.Blues(shades),
            BWD: plt.cm.Oranges(shades),
            WGT: plt.cm.Greens(shades),
        }
        for t in range(self.slots):
            for s in range(p):
                ph = self.phase[t, s]
                if ph == IDLE:
                    continue
                color = colors[int(ph)][self.chunk[t, s]]
                ax.add_patch(
                    plt.Rectangle((t, s), 1, 0.9, facecolor=color, edgecolor="white", lw=0.5)
                )
                if self.slots <= 80:
                    ax.text(
                        t + 0.5,
                        s + 0.45,
                        str(self.micro[t, s]),
                        ha="center",
                        va="center",
                        fontsize=6,
                    )
        ax.set_xlim(0, self.slots)
        ax.set_ylim(p, 0)
        ax.set_yticks(np.arange(p) + 0.45, [f"stage {s}" for s in range(p)])
        ax.set_xlabel("slot")
        ax.set_title(
            title
            or f"{self.schedule}: p={p}, m={self.microbatches}"
            + (f", v={v}" if self.schedule in CHUNKED else "")
            + f" · bubble {self.bubble_fraction:.1%}"
        )
        labels = {FWD: "forward", BWD: "backward", WGT: "weight gradient"}
        ax.legend(
            handles=[
                Patch(color=colors[ph][-1], label=label)
                for ph, label in labels.items()
                if ph != WGT or np.any(self.phase == WGT)
            ],
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
            fontsize=7,
        )
        return ax


def schedule_problems(
    schedule: str, stages: int, microbatches: int, repeats: int = 1
) -> list[Problem]:
    """What keeps `schedule` from running `microbatches` over `stages` with `repeats` chunks
    per stage, each a `Problem` naming the field, the value and the fix."""
    v = validate
    problems = v.one_of("schedule", schedule, SCHEDULES, example="1f1b")
    for name, value in (
        ("mesh.pipe", stages),
        ("microbatches", microbatches),
        ("repeats", repeats),
    ):
        problems += v.positive(name, value)
    if problems:
        return problems
    if repeats > 1 and schedule not in CHUNKED:
        problems.append(
            Problem(
                "repeats",
                repeats,
                f"with schedule={schedule!r}: only the circular and interleaved-1f1b schedules "
                "hold several chunks per stage; use --schedule interleaved-1f1b (or circular) "
                "or --repeats 1",
            )
        )
    if schedule in HAND_SCHEDULED and microbatches < stages:
        problems.append(
            Problem(
                "microbatches",
                microbatches,
                f"fewer than pipe={stages} stages: {schedule} needs at least one microbatch per "
                f"stage to fill the pipeline; use --microbatches {stages} or more",
            )
        )
    elif schedule == "interleaved-1f1b" and repeats > 1 and microbatches % stages:
        # Refused, as Megatron-LM does: each stage runs the microbatches in groups of p through
        # one chunk after another, and a partial last group stalls the stages (the counted
        # bubble then exceeds the closed form).
        fix = -(-microbatches // stages) * stages
        problems.append(
            Problem(
                "microbatches",
                microbatches,
                f"not a multiple of pipe={stages}: interleaved-1f1b runs the microbatches in "
                f"groups of one per stage through each chunk in turn; use --microbatches {fix}",
            )
        )
    if schedule == "circular" and repeats > 1 and microbatches < stages:
        problems.append(
            Problem(
                "microbatches",
                microbatches,
                f"fewer than pipe={stages} stages: the circular schedule sends each microbatch "
                f"round the stages {repeats} times and needs m ≥ p so a microbatch is back at "
                f"stage 0 before its next round; use --microbatches {stages} or more",
            )
        )
    return problems


def check_schedule(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> None:
    """Raises `RunCheckError` (a ValueError) listing `schedule_problems`, when any."""
    raise_if(schedule_problems(schedule, stages, microbatches, repeats))


def forward_ticks(stages: int, microbatches: int, repeats: int = 1):
    """The forward loop of gpipe / circular: tick t, stage s works on item k = t − s.

    Item k is microbatch k mod m on its round k // m (the stage's local chunk). Returns
    ``(valid, micro, chunk)``, each [ticks, p] with ticks = v·m + p − 1.
    """
    p, m, v = stages, microbatches, repeats
    t = np.arange(v * m + p - 1)[:, None]
    k = t - np.arange(p)[None, :]
    valid = (k >= 0) & (k < v * m)
    micro = np.where(valid, k % m, -1)
    chunk = np.where(valid, k // m, -1)
    return valid, micro, chunk


def _one_f_one_b(p: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Simulates PipeDream-flush: each stage warms up with p − s forwards, then alternates one
    backward and one forward, each as soon as its input has arrived (one slot later)."""
    fwd_done = np.full((m, p), -1)  # slot at which (microbatch, stage) ran forward
    bwd_done = np.full((m, p), -1)
    nf, nb = [0] * p, [0] * p  # forwards / backwards done per stage
    phase, micro = [], []
    t = 0
    while min(nb) < m:
        row_ph, row_mb = [IDLE] * p, [-1] * p
        for s in range(p):
            f, b = nf[s], nb[s]
            warm = min(p - s, m)
            can_b = b < f and (
                (s == p - 1 and fwd_done[b, s] < t) or (s < p - 1 and 0 <= bwd_done[b, s + 1] < t)
            )
            can_f = f < m and (s == 0 or 0 <= fwd_done[f, s - 1] < t) and f - b < p - s
            if can_b and f >= warm:
                row_ph[s], row_mb[s] = BWD, b
            elif can_f:
                row_ph[s], row_mb[s] = FWD, f
            elif can_b:
                row_ph[s], row_mb[s] = BWD, b
        for s in range(p):
            if row_ph[s] == FWD:
                fwd_done[nf[s], s] = t
                nf[s] += 1
            elif row_ph[s] == BWD:
                bwd_done[nb[s], s] = t
                nb[s] += 1
        phase.append(row_ph)
        micro.append(row_mb)
        t += 1
        if t > 4 * (m + p) + 8:  # the rules above always finish; this guards a future edit
            raise RuntimeError(f"1f1b schedule for p={p}, m={m} did not finish")
    return np.array(phase), np.array(micro)


# One pass of one microbatch through one of a stage's chunks: (phase, microbatch, local chunk).
Op = tuple[int, int, int]


def _input_of(op: Op, s: int, p: int, v: int) -> tuple[int, int, int, int] | None:
    """The pass (phase, micro, chunk, stage) whose output `op` on stage s waits for; None for
    the model's first forward."""
    phase, i, r = op
    if phase == FWD:
        if s > 0:
            return FWD, i, r, s - 1
        return (FWD, i, r - 1, p - 1) if r > 0 else None
    if phase == BWD:
        if s < p - 1:
            return BWD, i, r, s + 1
        return (BWD, i, r + 1, 0) if r < v - 1 else (FWD, i, r, s)
    return BWD, i, r, s


def _run_in_order(p: int, v: int, orders: list[list[Op]]):
    """Runs each stage's passes in its order, each in the first slot after its input's (one
    slot of latency between stages). Returns ``(phase, micro, chunk)``, each [slots, p]."""
    done: dict[tuple[int, int, int, int], int] = {}
    nxt = [0] * p
    rows: list[list[Op]] = []
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        t = len(rows)
        row = [(IDLE, -1, -1)] * p
        for s in range(p):
            if nxt[s] < len(orders[s]):
                src = _input_of(orders[s][nxt[s]], s, p, v)
                if src is None or done.get(src, t) < t:
                    row[s] = orders[s][nxt[s]]
        for s, op in enumerate(row):
            if op[0] != IDLE:
                done[(*op, s)] = t
                nxt[s] += 1
        rows.append(row)
        if t > 4 * sum(map(len, orders)) + 8:  # an order that waits on itself: a bug here
            raise RuntimeError(f"the pipeline orders for p={p}, v={v} do not finish")
    table = np.array(rows).reshape(len(rows), p, 3)
    return table[..., 0], table[..., 1], table[..., 2]


def _interleaved_order(p: int, m: int, v: int, s: int) -> list[Op]:
    """Stage s's passes in interleaved 1F1B: Megatron-LM's forward order (microbatches in
    groups of p, each group through chunk 0, then 1, ...), the backwards in the same order with
    the chunks reversed; v·p − s forwards of warm-up, then one backward and one forward in turn.

    No smaller warm-up keeps the closed-form bubble (searched per stage for p = 2, 4 and
    v = 2, 3); Megatron-LM's, 2(p−s−1) + (v−1)·p + 1 forwards before the first backward, holds
    p − s − 1 more. At v = 1 it is 1f1b's p − s.
    """
    n = v * m
    fwd = [(FWD, k // (p * v) * p + k % p, k // p % v) for k in range(n)]
    bwd = [(BWD, i, v - 1 - r) for _, i, r in fwd]
    warm = min(v * p - s, n)
    steady = [op for pair in zip(bwd[: n - warm], fwd[warm:], strict=True) for op in pair]
    return fwd[:warm] + steady + bwd[n - warm :]


def _zb_h1_order(p: int, m: int, s: int) -> list[Op]:
    """Stage s's passes in ZB-H1 (Qi et al., 2023): 1F1B's p − s forwards of warm-up, then for
    each microbatch i its input gradient, the weight gradient of microbatch i − s and the
    forward of i + p − s; the s weight gradients left fill the tail.

    Deferring s weight gradients on stage s keeps p microbatches in flight on every stage (the
    first stage's peak under 1F1B) and at most p − s not yet through their input gradient
    (1F1B's bound), and brings the bubble down to (p−1)/(3m+p−1). Bounding stage s at p − s
    microbatches up to their weight gradient cannot: the last stage would have to run forward,
    input and weight gradient in turn from slot p − 1, its last input gradient at slot
    3m + p − 3, the first stage's last weight gradient p slots later: 3m + 2p − 2 slots, each
    stage idle 2(p−1) of them where the closed form has p − 1.
    """
    order = [(FWD, i, 0) for i in range(p - s)]
    for i in range(m):
        order.append((BWD, i, 0))
        if i >= s:
            order.append((WGT, i - s, 0))
        if i + p - s < m:
            order.append((FWD, i + p - s, 0))
    return order + [(WGT, i, 0) for i in range(m - s, m)]


def schedule_table(schedule: str, p: int, m: int, v: int = 1) -> ScheduleTable:
    """The slot-by-slot table of a schedule.

    Args:
        schedule: one of `SCHEDULES`: ``"gpipe"``, ``"circular"``, ``"1f1b"``,
            ``"interleaved-1f1b"`` or ``"zb-h1"``.
        p: pipeline stages.
        m: microbatches per step (at least p for the hand-scheduled ones; a multiple of p for
            interleaved-1f1b with v > 1).
        v: chunks per stage (circular and interleaved-1f1b only; the model's layers are cut
            into p·v chunks and stage s holds chunks s, s+p, s+2p, ...).

    Returns:
        A `ScheduleTable`; ``.bubble_fraction`` counts its idle slots, ``.plot()`` draws it.
    """
    check_schedule(schedule, p, m, v)
    if schedule == "1f1b":
        phase, micro = _one_f_one_b(p, m)
        chunk = np.where(phase == IDLE, -1, 0)
    elif schedule == "interleaved-1f1b":
        phase, micro, chunk = _run_in_order(
            p, v, [_interleaved_order(p, m, v, s) for s in range(p)]
        )
    elif schedule == "zb-h1":
        phase, micro, chunk = _run_in_order(p, 1, [_zb_h1_order(p, m, s) for s in range(p)])
    else:
        valid, micro_f, chunk_f = forward_ticks(p, m, v)
        phase_f = np.where(valid, FWD, IDLE)
        # jax.grad runs the forward loop's ticks in reverse, each a backward of the same work.
        phase = np.concatenate([phase_f, np.where(valid, BWD, IDLE)[::-1]])
        micro = np.concatenate([micro_f, micro_f[::-1]])
        chunk = np.concatenate([chunk_f, chunk_f[::-1]])
    return ScheduleTable(schedule, p, m, v, phase, micro, chunk)


def buffer_depth(table: ScheduleTable, kind: str) -> int:
    """Smallest ring size K so that buffer slot ``microbatch mod K`` is never overwritten before
    it is read, for the 1f1b executor's buffers.

    ``kind``: ``"fwd"`` (activations received from the previous stage), ``"bwd"`` (cotangents
    received from the next stage, or made by the loss on the last stage) or ``"res"``
    (residuals kept from a stage's forward until its backward). Tables of one chunk per stage
    without weight-gradient slots only (gpipe, 1f1b, interleaved-1f1b at v = 1).
    """
    if table.repeats > 1 or np.any(table.phase == WGT):
        raise ValueError(
            f"buffer_depth covers one chunk per stage and no weight-gradient slots, not "
            f"{table.schedule} with v={table.repeats}"
        )
    p, m = table.stages, table.microbatches
    slot = {}
    for t in range(table.slots):
        for s in range(p):
            if table.phase[t, s] != IDLE:
                slot[(int(table.phase[t, s]), int(table.micro[t, s]), s)] = t
    for depth in range(1, m + 1):
        ok = True
        for s in range(p):
            for i in range(m - depth):
                j = i + depth  # the microbatch that reuses i's buffer entry
                if kind == "fwd":
                    if s == 0:
                        continue
                    written, read = slot[(FWD, j, s - 1)], slot[(FWD, i, s)]
                elif kind == "bwd":
                    src = (FWD, j, s) if s == p - 1 else (BWD, j, s + 1)
                    written, read = slot[src], slot[(BWD, i, s)]
                else:
                    written, read = slot[(FWD, j, s)], slot[(BWD, i, s)]
                # Reads happen before writes within a slot, so the same slot is safe.
                if written < read:
                    ok = False
        if ok:
            return depth
    return m
