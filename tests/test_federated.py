"""Federated rounds: client sampling the same on every process and after a resume, weights by
examples, and the weighted mean of the sampled clients over the replica axes."""

import subprocess
import sys

import jax
import numpy as np
import pytest
from _helpers import fresh_env
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.mesh import make_mesh
from meshtrain.replicas import federated


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
    ("args", "needle"),
    [
        ((0.0, 8, 8), "federated.fraction=0.0"),
        ((1.5, 8, 8), "federated.fraction=1.5"),
        ((0.25, 0, 8), "federated.local_steps=0"),
        ((0.25, 8, 1), "federated averaging needs at least 2 clients"),
    ],
)
def test_settings_no_round_can_have_are_one_line_each(args, needle):
    found = federated.problems(*args)
    assert len(found) == 1 and needle in str(found[0]), found
