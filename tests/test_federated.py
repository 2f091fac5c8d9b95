"""Federated rounds: client sampling the same on every process and after a resume, weights by
examples, and the weighted mean of the sampled clients over the replica axes."""

import json
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from _helpers import fresh_env, load_benchmark
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.mesh import make_mesh
from meshtrain.problem import RunCheckError
from meshtrain.replicas import SyncConfig, federated
from meshtrain.replicas.local_sgd import outer_optimizer


def test_a_round_samples_its_share_of_clients_from_its_round_and_seed_alone():
    seed = int(np.random.default_rng().integers(1 << 30))
    rounds = [federated.sampled_clients(r, 8, 0.25, seed) for r in range(200)]
    assert all(len(s) == 2 and len(set(s)) == 2 and s.min() >= 0 and s.max() < 8 for s in rounds)
    # a resumed run (round 150 first) draws what the uninterrupted one drew
    np.testing.assert_array_equal(federated.sampled_clients(150, 8, 0.25, seed), rounds[150])
    assert len({tuple(s) for s in rounds}) > 10  # rounds differ
    counts = np.bincount(np.concatenate(rounds), minlength=8)
    assert counts.min() > 20 and counts.max() < 80  # each about 200 · 2/8 = 50 times (sd 6.6)
    np.testing.assert_array_equal(federated.sampled_clients(3, 8, 1.0, seed), np.arange(8))
    assert federated.clients_per_round(8, 0.01) == 1 and federated.clients_per_round(10, 0.3) == 3


def test_every_process_samples_the_same_clients():
    code = (
        "from meshtrain.replicas import federated;"
        "print([federated.sampled_clients(r, 16, 0.25, 7).tolist() for r in range(5)])"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", code], env=fresh_env(), capture_output=True, text=True
        ).stdout
        for _ in range(2)
    ]
    here = str([federated.sampled_clients(r, 16, 0.25, 7).tolist() for r in range(5)])
    assert outs[0].strip() == outs[1].strip() == here


def test_round_weights_are_the_sampled_clients_examples_share():
    rng = np.random.default_rng()
    examples = rng.integers(1, 100, 8)
    sampled = federated.sampled_clients(0, 8, 0.5, int(rng.integers(1000)))
    w = federated.round_weights(sampled, examples)
    assert w.sum() == pytest.approx(1.0, rel=1e-6)
    others = np.setdiff1d(np.arange(8), sampled)
    assert np.all(w[others] == 0)
    np.testing.assert_allclose(w[sampled], examples[sampled] / examples[sampled].sum(), rtol=1e-6)


def test_the_weighted_mean_over_the_replicas_is_the_servers_average():
    rng = np.random.default_rng()
    deltas = rng.normal(size=(8, 5)).astype(np.float32)
    examples = rng.integers(1, 50, 8)
    w = federated.round_weights(federated.sampled_clients(1, 8, 0.5, 3), examples)
    mesh = make_mesh("data=2,fsdp=4")
    spec = P(("data", "fsdp"))
    fn = jax.jit(
        jax.shard_map(
            lambda d, wk: federated.weighted_mean(d, wk[0], ("data", "fsdp")),
            mesh=mesh,
            in_specs=(spec, spec),
            out_specs=P(),
        )
    )
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    got = np.asarray(fn(put(deltas), put(w)))
    np.testing.assert_allclose(got[0], w @ deltas, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"client_fraction": 0.0, "sync_every": 8}, "client_fraction=0.0"),
        ({"client_fraction": 1.5, "sync_every": 8}, "client_fraction=1.5"),
    ],
)
def test_settings_no_round_can_have_are_one_line_each(settings, needle):
    with pytest.raises(RunCheckError) as e:
        SyncConfig(**settings)
    assert len(e.value.problems) == 1 and needle in str(e.value.problems[0]), e.value.problems


# --- federated rounds in the replicas' step -------------------------------------------------

ROUNDS, H = 2, 2


