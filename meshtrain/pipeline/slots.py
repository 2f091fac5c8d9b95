"""What a schedule table implies for the executors: the payloads each stage sends, the ring
buffers it keeps, and the permutes of every slot.

A stage sends its output on after every forward except the model's last chunk's (which goes
to the loss head), and its input's cotangent back after every backward except the model's
first chunk's (which goes to the embedding). Only those payloads are useful bytes on the wire:
the executors put each slot's permutes in a branch chosen by the slot that names only the
stage pairs moving something then (`slot_plan`, `tick_patterns`), and `count_permutes` counts
a compiled program's permutes as they run.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from meshtrain.mesh import PIPE
from meshtrain.pipeline.schedules import (
    BWD,
    FWD,
    HAND_SCHEDULED,
    IDLE,
    WGT,
    ScheduleTable,
    forward_ticks,
    schedule_table,
)


def sends(table: ScheduleTable) -> np.ndarray:
    """Payloads (one microbatch's [b, T, D] activation or cotangent) each stage sends per step.

    Returns:
        [p] int: stage s's count of forward sends (every FWD but the last chunk's on the last
        stage) plus backward sends (every BWD but the first chunk's on the first stage).
    """
    p, v = table.stages, table.repeats
    stage = np.broadcast_to(np.arange(p), table.phase.shape)
    last = (stage == p - 1) & (table.chunk == v - 1)
    first = (stage == 0) & (table.chunk == 0)
    fwd = (table.phase == FWD) & ~last
    bwd = (table.phase == BWD) & ~first
    return (fwd | bwd).sum(axis=0)


Pairs = tuple[tuple[int, int], ...]


def _next_stage(s: int, r: int, p: int, v: int) -> tuple[int, int] | None:
    """The (stage, chunk) that runs the model's next chunk after chunk r on stage s."""
    if s < p - 1:
        return s + 1, r
    return (0, r + 1) if r < v - 1 else None


def _prev_stage(s: int, r: int, p: int) -> tuple[int, int] | None:
    """The (stage, chunk) that runs the model's previous chunk."""
    if s > 0:
        return s - 1, r
    return (p - 1, r - 1) if r > 0 else None


@dataclasses.dataclass(frozen=True, eq=False)
class SlotPlan:
    """Where every stage keeps what it receives and makes, and what crosses the wire, slot by
    slot, for the hand-scheduled executor (`meshtrain.pipeline.spmd.scheduled`).

    Buffers, each a ring of ``depth[kind]`` entries per stage, an entry reused as soon as its
    last reader has run (reads come before writes within a slot):

    - ``fin``: activations received for a forward;
    - ``bin``: cotangents received for a backward (or made by the loss head on the last stage);
    - ``res``: a forward's residuals, kept until the backward (the weight pass in zb-h1);
    - ``hand``: what zb-h1's input pass hands its weight pass.

    Attributes:
        depth: entries per buffer kind (at least 1).
        read: kind → [slots, p] entry each stage reads in the slot (0 when it reads none).
        write: kind → [slots, p] entry each stage writes at the end of the slot (−1: none).
            ``fin`` and ``bin`` are written by what arrives; ``head`` is the loss head's
            cotangent written into ``bin`` on the last stage; ``res`` and ``hand`` by the
            stage's own pass.
        patterns: the distinct ``(forward pairs, backward pairs)`` of the slots' permutes.
        pattern: [slots] which of `patterns` each slot sends.
    """

    depth: dict[str, int]
    read: dict[str, np.ndarray]
    write: dict[str, np.ndarray]
    patterns: list[tuple[Pairs, Pairs]]
    pattern: np.ndarray


def _allocate(events: list[tuple[int, int, tuple]]) -> tuple[dict, int]:
    """Ring entries for ``(written, last_read, key)`` lifetimes; ``({key: entry}, depth)``."""
    busy_until: list[int] = []  # per entry, the slot of its last read
    entry = {}
    for written, last_read, key in sorted(events):
        free = [k for k, until in enumerate(busy_until) if until <= written]
        k = free[0] if free else len(busy_until)
        if k == len(busy_until):
            busy_until.append(last_read)
        busy_until[k] = last_read
        entry[key] = k
    return entry, max(len(busy_until), 1)


def slot_plan(table: ScheduleTable) -> SlotPlan:
    """The buffers and permutes of a hand-scheduled table (1f1b, interleaved-1f1b, zb-h1).

    Returns:
        A `SlotPlan`.
    """
    p, v, n = table.stages, table.repeats, table.slots
    when = {}  # (phase, micro, chunk, stage) → slot
    for t in range(n):
        for s in range(p):
            ph, i, r = (int(a[t, s]) for a in (table.phase, table.micro, table.chunk))
            if ph != IDLE:
                when[(ph, i, r, s)] = t
    split = any(ph == WGT for ph, *_ in when)
    events: dict[tuple[str, int], list] = {}
    head_slot = {}

    def add(kind, s, written, read, key):
        events.setdefault((kind, s), []).append((written, read, key))

    for (ph, i, r, s), t in when.items():
        if ph == FWD:
            prev = _prev_stage(s, r, p)
            if prev is not None:
                add("fin", s, when[(FWD, i, prev[1], prev[0])], t, (i, r))
            last_read = when[(WGT if split else BWD, i, r, s)]
            add("res", s, t, last_read, (i, r))
            if _next_stage(s, r, p, v) is None:
                head_slot[(i, r)] = t
                add("bin", s, t, when[(BWD, i, r, s)], (i, r))
        elif ph == BWD:
            nxt = _next_stage(s, r, p, v)
            if nxt is not None:
                add("bin", s, when[(BWD, i, nxt[1], nxt[0])], t, (i, r))
            if split:
                add("hand", s, t, when[(WGT, i, r, s)], (i, r))
    kinds = ("fin", "bin", "res", "hand")
    read = {k: np.zeros((n, p), np.int32) for k in kinds}
    write = {k: np.full((n, p), -1, np.int32) for k in (*kinds, "head")}
    depth = dict.fromkeys(kinds, 1)
    for (kind, s), evs in events.items():
        entry, depth_s = _allocate(evs)
        depth[kind] = max(depth[kind], depth_s)
        for written, last_read, key in evs:
            k = entry[key]
            i, r = key
            if kind == "fin":
                read["fin"][last_read, s] = k
                write["fin"][written, s] = k
            elif kind == "bin":
                read["bin"][last_read, s] = k
                write["head" if head_slot.get(key) == written and s == p - 1 else "bin"][
                    written, s
                ] = k
            elif kind == "res":
                write["res"][written, s] = k
                read["res"][when[(BWD, i, r, s)], s] = k
                if split:
                    read["res"][last_read, s] = k
            else:
                write["hand"][written, s] = k
                read["hand"][last_read, s] = k
    patterns: list[tuple[Pairs, Pairs]] = []
    pattern = np.zeros(n, np.int32)
    for t in range(n):
        fwd, bwd = [], []
        for s in range(p):
            ph, r = table.phase[t, s], table.chunk[t, s]
            if ph == FWD and (nxt := _next_stage(s, int(r), p, v)) is not None:
                fwd.append((s, nxt[0]))
            elif ph == BWD and (prev := _prev_stage(s, int(r), p)) is not None:
                bwd.append((s, prev[0]))
        key = (tuple(fwd), tuple(bwd))
        if key not in patterns:
            patterns.append(key)
        pattern[t] = patterns.index(key)
    return SlotPlan(depth, read, write, patterns, pattern)


def tick_patterns(valid: np.ndarray, chunk: np.ndarray, p: int, v: int):
    """The forward loop's (gpipe, circular) per-tick sends: ``(patterns, pattern)``, each
    pattern the pairs of stages that pass a useful output on at that tick."""
    patterns: list[Pairs] = []
    pattern = np.zeros(valid.shape[0], np.int32)
    for t in range(valid.shape[0]):
        pairs = tuple(
            (s, nxt[0])
            for s in range(p)
            if valid[t, s] and (nxt := _next_stage(s, int(chunk[t, s]), p, v)) is not None
        )
        if pairs not in patterns:
            patterns.append(pairs)
        pattern[t] = patterns.index(pairs)
    return patterns, pattern


def permute_uses(config, p: int) -> tuple[dict[frozenset, int], int]:
    """How many slots run each set of stage pairs' permute per step, and the slots per loop.

    The executors put each slot's permutes in a branch chosen by the slot (`lax.switch`), so
    a compiled program's permute runs only in the slots whose pattern it is; the forward loop
    (gpipe, circular) runs its permutes again, reversed, in its backward.

    Args:
        config: the `PipelineConfig`.
        p: the stages.

    Returns:
        ``(uses, trips)``: stage pairs (a frozenset of (source, target)) → slots that send
        them, per step; and the trip count of the loop(s) they sit in.
    """
    m, v = config.num_microbatches(p), config.chunks_per_stage()
    uses: dict[frozenset, int] = {}

    def add(pairs):
        if pairs:
            key = frozenset(pairs)
            uses[key] = uses.get(key, 0) + 1

    if config.schedule in HAND_SCHEDULED:
        plan = slot_plan(schedule_table(config.schedule, p, m, v))
        for t in plan.pattern:
            for pairs in plan.patterns[t]:
                add(pairs)
        return uses, len(plan.pattern)
    valid, _, chunk = forward_ticks(p, m, v)
    patterns, pattern = tick_patterns(valid, chunk, p, v)
    for t in pattern:
        add(patterns[t])
        add(tuple((b, a) for a, b in patterns[t]))
    return uses, len(pattern)


def count_permutes(collectives: list, sizes: dict, config) -> list:
    """`collectives` (`meshtrain.comm.hlo.Collective`) with the pipeline's permutes counted as
    they run: a permute in a slot's branch runs only in the slots whose pattern it is, not in
    every trip of the loop (the HLO count of a branch's collective).

    Args:
        collectives: the compiled step's collectives.
        sizes: the mesh axis sizes, in mesh order (device ids are positions in it).
        config: the `PipelineConfig`.
    """
    p = sizes.get(PIPE, 1)
    if p == 1:
        return collectives
    uses, trips = permute_uses(config, p)
    shape, axis = list(sizes.values()), list(sizes).index(PIPE)

    def key(c):
        stages = [tuple(int(np.unravel_index(d, shape)[axis]) for d in pair) for pair in c.groups]
        return frozenset((a, b) for a, b in stages if a != b)

    mine: dict[frozenset, list] = {}
    for c in collectives:
        if c.kind == "collective-permute" and c.conditional and key(c) in uses:
            mine.setdefault(key(c), []).append(c)
    counted = {}
    for k, cs in mine.items():
        # The slots that send k, shared out among the branches' instances of it.
        total = (cs[0].count // trips) * uses[k]
        for j, c in enumerate(cs):
            counted[id(c)] = total // len(cs) + (j < total % len(cs))
    return [
        dataclasses.replace(c, count=counted[id(c)]) if id(c) in counted else c for c in collectives
    ]
