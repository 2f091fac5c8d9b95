"""Tests for the interleaved-1f1b and zb-h1 schedule tables (numpy only, no compiling): counted
bubbles against the closed forms, every pass once and in dependency order, interleaved 1F1B at
one chunk equal to 1f1b, zb-h1's memory bounds, the in-flight count, the Gantt chart and the
one-line refusals.
"""

import dataclasses
import itertools
import re

import numpy as np
import pytest

from meshtrain.pipeline.schedules import (
    BWD,
    CHUNKED,
    FWD,
    IDLE,
    WGT,
    buffer_depth,
    closed_form_bubble,
    schedule_problems,
    schedule_table,
)

INTERLEAVED = [
    ("interleaved-1f1b", p, m, v) for p in (2, 4) for v in (1, 2, 3) for m in (p, 2 * p, 4 * p)
]
# zb-h1 needs m ≥ p, not a multiple of p: p + 1 and 2p − 1 check that too.
ZB = [("zb-h1", p, m, 1) for p in (2, 4) for m in sorted({p, p + 1, 2 * p - 1, 2 * p, 4 * p})]
CASES = INTERLEAVED + ZB


def _when(table) -> dict[tuple[int, int, int, int], int]:
    """(phase, micro, chunk, stage) → slot, failing on a pass scheduled twice."""
    when = {}
    for t, s in itertools.product(range(table.slots), range(table.stages)):
        ph = int(table.phase[t, s])
        if ph != IDLE:
            key = (ph, int(table.micro[t, s]), int(table.chunk[t, s]), s)
            assert key not in when, f"{key} scheduled twice"
            when[key] = t
    return when


def _dependency_violations(table) -> list[str]:
    """Every pass missing from the table or run before its input, per the schedule contract."""
    p, m, v = table.stages, table.microbatches, table.repeats
    phases = (FWD, BWD, WGT) if table.schedule == "zb-h1" else (FWD, BWD)
    when = _when(table)
    wrong = [f"{len(when)} passes, not {len(phases) * m * v * p}"]
    wrong = wrong if len(when) != len(phases) * m * v * p else []
    for i, r, s in itertools.product(range(m), range(v), range(p)):
        prev = (r, s - 1) if s > 0 else (r - 1, p - 1)
        nxt = (r, s + 1) if s < p - 1 else (r + 1, 0)
        before = []  # (earlier pass, later pass)
        if prev[0] >= 0:
            before.append(((FWD, i, *prev), (FWD, i, r, s)))
        if nxt[0] < v:
            before.append(((BWD, i, *nxt), (BWD, i, r, s)))
        before.append(((FWD, i, r, s), (BWD, i, r, s)))
        if WGT in phases:
            before.append(((BWD, i, r, s), (WGT, i, r, s)))
        for a, b in before:
            if a not in when or b not in when:
                wrong.append(f"{a if a not in when else b} never runs")
            elif when[a] >= when[b]:
                wrong.append(f"{b} at slot {when[b]}, not after {a} at slot {when[a]}")
    return wrong


def _held_independently(table, release: int) -> int:
    """Most (micro, chunk) pairs any stage holds: added at their FWD, dropped at `release`."""
    most = 0
    for s in range(table.stages):
        held = set()
        for t in range(table.slots):
            key = (int(table.micro[t, s]), int(table.chunk[t, s]))
            if table.phase[t, s] == FWD:
                held.add(key)
            elif table.phase[t, s] == release:
                held.remove(key)
            most = max(most, len(held))
    return most


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_counted_bubble_equals_closed_form(schedule, p, m, v):
    table = schedule_table(schedule, p, m, v)
    want = (p - 1) / ((3 * m if schedule == "zb-h1" else v * m) + p - 1)
    assert closed_form_bubble(schedule, p, m, v) == pytest.approx(want, abs=1e-12)
    assert table.bubble_fraction == pytest.approx(want, abs=1e-12)
    assert table.closed_form_bubble == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_every_pass_runs_once_in_dependency_order(schedule, p, m, v):
    table = schedule_table(schedule, p, m, v)
    assert _dependency_violations(table) == []
    busy = table.phase != IDLE
    assert np.all((table.micro >= 0) == busy) and np.all((table.chunk >= 0) == busy)
    assert table.micro.max() < m and table.chunk.max() < v


def test_the_dependency_check_catches_a_pass_run_too_early():
    table = schedule_table("zb-h1", 4, 8)
    # The last stage's first input gradient moved one slot before its own forward.
    t = int(np.flatnonzero(table.phase[:, -1] == BWD)[0])
    for a in (table.phase, table.micro, table.chunk):
        a[t - 1, -1], a[t, -1] = a[t, -1], a[t - 1, -1]
    assert any("not after" in w for w in _dependency_violations(table))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 3), (2, 8), (4, 4), (4, 5), (4, 8), (4, 16)])
def test_interleaved_with_one_chunk_is_1f1b(p, m):
    one = schedule_table("1f1b", p, m)
    got = schedule_table("interleaved-1f1b", p, m, 1)
    for name in ("phase", "micro", "chunk"):
        np.testing.assert_array_equal(getattr(got, name), getattr(one, name), err_msg=name)


