"""Tests for the learning-rate schedule (meshtrain.train.optim.make_schedule).

The closed form below is the one in `OptimConfig`'s docstring, computed in float64 from
`math.cos`; the schedule computes in float32 on a traced step.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain.train import OptimConfig, make_schedule


def closed_form(s: int, steps: int, warmup: int, lr: float, ratio: float) -> float:
    """lr at step s of a `steps`-step run, in float64, as `OptimConfig` states it."""
    w = min(warmup, steps - 1)  # W: effective warm-up steps
    p = max(w - 1, 0)  # P: the peak step
    lo = lr * ratio
    if steps == 1:
        return lr if s == 0 else lo
    if s > steps - 1:
        return lo
    if s < p:
        return lr * (s + 1) / w
    return lo + (lr - lo) * 0.5 * (1 + math.cos(math.pi * (s - p) / (steps - 1 - p)))


# (steps, warmup_steps): steps ≤ warmup, warm-up 0 and 1, and runs of 1, 2 and 3 steps.
PAIRS = [
    (1, 0),
    (1, 1),
    (1, 20),
    (2, 0),
    (2, 1),
    (2, 2),
    (2, 20),
    (3, 0),
    (3, 1),
    (3, 2),
    (3, 20),
    (10, 0),
    (10, 1),
    (10, 3),
    (10, 9),
    (10, 10),
    (10, 50),
    (20, 20),
    (200, 20),
]
RATES = [(3e-3, 0.1), (1.0, 0.0), (0.7, 1 / 3)]


def schedule_for(steps, warmup, lr, ratio):
    return make_schedule(OptimConfig(lr=lr, warmup_steps=warmup, min_lr_ratio=ratio), steps)


def values(schedule, steps: int) -> np.ndarray:
    """The schedule at steps 0 .. steps + 2, jitted on a traced int32 step."""
    return np.asarray(jax.jit(jax.vmap(schedule))(jnp.arange(steps + 3, dtype=jnp.int32)))


@pytest.mark.parametrize("lr, ratio", RATES)
@pytest.mark.parametrize("steps, warmup", PAIRS)
def test_schedule_end_points_equal_their_closed_forms(steps, warmup, lr, ratio):
    got = values(schedule_for(steps, warmup, lr, ratio), steps)
    assert got.dtype == np.float32
    w = min(warmup, steps - 1)
    peak_step, last = max(w - 1, 0), steps - 1
    # Exact in float32: the first step, the peak (end of warm-up) and the last step.
    assert got[peak_step] == np.float32(lr)
    assert got[peak_step] == np.float32(closed_form(peak_step, steps, warmup, lr, ratio))
    if steps > 1:
        assert got[last] == np.float32(lr * ratio)
        assert got[last] == np.float32(closed_form(last, steps, warmup, lr, ratio))
    else:
        assert got[0] == np.float32(lr)  # a 1-step run takes its one step at the peak
    assert got[0] == pytest.approx(closed_form(0, steps, warmup, lr, ratio), rel=1e-6)
    assert got[0] > 0  # never a wasted first step
    # Past the planned end the rate stays at the minimum.
    np.testing.assert_array_equal(got[steps:], np.float32(lr * ratio))


@pytest.mark.parametrize("lr, ratio", RATES)
@pytest.mark.parametrize("steps, warmup", PAIRS)
def test_schedule_follows_the_closed_form_at_every_step(steps, warmup, lr, ratio):
    got = values(schedule_for(steps, warmup, lr, ratio), steps)
    want = [closed_form(s, steps, warmup, lr, ratio) for s in range(steps + 3)]
    # float32 rounding of the cosine's argument and value: a few ulps of lr
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7 * lr)
    peak_step = max(min(warmup, steps - 1) - 1, 0)
    assert np.all(np.diff(got[: peak_step + 1]) > 0)  # warm-up rises strictly
    assert np.all(np.diff(got[peak_step:]) <= 0)  # then never rises


def test_the_issues_short_and_default_runs():
    lr, ratio = 3e-3, 0.1
    # 3 steps with the default 20 warm-up steps: lr/2, lr, lr_min (not 0 first).
    got = values(schedule_for(3, 20, lr, ratio), 3)[:3]
    np.testing.assert_array_equal(got, np.float32([lr / 2, lr, lr * ratio]))
    # 20 steps with the default warm-up: the last update runs at lr_min, not at the peak.
    config = OptimConfig()
    got = values(make_schedule(config, 20), 20)
    assert got[19] == np.float32(config.lr * config.min_lr_ratio) < got[18] == np.float32(config.lr)


def test_schedule_takes_python_ints_as_well_as_traced_steps():
    schedule = schedule_for(50, 7, 3e-3, 0.1)
    eager = np.array([schedule(s) for s in range(53)])
    # XLA may round the warm-up's division differently once compiled: ≤ 1 ulp.
    np.testing.assert_allclose(eager, values(schedule, 50), rtol=2.5e-7)
    assert eager[6] == np.float32(3e-3) and eager[49] == np.float32(3e-4)


def test_schedule_needs_a_step():
    with pytest.raises(ValueError, match=r"total_steps=0: a schedule needs at least one step"):
        make_schedule(OptimConfig(), 0)
