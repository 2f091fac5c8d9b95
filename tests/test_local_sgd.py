"""Tests for meshtrain.replicas.local_sgd: local SGD with H = 1 is synchronous DP, DiLoCo's outer
step is the Nesterov formula, replicas drift between syncs and meet at each, and a non-finite
replica skips alone.

All runs are float32 on fresh seeded random inputs; tolerances are stated where used.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.comm.hlo import collectives
from meshtrain.layout import activation_rules, batch_shardings, rules_for, shard_batch
from meshtrain.loss import cross_entropy
from meshtrain.mesh import make_mesh, mesh_sizes
from meshtrain.models import MLPConfig, build_model
from meshtrain.replicas import SyncConfig
from meshtrain.replicas.local_sgd import (
    local_init,
    local_shardings,
    local_step,
    outer_optimizer,
)
from meshtrain.replicas.sets import ReplicaSets
from meshtrain.state import TrainState, init_train_state

ROWS = 16  # 2 per replica on 8 replicas, 4 on 4


@dataclasses.dataclass
class Setup:
    """A local-SGD state on a mesh and its jitted step."""

    state: TrainState
    step: object
    mesh: object
    rules: object
    axes: tuple
    n: int
    jitted: object


def setup(
    mesh_str, strategy, ctor, compute, tx, outer_tx, sync_every, schedule=None, **step_kw
) -> Setup:
    """Builds θ̄, the outer state and comm["local"] on the mesh, and the jitted local step
    (`step_kw`: more `SyncConfig` settings, gossip's and federated averaging's)."""
    mesh = make_mesh(mesh_str)
    rules = rules_for(strategy, mesh)
    axes = rules.replica_axes(mesh_sizes(mesh))
    n = int(np.prod([mesh.shape[a] for a in axes]))
    _, state, sh = init_train_state(ctor, tx, mesh, rules)
    replicated = NamedSharding(mesh, P())
    outer_sh = optax.tree_map_params(
        outer_tx,
        lambda _, s: s,
        jax.eval_shape(outer_tx.init, state.params),
        sh.params,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    local_sh = local_shardings(sh.params, sh.opt_state, axes)
    local = jax.jit(local_init, static_argnums=2, out_shardings=local_sh)(
        state.params, state.opt_state, n
    )
    outer_state = jax.jit(outer_tx.init, out_shardings=outer_sh)(state.params)
    comm, comm_sh = {"local": local}, {"local": local_sh}
    if step_kw.get("gossip"):
        comm["consensus"], comm_sh["consensus"] = jnp.zeros((), jnp.float32), replicated
    state = TrainState(state.step, state.params, outer_state, state.rest, comm)
    shardings = TrainState(sh.step, sh.params, outer_sh, sh.rest, comm_sh)
    batch_sh = batch_shardings(batch_of(ctor, 0), mesh, rules)

    def step(state, batch):
        with activation_rules(mesh, rules):
            new, metrics = local_step(
                compute,
                tx,
                outer_tx,
                state,
                batch,
                sets=ReplicaSets(mesh_sizes(mesh), axes, mesh=mesh),
                sync=SyncConfig(sync_every=sync_every, **step_kw),
            )
        if schedule is not None:  # as train_step reports it
            metrics["lr"] = schedule(state.step)
        return new, metrics

    jitted = jax.jit(
        step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, replicated)
    )
    return Setup(
        state, lambda s, b: jitted(s, shard_batch(b, mesh, rules)), mesh, rules, axes, n, jitted
    )


def host(tree):
    """A host (numpy) copy of a tree."""
    return jax.tree.map(np.asarray, tree)


# --- H = 1 with plain averaging is synchronous data parallelism -----------------------------

MLP = MLPConfig(num_features=8, num_classes=4, d_model=32, d_hidden=64, n_layers=1)
INNER = optax.sgd(0.1, momentum=0.9)


def batch_of(ctor, seed):
    """A fresh random batch for the model `ctor` builds (the MLP, or the linear model)."""
    rng = np.random.default_rng(seed)
    if ctor is mlp:
        return {
            "inputs": rng.normal(size=(ROWS, MLP.num_features)).astype(np.float32),
            "targets": rng.integers(0, MLP.num_classes, ROWS, np.int32),
        }
    return {
        "inputs": rng.normal(size=(ROWS, F)).astype(np.float32),
        "targets": rng.normal(size=(ROWS, C)).astype(np.float32),
    }


def mlp():
    return build_model(MLP)


def mlp_compute(graphdef):
    """One replica's loss and gradient for the MLP classifier."""

    def loss_of(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        return cross_entropy(model(batch["inputs"]), batch["targets"]), (rest, {})

    return jax.value_and_grad(loss_of, has_aux=True)


GRAPHDEF = nnx.split(nnx.eval_shape(mlp))[0]

# fp32 tolerances, H = 1 against the single-device step (3 SGD-momentum steps at lr 0.1):
# θ̄ ← θ̄ − (θ̄ − mean_r θ_r) rounds once more than the synchronous step, and the mean runs in
# another order. Measured ≤ 4.5e-8 on parameters and ≤ 2.4e-7 on losses ≈ 1.4; a missing
# replica (mean over n-1) or a doubled update moves parameters by ~1e-2.
PARAM_ATOL = 5e-7
LOSS_ATOL = 1e-6


@pytest.mark.parametrize(
    "mesh_str, strategy",
    # zero1: the inner momentum is split over the replica axes, which comm["local"] moves to dim 0
    [("data=4,fsdp=2", "dp"), ("data=4,tensor=2", "dp+tp"), ("data=8", "zero1")],
)
@pytest.mark.pair("dp", "local-sgd")
@pytest.mark.pair("tp", "local-sgd")
@pytest.mark.pair("zero1", "local-sgd")
def test_sync_every_1_with_averaging_equals_synchronous_dp(mesh_str, strategy):
    compute = mlp_compute(GRAPHDEF)
    run = setup(mesh_str, strategy, mlp, compute, INNER, outer_optimizer("average", 0.7, 0.9), 1)
    params, opt = host(run.state.params), INNER.init(host(run.state.params))

    @jax.jit
    def reference(params, opt, batch):
        (loss, _), grads = compute(params, {}, batch)
        updates, opt = INNER.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    state = run.state
    for i in range(3):
        batch = batch_of(mlp, i)
        state, metrics = run.step(state, batch)
        params, opt, loss = reference(params, opt, batch)
        assert int(metrics["synced"]) == 1 and int(metrics["skipped"]) == 0
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=0, atol=LOSS_ATOL)
        jax.tree.map(
            lambda got, want: np.testing.assert_allclose(got, want, rtol=0, atol=PARAM_ATOL),
            host(state.params),
            host(params),
        )
        local = jax.tree.leaves(state.comm["local"]["params"])
        for leaf, want in zip(
            local, jax.tree.leaves(state.params), strict=True
        ):  # every replica restarts from θ̄
            np.testing.assert_array_equal(np.asarray(leaf), np.broadcast_to(want, leaf.shape))
    assert int(state.step) == 3