@pytest.mark.parametrize("schedule,p,m,v", INTERLEAVED)
def test_interleaved_runs_megatrons_order_on_every_stage(schedule, p, m, v):
    table = schedule_table(schedule, p, m, v)
    ks = np.arange(v * m)
    want_micro = ks // (p * v) * p + ks % p
    want_chunk = ks // p % v
    for s in range(p):
        for ph, chunk in ((FWD, want_chunk), (BWD, v - 1 - want_chunk)):
            at = table.phase[:, s] == ph
            np.testing.assert_array_equal(table.micro[at, s], want_micro)
            np.testing.assert_array_equal(table.chunk[at, s], chunk)


@pytest.mark.parametrize("schedule,p,m,v", ZB)
def test_zb_h1_keeps_1f1b_activation_bounds_at_every_slot(schedule, p, m, v):
    """At most p − s microbatches forward but not through their input gradient on stage s
    (1F1B's bound) and at most p up to their weight gradient (1F1B's first stage's peak)."""
    table = schedule_table(schedule, p, m, v)
    count = lambda ph: np.cumsum(table.phase == ph, axis=0)
    before_bwd, before_wgt = count(FWD) - count(BWD), count(FWD) - count(WGT)
    assert np.all(before_bwd <= p - np.arange(p)[None, :])
    assert np.all(before_wgt <= p)
    assert table.in_flight() == schedule_table("1f1b", p, m).in_flight() == p


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_in_flight_matches_an_independent_count(schedule, p, m, v):
    table = schedule_table(schedule, p, m, v)
    release = WGT if schedule == "zb-h1" else BWD
    assert table.in_flight() == _held_independently(table, release)
    if schedule == "interleaved-1f1b":
        # p microbatches' worth of a stage's activations, each chunk holding 1/v of them.
        assert table.in_flight() == v * p


def test_in_flight_holds_a_microbatch_until_its_weight_gradient():
    """zb-h1's last stage runs each input gradient right after its forward but defers p − 1
    weight gradients to the tail: it holds p microbatches, not 1."""
    p = 4
    table = schedule_table("zb-h1", p, 8)
    last = dataclasses.replace(
        table, stages=1, phase=table.phase[:, -1:], micro=table.micro[:, -1:],
        chunk=table.chunk[:, -1:],
    )  # fmt: skip
    assert _held_independently(last, BWD) == 1
    assert last.in_flight() == _held_independently(last, WGT) == p


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 4, 8, 1), ("circular", 2, 4, 2)])
def test_in_flight_of_the_forward_loop_schedules(schedule, p, m, v):
    table = schedule_table(schedule, p, m, v)
    assert table.in_flight() == _held_independently(table, BWD) == v * m


@pytest.mark.parametrize(
    "schedule,p,m,v", [("interleaved-1f1b", 2, 4, 2), ("zb-h1", 4, 8, 1), ("1f1b", 2, 4, 1)]
)
def test_gantt_chart_draws_every_busy_slot(schedule, p, m, v):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = schedule_table(schedule, p, m, v)
    ax = table.plot()
    assert len(ax.patches) == int(np.sum(table.phase != IDLE))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert ("weight gradient" in labels) == (schedule == "zb-h1")
    assert (f"v={v}" in ax.get_title()) == (schedule in CHUNKED)
    # Blues, oranges and greens: each phase's patches have their own dominant channel.
    dominant = [int(np.argmax(patch.get_facecolor()[:3])) for patch in ax.patches]
    for ph, channel in ((FWD, 2), (BWD, 0), (WGT, 1)):
        assert dominant.count(channel) == int(np.sum(table.phase == ph)), ph
    plt.close(ax.figure)


@pytest.mark.parametrize(
    "schedule,p,m,v,match",
    [
        (
            "interleaved-1f1b",
            4,
            6,
            2,
            r"^microbatches=6: not a multiple of pipe=4.*--microbatches 8$",
        ),
        ("interleaved-1f1b", 4, 2, 2, r"^microbatches=2: fewer than pipe=4.*--microbatches 4 or"),
        ("zb-h1", 4, 3, 1, r"^microbatches=3: fewer than pipe=4 stages: zb-h1 .*--microbatches 4"),
        ("zb-h1", 2, 4, 2, r"^repeats=2: .*circular and interleaved-1f1b.*--repeats 1$"),
        ("1f1b", 2, 4, 3, r"^repeats=3: with schedule='1f1b'.*--schedule interleaved-1f1b"),
    ],
)
def test_bad_schedules_are_refused_in_one_line_with_the_fix(schedule, p, m, v, match):
    problems = schedule_problems(schedule, p, m, v)
    assert len(problems) == 1, problems
    line = str(problems[0])
    assert "\n" not in line and re.search(match, line), line
    with pytest.raises(ValueError, match=re.escape(line)):
        schedule_table(schedule, p, m, v)


@pytest.mark.parametrize(
    "schedule,p,m,v",
    [("interleaved-1f1b", 4, 5, 1), ("interleaved-1f1b", 2, 6, 3), ("zb-h1", 4, 5, 1)],
)
def test_what_the_schedules_allow(schedule, p, m, v):
    assert schedule_problems(schedule, p, m, v) == []


def test_buffer_depth_covers_one_chunk_tables_without_weight_gradients():
    one = schedule_table("1f1b", 4, 8)
    same = schedule_table("interleaved-1f1b", 4, 8, 1)
    for kind in ("fwd", "bwd", "res"):
        assert buffer_depth(same, kind) == buffer_depth(one, kind)
    for table in (schedule_table("interleaved-1f1b", 4, 8, 2), schedule_table("zb-h1", 4, 8)):
        with pytest.raises(ValueError, match=table.schedule):
            buffer_depth(table, "res")
