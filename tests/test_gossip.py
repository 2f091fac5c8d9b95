"""Gossip mixing over the replica axes: each topology's step is its mixing matrix applied to
the replicas' values, through collective permutes only, with bytes independent of the replica
count; the exponential graph reaches exact consensus in log₂ m steps."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import load_benchmark
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.comm.hlo import collectives
from meshtrain.mesh import make_mesh
from meshtrain.replicas import gossip
from meshtrain.replicas.local_sgd import outer_optimizer


def _oracle(topology, sizes, step):
    """W written from each topology's definition, independently of `gossip`."""
    dims = tuple(sizes.values())
    m = math.prod(dims)
    w = np.zeros((m, m))
    index = {c: i for i, c in enumerate(itertools.product(*map(range, dims)))}
    for c, r in index.items():
        if topology == "complete":
            w[r] = 1 / m
        elif topology == "ring":
            for d in (0, 1, -1) if m > 2 else (0, 1):
                w[r, (r - d) % m] += 1 / 3 if m > 2 else 1 / 2
        elif topology == "exponential":
            k = step % int(math.log2(m))
            w[r, r] += 1 / 2
            w[r, (r - 2**k) % m] += 1 / 2
        elif topology == "torus":
            w[r, r] += 1 / 5
            for dim, d in itertools.product(range(2), (1, -1)):
                n = list(c)
                n[dim] = (n[dim] + d) % dims[dim]
                w[r, index[tuple(n)]] += 1 / 5
    return w


def _mixed(topology, sizes, x, steps):
    """The replicas' rows of `x` after mixing steps `steps` (traced), on a mesh of `sizes`."""
    m = math.prod(sizes.values())
    mesh = make_mesh(",".join(f"{a}={s}" for a, s in sizes.items()), devices=jax.devices()[:m])
    axes = tuple(sizes)
    spec = P(axes if len(axes) > 1 else axes[0])

    def body(rows, ts):
        for i in range(len(steps)):
            rows = gossip.mix(rows, topology, sizes, ts[i])
        return rows

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec))
    rows = jax.device_put(x, NamedSharding(mesh, spec))
    return np.asarray(fn(rows, jnp.asarray(steps, jnp.int32))), fn, (rows, steps)


CASES = [
    ("ring", {"data": 8}),
    ("ring", {"data": 2}),
    ("ring", {"data": 2, "fsdp": 4}),
    ("torus", {"data": 2, "fsdp": 4}),
    ("exponential", {"data": 8}),
    ("exponential", {"data": 4}),
    ("complete", {"data": 4}),
]


@pytest.mark.parametrize(("topology", "sizes"), CASES)
def test_each_mixing_step_is_its_matrix_applied_to_the_replicas(topology, sizes):
    m = math.prod(sizes.values())
    x = np.random.default_rng().normal(size=(m, 5)).astype(np.float32)
    for step in range(gossip.period(topology, sizes) + 1):
        w = _oracle(topology, sizes, step)
        np.testing.assert_allclose(gossip.matrix(topology, sizes, step), w, atol=1e-12)
        np.testing.assert_allclose(w.sum(0), 1, atol=1e-12)  # doubly stochastic
        np.testing.assert_allclose(w.sum(1), 1, atol=1e-12)
        got, _, _ = _mixed(topology, sizes, x, [step])
        np.testing.assert_allclose(got, w @ x, rtol=1e-6, atol=1e-6)


