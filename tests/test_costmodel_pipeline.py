"""What a pipeline schedule costs in lockstep: gpipe and zb-h1 at their closed forms, 1f1b
above its own (a hand count on two stages), and the activations each schedule holds."""

import numpy as np
import pytest

from meshtrain.costmodel import held_microbatches, lockstep_bubble, lockstep_time, pass_costs
from meshtrain.pipeline import schedules
from meshtrain.pipeline.schedules import (
    BWD,
    FWD,
    IDLE,
    WGT,
    ScheduleTable,
    closed_form_bubble,
    schedule_table,
)

CASES = [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 16)]


@pytest.mark.parametrize(("p", "m"), CASES)
def test_gpipe_and_circular_cost_their_closed_forms_in_lockstep(p, m):
    # Forward ticks all forwards (1 unit), backward ticks all backwards (2): the papers' slots.
    assert lockstep_bubble("gpipe", p, m) == pytest.approx(closed_form_bubble("gpipe", p, m))
    circ = lockstep_bubble("circular", p, m, 2)
    assert circ == pytest.approx(closed_form_bubble("circular", p, m, 2))


def test_1f1b_on_two_stages_and_two_microbatches_costs_a_backward_per_shared_slot():
    # Stage 0 warms up with p − 0 = 2 forwards, stage 1 with 1; each sends on one slot later
    # and runs a backward as soon as its cotangent (or, last stage, its own forward) is in:
    #   slot  stage 0  stage 1
    #   0     F0       ·          only a forward: 1 unit
    #   1     F1       F0         1
    #   2     ·        B0         2
    #   3     B0       F1         a backward beside a forward lasts a backward: 2
    #   4     ·        B1         2
    #   5     B1       ·          2
    want = [
        [FWD, IDLE],
        [FWD, FWD],
        [IDLE, BWD],
        [BWD, FWD],
        [IDLE, BWD],
        [BWD, IDLE],
    ]
    table = schedule_table("1f1b", 2, 2)
    np.testing.assert_array_equal(table.phase, want)
    time = 1 + 1 + 2 + 2 + 2 + 2
    useful = 3 * 2  # each stage: two forwards (1) and two backwards (2)
    assert lockstep_time(table) == time
    assert lockstep_bubble("1f1b", 2, 2) == pytest.approx(1 - useful / time) == pytest.approx(0.4)
    assert closed_form_bubble("1f1b", 2, 2) == pytest.approx(1 / 3)  # counting slots alone


@pytest.mark.parametrize(("p", "m"), [c for c in CASES if c[1] >= c[0]])
def test_1f1b_costs_more_in_lockstep_than_its_closed_form(p, m):
    assert lockstep_bubble("1f1b", p, m) > closed_form_bubble("1f1b", p, m) + 0.05


@pytest.mark.parametrize(("p", "m"), [c for c in CASES if c[1] >= c[0]])
def test_zb_h1_costs_its_closed_form_when_the_weight_gradient_is_one_unit(p, m):
    # Forward, input gradient and weight gradient are one unit each: a slot is one unit
    # whatever its stages run, and the table's 3m + p − 1 slots give (p − 1)/(3m + p − 1).
    assert pass_costs("zb-h1") == {FWD: 1.0, BWD: 1.0, WGT: 1.0}
    want = (p - 1) / (3 * m + p - 1)
    assert lockstep_bubble("zb-h1", p, m) == pytest.approx(want)
    assert closed_form_bubble("zb-h1", p, m) == pytest.approx(want)
    assert lockstep_bubble("zb-h1", p, m) < lockstep_bubble("1f1b", p, m)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16)])
def test_interleaving_two_chunks_shrinks_1f1bs_lockstep_bubble(p, m):
    bubble = lockstep_bubble("interleaved-1f1b", p, m, 2)
    assert closed_form_bubble("interleaved-1f1b", p, m, 2) <= bubble
    assert bubble < lockstep_bubble("1f1b", p, m)


@pytest.mark.parametrize(("p", "m"), [c for c in CASES if c[1] >= c[0]])
def test_held_microbatches_are_m_for_gpipe_and_p_for_1f1b(p, m):
    assert held_microbatches("gpipe", p, m) == m
    assert held_microbatches("circular", p, m, 2) == m  # 2m chunks in flight, each half a stage
    assert held_microbatches("1f1b", p, m) == p


def test_zb_h1_and_interleaved_hold_at_least_what_1f1b_holds():
    # zb-h1 also holds what a weight gradient reads between its BWD and WGT slots;
    # interleaving holds the chunks of its deeper warm-up.
    assert held_microbatches("zb-h1", 4, 8) >= held_microbatches("1f1b", 4, 8) == 4
    assert held_microbatches("interleaved-1f1b", 4, 8, 2) >= 4


def test_a_table_that_skips_passes_is_refused_by_name(monkeypatch):
    def short(schedule, p, m, v=1):  # a zb-h1 table without its weight gradients
        phase = np.array([[FWD, IDLE], [FWD, FWD], [IDLE, BWD], [BWD, FWD], [IDLE, BWD]])
        micro = np.zeros_like(phase)
        return ScheduleTable(schedule, p, m, v, phase, micro, np.where(phase == IDLE, -1, 0))

    monkeypatch.setattr(schedules, "schedule_table", short)
    with pytest.raises(ValueError, match=r"schedule='zb-h1': its table gives stage 0 3 units"):
        lockstep_bubble("zb-h1", 2, 2)