# --- DiLoCo on a linear model: H = 4, two synchronisations ----------------------------------

F, C = 6, 3  # features in, values out
H, STEPS = 4, 8
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
SCHEDULE = optax.linear_schedule(0.05, 0.02, STEPS)
INNER_D = optax.sgd(SCHEDULE, momentum=0.5)  # a schedule: its step counter is in the state


class Linear(nnx.Module):
    """y = x W + b."""

    def __init__(self):
        rng = np.random.default_rng(42)
        w = jnp.asarray(rng.normal(size=(F, C)).astype(np.float32))
        self.w = nnx.Param(w, out_sharding=("features", "embed"))
        self.b = nnx.Param(jnp.zeros((C,), jnp.float32), out_sharding=("embed",))


def linear_loss(params, batch):
    pred = batch["inputs"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["targets"]) ** 2)


def linear_compute(params, rest, batch):
    loss, grads = jax.value_and_grad(linear_loss)(params, batch)
    return (loss, (rest, {})), grads


@pytest.fixture(scope="module")
def diloco():
    """8 steps of DiLoCo on data=8, with host copies of the state after each step."""
    outer = outer_optimizer("nesterov", OUTER_LR, OUTER_MOMENTUM)
    run = setup("data=8", "dp", Linear, linear_compute, INNER_D, outer, H, schedule=SCHEDULE)
    state, after = run.state, []
    for i in range(STEPS):
        state, metrics = run.step(state, batch_of(Linear, i))
        after.append((host(state), host(metrics)))
    return run, host(run.state), after


def replica_reference(theta0, n):
    """Each replica's local steps on one device (plain jax + the same inner optax), and the
    outer Nesterov step by hand in numpy. Returns θ̄ after each step and the mean losses."""
    grad = jax.jit(jax.value_and_grad(linear_loss))
    theta_bar = theta0
    velocity = jax.tree.map(np.zeros_like, theta0)
    local = [theta0] * n
    inner = [INNER_D.init(theta0)] * n
    per_step, losses = [], []
    rows = ROWS // n
    for i in range(STEPS):
        batch = batch_of(Linear, i)
        step_losses = []
        for r in range(n):
            mine = {k: v[r * rows : (r + 1) * rows] for k, v in batch.items()}
            loss, g = grad(local[r], mine)
            updates, inner[r] = INNER_D.update(g, inner[r], local[r])
            local[r] = host(optax.apply_updates(local[r], updates))
            step_losses.append(float(loss))
        losses.append(np.mean(step_losses))
        if (i + 1) % H == 0:
            for k in theta_bar:
                delta = theta_bar[k] - np.mean([p[k] for p in local], axis=0)
                velocity[k] = OUTER_MOMENTUM * velocity[k] + delta
                theta_bar[k] = theta_bar[k] - OUTER_LR * (delta + OUTER_MOMENTUM * velocity[k])
            theta_bar = dict(theta_bar)
            local = [theta_bar] * n
        per_step.append(dict(theta_bar))
    return per_step, losses