@pytest.mark.pair("dp", "federated")
def test_fraction_1_one_local_step_and_sgd_everywhere_is_synchronous_sgd():
    from test_local_sgd import GRAPHDEF, batch_of, host, mlp, mlp_compute, setup

    inner = optax.sgd(0.1)
    compute = mlp_compute(GRAPHDEF)
    outer = outer_optimizer("average", 0.7, 0.9)  # server SGD with rate 1
    run = setup("data=8", "dp", mlp, compute, inner, outer, 1, client_fraction=1.0)
    params = host(run.state.params)

    @jax.jit
    def reference(params, batch):
        (_, _), grads = compute(params, {}, batch)
        return optax.apply_updates(params, inner.update(grads, inner.init(params), params)[0])

    state = run.state
    for i in range(3):
        batch = batch_of(mlp, i)
        state, metrics = run.step(state, batch)
        params = reference(params, batch)
        assert int(metrics["synced"]) == 1
        # fp32: θ̄ − (θ̄ − mean θ_r) rounds once more than the synchronous step.
        jax.tree.map(
            lambda got, want: np.testing.assert_allclose(got, want, rtol=0, atol=5e-7),
            host(state.params),
            host(params),
        )


@pytest.mark.pair("dp", "federated")
def test_a_round_applies_the_sampled_clients_mean_change_through_the_server_optimizer():
    """Two rounds of two local steps on data=8 with a quarter of the clients sampled, SGD-
    momentum clients (fresh moments each round) and FedAdam on the server, against each
    client's steps on one device and the server step by hand."""
    from test_local_sgd import ROWS, Linear, batch_of, host, linear_compute, linear_loss, setup

    inner = optax.sgd(0.05, momentum=0.5)
    outer = outer_optimizer("adam", 0.05, 0.9)
    seed = int(np.random.default_rng().integers(1000))
    run = setup("data=8", "dp", Linear, linear_compute, inner, outer, H, client_fraction=0.25,
                client_seed=seed)  # fmt: skip
    theta = host(run.state.params)
    server = outer.init(theta)
    grad = jax.jit(jax.grad(linear_loss))
    n, rows = run.n, ROWS // run.n
    state = run.state
    for rnd in range(ROUNDS):
        local = [theta] * n
        opt = [inner.init(theta) for _ in range(n)]
        for j in range(H):
            batch = batch_of(Linear, rnd * H + j)
            state, _ = run.step(state, batch)
            for r in range(n):
                mine = {k: v[r * rows : (r + 1) * rows] for k, v in batch.items()}
                updates, opt[r] = inner.update(grad(local[r], mine), opt[r], local[r])
                local[r] = host(optax.apply_updates(local[r], updates))
        chosen = federated.sampled_clients(rnd, n, 0.25, seed)
        assert len(chosen) == 2
        delta = {k: theta[k] - np.mean([local[c][k] for c in chosen], axis=0) for k in theta}
        updates, server = outer.update(delta, server, theta)
        theta = host(optax.apply_updates(theta, updates))
        # fp32; a client counted that was not sampled moves θ̄ by ~1e-3 here.
        for k in theta:
            np.testing.assert_allclose(np.asarray(state.params[k]), theta[k], atol=2e-6)
        every = host(state.comm["local"]["params"])  # every client restarts from θ̄
        for k in theta:
            want = np.broadcast_to(state.params[k], every[k].shape)
            np.testing.assert_array_equal(every[k], want)
    others = [c for c in range(n) if c not in chosen]
    assert np.abs(local[others[0]]["w"] - theta["w"]).max() > 1e-3  # unsampled work is real


def test_the_run_summary_names_the_round_and_the_server_optimizer():
    sync = SyncConfig(client_fraction=0.25, sync_every=8, outer_optimizer="adam", outer_lr=0.01)
    assert sync.summary() == [
        "federated averaging: 0.25 of the clients per round of 8 local steps, server Adam, "
        "lr 0.01, β₁ 0.9"
    ]


def test_the_convergence_benchmark_prints_a_line_per_scheme_with_its_compiled_bytes(capsys):
    bench = load_benchmark("decentralized")
    bench.main(["--task", "digits", "--steps", "4", "--only", "gossip-exponential,fedavg-alpha0.1"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["scheme"] for x in lines] == ["gossip-exponential", "fedavg-alpha0.1"]
    gossip_line, fed = lines
    # one peer's parameters every step, plus a tenth of the mean's all-reduce
    assert gossip_line["mixing_bytes_per_step"] > 0 and gossip_line["averaging_bytes_per_step"] > 0
    assert fed["mixing_bytes_per_step"] == 0 and fed["skew"] > 0.4  # Dirichlet(0.1) by label
    assert all(np.isfinite(x["eval_loss"]) and 0 <= x["accuracy"] <= 1 for x in lines)
