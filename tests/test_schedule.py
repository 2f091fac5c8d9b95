"""Tests for the learning-rate schedule (meshtrain.optim.make_schedule) and for how a
skipped (non-finite) step advances it: the schedule is a function of batches consumed.

The closed form below is the one in `OptimConfig`'s docstring, computed in float64 from
`math.cos`; the schedule computes in float32 on a traced step.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import state_and_step
from flax import nnx

from meshtrain import layout as S
from meshtrain.lower import cross_entropy
from meshtrain.mesh import make_mesh
from meshtrain.models import MLPConfig, build_model
from meshtrain.train import OPTIMIZERS, OptimConfig, make_optimizer, make_schedule


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


# --- a skipped step consumes its batch --------------------------------------------------

MLP = MLPConfig(num_features=8, num_classes=4, d_model=16, d_hidden=32)
ROWS = 16


def mlp_batches(n: int, nan_at=()) -> list[dict]:
    """`n` seeded batches for MLP; those in `nan_at` carry one NaN input."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        inputs = rng.normal(size=(ROWS, MLP.num_features)).astype(np.float32)
        if i in nan_at:
            inputs[3, 5] = np.nan
        out.append({"inputs": inputs, "targets": rng.integers(0, MLP.num_classes, ROWS, np.int32)})
    return out


def one_device_run(config: OptimConfig, steps: int, data: list[dict]):
    """Trains MLP on one device, one step per batch of `data`.

    Returns:
        ``(graphdef, [(state before, state after, metrics) per step])``, on the host.
    """
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    rules = S.rules_for("dp", mesh)
    tx = make_optimizer(config, steps)
    ctor = lambda: build_model(MLP, seed=0)  # noqa: E731
    schedule = make_schedule(config, steps)
    graphdef, state, _, step = state_and_step(ctor, tx, mesh, rules, data[0], schedule=schedule)
    out = []
    for batch in data:
        before = jax.device_get(state)
        state, metrics = step(state, S.shard_batch(batch, mesh, rules))
        out.append((before, jax.device_get(state), jax.device_get(metrics)))
    return graphdef, out


def counters_and_moments(opt_state) -> tuple[list, list]:
    """The integer leaves (optax's step counters) and the float leaves of an optax state."""
    leaves = jax.tree.leaves(opt_state)
    ints = [x for x in leaves if np.issubdtype(x.dtype, np.integer)]
    return ints, [x for x in leaves if not np.issubdtype(x.dtype, np.integer)]


def flat64(tree) -> np.ndarray:
    """All leaves of `tree`, raveled into one float64 vector."""
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)]).astype(np.float64)


# Plain SGD: the update is exactly -lr(s) · g. 4 steps with warm-up 2: steps 0, 1, 3 run at
# lr/2, lr and lr_min, exact in float32 for these rates, and step 2 (skipped) at their midpoint.
SGD = OptimConfig(
    optimizer="sgd",
    lr=0.5,
    warmup_steps=2,
    min_lr_ratio=0.25,
    momentum=0.0,
    weight_decay=0.0,
    clip_norm=0.0,
)
SGD_STEPS = 4


def test_a_skipped_batch_advances_the_schedule_bit_for_bit():
    """good, good, NaN, good: steps 0, 1 and 3 apply p ← p − lr(s)·g_s (hand-computed), step 2
    changes nothing, and every reported lr is the rate that was applied."""
    data = mlp_batches(SGD_STEPS, nan_at={2})
    graphdef, run = one_device_run(SGD, SGD_STEPS, data)

    @jax.jit
    def grad(params, rest, batch):
        def loss(p):
            return cross_entropy(nnx.merge(graphdef, p, rest)(batch["inputs"]), batch["targets"])

        return jax.grad(loss)(params)

    lr = [closed_form(s, SGD_STEPS, SGD.warmup_steps, SGD.lr, SGD.min_lr_ratio) for s in range(4)]
    assert lr[0] == SGD.lr / 2 and lr[1] == SGD.lr and lr[3] == SGD.lr * SGD.min_lr_ratio
    assert abs(lr[2] - lr[3]) > 0.1  # an update at step 3 with lr(2) would show
    params, rest = run[0][0].params, run[0][0].rest  # the hand computation, float32 numpy
    for s, (before, after, metrics) in enumerate(run):
        if s == 2:
            assert int(metrics["skipped"]) == 1
            jax.tree.map(np.testing.assert_array_equal, after.params, before.params)
            assert float(metrics["lr"]) == pytest.approx(lr[2], rel=1e-6)
        else:
            assert int(metrics["skipped"]) == 0
            g = jax.device_get(grad(params, rest, data[s]))
            params = jax.tree.map(lambda p, g, s=s: p - np.float32(lr[s]) * g, params, g)
            jax.tree.map(np.testing.assert_array_equal, after.params, params)  # bit for bit
            assert metrics["lr"] == np.float32(lr[s])
            # The rate the update applied, recovered by least squares from Δp = −lr · g.
            dp = flat64(after.params) - flat64(before.params)
            applied = -(dp @ flat64(g)) / (flat64(g) @ flat64(g))
            assert applied == pytest.approx(float(metrics["lr"]), rel=1e-5), s
        assert int(after.step) == s + 1
        counters, _ = counters_and_moments(after.opt_state)
        assert counters and all(int(c) == s + 1 for c in counters)  # count == state.step


@pytest.mark.parametrize("clip_norm", [0.0, 1.0])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_skipped_step_keeps_moments_and_advances_counters(optimizer, clip_norm):
    """good, NaN, good: the NaN step leaves params and every float leaf of the optimizer state
    bit-identical, while every counter advances with the step."""
    config = OptimConfig(optimizer=optimizer, lr=0.1, warmup_steps=2, clip_norm=clip_norm)
    _, run = one_device_run(config, 6, mlp_batches(3, nan_at={1}))
    for s, (before, after, metrics) in enumerate(run):
        counters, moments = counters_and_moments(after.opt_state)
        assert counters and all(int(c) == int(after.step) == s + 1 for c in counters)
        assert int(metrics["skipped"]) == (s == 1)
        pairs = zip(jax.tree.leaves(before.params), jax.tree.leaves(after.params), strict=True)
        moved = [not np.array_equal(a, b) for a, b in pairs]
        if s == 1:
            assert not any(moved)
            for new, old in zip(moments, counters_and_moments(before.opt_state)[1], strict=True):
                np.testing.assert_array_equal(new, old)
        else:
            assert all(np.isfinite(float(metrics[k])) for k in ("loss", "grad_norm"))
            assert any(moved)


def test_adamw_skip_keeps_mu_and_nu_and_advances_both_counts():
    config = OptimConfig(optimizer="adamw", lr=0.1, warmup_steps=0)
    _, run = one_device_run(config, 6, mlp_batches(2, nan_at={1}))
    _, (before, after, metrics) = run
    assert int(metrics["skipped"]) == 1

    def is_adam(x):
        return isinstance(x, optax.ScaleByAdamState)

    def adam_states(opt_state):
        return [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]

    (adam,) = adam_states(after.opt_state)
    (adam_before,) = adam_states(before.opt_state)
    assert int(adam_before.count) == 1 and int(adam.count) == 2
    for name in ("mu", "nu"):
        new, old = getattr(adam, name), getattr(adam_before, name)
        assert any(np.any(x != 0) for x in jax.tree.leaves(old))  # moments from step 0
        jax.tree.map(np.testing.assert_array_equal, new, old)