@pytest.mark.pair("dp", "diloco")
def test_diloco_outer_step_is_the_nesterov_formula(diloco):
    run, start, after = diloco
    want, losses = replica_reference(dict(start.params), run.n)
    # fp32: measured 0 on θ̄ and ≤ 3.3e-7 on the mean loss (summed in another order); a wrong
    # momentum term (plain instead of Nesterov) moves θ̄ by ~1e-2.
    for i, (state, metrics) in enumerate(after):
        for k in want[i]:
            np.testing.assert_allclose(state.params[k], want[i][k], rtol=0, atol=1e-6)
        np.testing.assert_allclose(metrics["loss"], losses[i], rtol=0, atol=1e-6)
        assert metrics["synced"] == ((i + 1) % H == 0)
        np.testing.assert_allclose(metrics["lr"], SCHEDULE(i), rtol=1e-7)
    assert not np.allclose(after[H - 1][0].params["w"], start.params["w"])


def test_replicas_drift_between_syncs_and_meet_at_each(diloco):
    _, start, after = diloco
    for i, (state, _) in enumerate(after):
        local = state.comm["local"]["params"]
        if (i + 1) % H:  # between syncs: θ̄ stays put and the replicas differ
            theta = after[i - i % H - 1][0].params if i >= H else start.params
            for k in theta:
                np.testing.assert_array_equal(state.params[k], theta[k])
            assert min(np.abs(local["w"][r] - local["w"][0]).max() for r in range(1, 8)) > 1e-4
        else:  # right after a sync: every replica is at the new θ̄
            for k in state.params:
                for r in range(local[k].shape[0]):
                    np.testing.assert_array_equal(local[k][r], state.params[k])
        # inner states stay per replica: the momenta differ across replicas at every step
        trace = state.comm["local"]["opt_state"][0].trace["w"]
        assert np.abs(trace[1] - trace[0]).max() > 1e-5


def test_a_nonfinite_replica_skips_alone(diloco):
    run, start, _ = diloco
    batch = batch_of(Linear, 0)
    batch["inputs"][3 * 2] = np.nan  # a row of replica 3 (2 rows each)
    state, metrics = run.step(jax.tree.map(jnp.asarray, start), batch)
    local, opt = host(state.comm["local"]["params"]), host(state.comm["local"]["opt_state"])
    assert int(metrics["skipped"]) == 1
    for k in local:
        np.testing.assert_array_equal(local[k][3], start.params[k])  # kept
        assert not np.allclose(local[k][0], start.params[k])  # the others stepped
    np.testing.assert_array_equal(opt[0].trace["w"][3], 0.0)  # moments kept, not NaN
    np.testing.assert_array_equal(opt[1].count, 1)  # every replica's step counter advances
    for k in state.params:  # step 1 is no sync
        np.testing.assert_array_equal(np.asarray(state.params[k]), start.params[k])


def test_parameters_cross_the_wire_only_on_a_sync_step(diloco):
    run, start, _ = diloco
    batch = shard_batch(batch_of(Linear, 0), run.mesh, run.rules)
    hlo = run.jitted.lower(jax.tree.map(jnp.asarray, start), batch).compile().as_text()
    found = collectives(hlo, 8)
    in_sync = [c for c in found if "/cond/" in c.op_name]
    every_step = [c for c in found if c not in in_sync]
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(start.params))
    # The outer step's mean of θ_r: one all-reduce of the parameters, inside the conditional.
    assert {c.kind for c in in_sync} == {"all-reduce"}
    assert sum(c.result_bytes for c in in_sync) == param_bytes
    # Every step: the scalar metrics only (loss, grad norm, skipped).
    assert every_step and all(c.result_bytes <= 8 for c in every_step), every_step
    # The HLO reader marks what runs only in a conditional's branch (benchmarks/sync.py
    # counts those 1/H per step).
    assert all(c.conditional for c in in_sync)
    assert not any(c.conditional for c in every_step)


# --- bad input ------------------------------------------------------------------------------


def test_unknown_outer_optimizer_is_one_clear_line():
    with pytest.raises(ValueError) as err:
        outer_optimizer("lion", 0.7, 0.9)
    message = str(err.value)
    assert "\n" not in message
    assert "outer_optimizer='lion'" in message and "average" in message and "nesterov" in message


def test_sync_every_0_is_refused_before_tracing(diloco):
    run, start, _ = diloco
    with pytest.raises(ValueError, match=r"sync_every=0: .*positive integer"):
        local_step(
            linear_compute,
            INNER_D,
            optax.sgd(1.0),
            start,
            batch_of(Linear, 0),
            sets=ReplicaSets(mesh_sizes(run.mesh), run.axes, mesh=run.mesh),
            sync=0,
        )