def test_the_complete_graph_averages_every_replica():
    x = np.random.default_rng().normal(size=(8, 3)).astype(np.float32)
    got, _, _ = _mixed("complete", {"data": 8}, x, [0])
    np.testing.assert_allclose(got, np.broadcast_to(x.mean(0), x.shape), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_the_exponential_graph_reaches_consensus_in_log2_m_steps(m):
    rng = np.random.default_rng()
    x = (rng.normal() + rng.normal(size=(m, 4))).astype(np.float32)  # a constant plus offsets
    steps = int(math.log2(m))
    got, _, _ = _mixed("exponential", {"data": m}, x, list(range(steps)))
    np.testing.assert_allclose(got, np.broadcast_to(x.mean(0), x.shape), rtol=1e-6, atol=1e-6)
    if steps > 1:  # one step fewer is not yet consensus
        early, _, _ = _mixed("exponential", {"data": m}, x, list(range(steps - 1)))
        assert np.abs(early - x.mean(0)).max() > 1e-2


@pytest.mark.parametrize("topology", ["ring", "exponential", "torus"])
def test_a_mixing_step_sends_the_same_bytes_over_permutes_alone_whatever_the_replicas(topology):
    sent = {}
    for m in (2, 4, 8) if topology != "torus" else (4, 8):
        sizes = {"data": m} if topology != "torus" else {"data": 2, "fsdp": m // 2}
        x = np.zeros((m, 1024), np.float32)
        _, fn, args = _mixed(topology, sizes, x, [0])
        found = collectives(fn.lower(*args).compile().as_text(), m)
        assert {c.kind for c in found} == {"collective-permute"}, found
        sent[m] = sum(c.wire_bytes * c.count for c in found if not c.conditional)
        sent[m] += max((c.wire_bytes for c in found if c.conditional), default=0)
        assert sent[m] == gossip.sent_per_step(topology, sizes) * 1024 * 4
    if topology != "torus":  # constant in m for a fixed degree (m = 2: the ring's one peer)
        assert sent[4] == sent[8]


def test_consensus_distance_is_the_mean_distance_to_the_average():
    sizes = {"data": 4}
    x = np.random.default_rng().normal(size=(4, 6)).astype(np.float32)
    mesh = make_mesh("data=4", devices=jax.devices()[:4])
    fn = jax.shard_map(
        lambda r: gossip.consensus_distance({"w": r}, ("data",)),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
    )
    got = float(jax.jit(fn)(jax.device_put(x, NamedSharding(mesh, P("data")))))
    want = np.mean(np.linalg.norm(x - x.mean(0), axis=1))
    assert got == pytest.approx(want, rel=1e-5)
    assert gossip.sent_per_step("torus", {"data": 2, "fsdp": 4}) == 3  # data ±1: one peer
    assert gossip.sent_per_step("complete", sizes) == 3


@pytest.mark.parametrize(
    ("topology", "sizes", "needle"),
    [
        ("star", {"data": 8}, "sync.gossip='star': choose from ring, torus, exponential"),
        ("ring", {}, "needs at least 2 replicas; the replica axes give 1"),
        ("torus", {"data": 8}, "needs two replica axes of size ≥ 2"),
        ("exponential", {"data": 2, "fsdp": 3}, "needs a power-of-two number of replicas"),
    ],
)
def test_a_topology_the_replicas_cannot_form_is_one_line(topology, sizes, needle):
    found = gossip.problems(topology, sizes)
    assert len(found) == 1 and needle in str(found[0]), found
    with pytest.raises(ValueError, match="sync.gossip="):
        gossip.terms(topology, sizes)


def test_the_gossip_benchmark_prints_the_compiled_bytes_beside_the_model(capsys):
    import json

    bench = load_benchmark("gossip")
    assert bench.main(["--params-mb", "0.004", "--topologies", "ring", "torus"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [(x["topology"], x["replicas"]) for x in lines] == [
        ("ring", 2), ("ring", 4), ("ring", 8), ("torus", 4), ("torus", 8)
    ]  # fmt: skip
    for x in lines:
        assert x["collectives"] == ["collective-permute"]
        assert x["sent_bytes_per_step"] == x["analytic_bytes_per_step"] > 0
        assert x["modelled_s"] > 0 and x["device_profile"] == "h100"
    assert lines[1]["sent_bytes_per_step"] == lines[2]["sent_bytes_per_step"]


# --- gossip in the replicas' step -----------------------------------------------------------

STEPS, H = 4, 2  # θ̄ formed every 2 steps


def _linear_reference(theta0, n, topology, sizes, inner):
    """Each replica's local steps on one device (plain jax + the same optax), then the mixing
    matrix applied in numpy (adapt, then combine); θ̄ and the consensus distance at each H."""
    from test_local_sgd import ROWS, Linear, batch_of, host, linear_loss

    grad = jax.jit(jax.grad(linear_loss))
    local, opt = [theta0] * n, [inner.init(theta0)] * n
    rows, out = ROWS // n, []
    for i in range(STEPS):
        batch = batch_of(Linear, i)
        for r in range(n):
            mine = {k: v[r * rows : (r + 1) * rows] for k, v in batch.items()}
            updates, opt[r] = inner.update(grad(local[r], mine), opt[r], local[r])
            local[r] = host(optax.apply_updates(local[r], updates))
        w = gossip.matrix(topology, sizes, i)
        local = [
            {k: sum(w[r, j] * local[j][k] for j in range(n)) for k in theta0} for r in range(n)
        ]
        mean = {k: np.mean([p[k] for p in local], axis=0) for k in theta0}
        gaps = [math.sqrt(sum(np.sum((p[k] - mean[k]) ** 2) for k in theta0)) for p in local]
        out.append((list(local), mean, float(np.mean(gaps))))
    return out


@pytest.mark.parametrize(
    ("topology", "mesh_str", "sizes"),
    [
        ("ring", "data=8", {"data": 8}),
        ("exponential", "data=8", {"data": 8}),
        ("torus", "data=2,fsdp=4", {"data": 2, "fsdp": 4}),
    ],
)
@pytest.mark.pair("dp", "gossip")
def test_each_step_is_a_local_step_then_the_mixing_matrix(topology, mesh_str, sizes):
    from test_local_sgd import Linear, batch_of, host, linear_compute, setup

    inner = optax.sgd(0.05, momentum=0.5)
    outer = outer_optimizer("average", 0.7, 0.9)
    run = setup(mesh_str, "dp", Linear, linear_compute, inner, outer, H, gossip=topology)
    start = host(run.state.params)
    want = _linear_reference(dict(start), run.n, topology, sizes, inner)
    state, theta = run.state, start
    # fp32 rounding of values ~0.1-1; a wrong neighbour or weight moves the replicas by ~1e-2.
    for i in range(STEPS):
        state, metrics = run.step(state, batch_of(Linear, i))
        local, mean, gap = want[i]
        got = host(state.comm["local"]["params"])
        for k in start:
            np.testing.assert_allclose(got[k], np.stack([p[k] for p in local]), atol=1e-6)
        if (i + 1) % H == 0:  # θ̄ is the replicas' mean; they go on from their own
            theta = mean
            np.testing.assert_allclose(float(metrics["consensus"]), gap, rtol=1e-4)
        for k in start:
            np.testing.assert_allclose(np.asarray(state.params[k]), theta[k], atol=1e-6)
    assert gap > 1e-4  # the replicas really differ: the mixing is not a full average


@pytest.mark.pair("dp", "gossip")
def test_gossip_over_the_complete_graph_is_synchronous_averaging():
    """Uniform weights over every replica after each local step: the replicas stay equal, and
    equal synchronous DP with the same SGD-momentum optimizer (its update is linear in the
    gradient, so the mean of the replicas' updates is the synchronous one)."""
    from test_local_sgd import GRAPHDEF, INNER, batch_of, host, mlp, mlp_compute, setup

    compute = mlp_compute(GRAPHDEF)
    outer = outer_optimizer("average", 0.7, 0.9)
    run = setup("data=8", "dp", mlp, compute, INNER, outer, H, gossip="complete")
    params, opt = host(run.state.params), INNER.init(host(run.state.params))

    @jax.jit
    def reference(params, opt, batch):
        (loss, _), grads = compute(params, {}, batch)
        updates, opt = INNER.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    state = run.state
    for i in range(STEPS):
        batch = batch_of(mlp, i)
        state, metrics = run.step(state, batch)
        params, opt = reference(params, opt, batch)
        # fp32: the weighted sum of 8 permuted copies rounds in another order than the mean.
        local = host(state.comm["local"]["params"])
        jax.tree.map(
            lambda got, want: np.testing.assert_allclose(
                got, np.broadcast_to(want, got.shape), rtol=0, atol=5e-7
            ),
            local,
            host(params),
        )
    np.testing.assert_allclose(float(metrics["consensus"]), 0.0, atol=1e-5)
    jax.tree.map(
        lambda got, want: np.testing.assert_allclose(got, want, rtol=0, atol=5e-7),
        host(state.params),
        host(params),
    )


def test_the_run_summary_names_the_graph_and_when_the_mean_is_formed():
    from meshtrain.replicas import SyncConfig

    assert SyncConfig(gossip="torus", sync_every=50).summary() == [
        "gossip over the torus graph every step, the replicas' mean every 50 steps"
    ]
