"""Synchronising less, the parts every scheme shares: `SyncConfig` and the run check's
refusals, bounded staleness against a hand-run reference, and the ``comm`` state carried
through a checkpoint. The codecs and local SGD have their own files (test_compression.py,
test_local_sgd.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import params_history
from flax import nnx

from meshtrain import layout as S
from meshtrain.check import check_run
from meshtrain.checkpoint import CheckpointConfig
from meshtrain.data import make_arrays_dataset
from meshtrain.layout import batch_shardings
from meshtrain.lower import init_train_state, jit_train_step
from meshtrain.mesh import make_mesh
from meshtrain.models import MLPConfig, build_model
from meshtrain.replicas import SyncConfig, with_sync
from meshtrain.run import RunSpec
from meshtrain.train import TrainConfig, Trainer

MLP = MLPConfig(num_features=8, num_classes=4, d_model=16, d_hidden=32, n_layers=2)
B, STEPS, LR = 16, 6, 0.1
TX = optax.sgd(LR)


def _batches(n=STEPS, seed=0):
    """`n` fresh random classification batches."""
    rng = np.random.default_rng(seed)
    return [
        {
            "inputs": rng.normal(size=(B, MLP.num_features)).astype(np.float32),
            "targets": rng.integers(0, MLP.num_classes, B).astype(np.int32),
        }
        for _ in range(n)
    ]


def _train(mesh_str, strategy, sync, batches, accum=1):
    """Runs `jit_train_step` with `sync` over `batches`; returns each step's parameters."""
    mesh = make_mesh(mesh_str)
    rules = S.rules_for(strategy, mesh)
    ctor = lambda: build_model(MLP)  # noqa: E731 - seed 0 initialisers
    graphdef, state, shardings = init_train_state(ctor, TX, mesh, rules)
    state, shardings = with_sync(sync, TX, state, shardings, mesh, rules)
    batch_sh = batch_shardings(batches[0], mesh, rules)
    run = RunSpec(
        mesh=mesh, rules=rules, sync=sync or SyncConfig(), train=TrainConfig(accum_steps=accum)
    )
    step = jit_train_step(run, graphdef, TX, shardings, batch_sh)
    return params_history(step, state, batches, mesh, rules)


@functools.cache
def _run(mesh_str, strategy, sync, n):
    """`_train` over `_batches(n)`, run once per setting in the file."""
    return _train(mesh_str, strategy, sync, _batches(n))


def _reference_stale(s, batches):
    """Single-device SGD whose update at step t applies the gradient taken at step t - s (the
    gradient jitted, the updates in numpy)."""
    graphdef, params, rest = nnx.split(build_model(MLP), nnx.Param, ...)
    params = jax.device_get(nnx.to_pure_dict(params))

    def loss(p, b):
        logits = nnx.merge(graphdef, p, rest)(b["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    grad = jax.jit(jax.grad(loss))
    history, grads = [params], []
    for t, b in enumerate(batches):
        grads.append(jax.device_get(grad(history[t], b)))
        if t >= s:
            params = jax.tree.map(lambda p, g: p - LR * g, params, grads[t - s])
        history.append(params)
    return history


@pytest.mark.parametrize(
    ("mesh_str", "strategy"), [("data=8", "dp"), ("data=2,fsdp=2,tensor=2", "fsdp+tp")]
)
@pytest.mark.pair("dp", "staleness")
@pytest.mark.pair("fsdp", "staleness")
@pytest.mark.pair("tp", "staleness")
def test_staleness_applies_the_gradient_of_s_steps_before(mesh_str, strategy):
    want = _reference_stale(2, _batches())
    got, state = _run(mesh_str, strategy, SyncConfig(staleness=2), STEPS)
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
            np.testing.assert_allclose(a, b, atol=2e-6, err_msg=f"step {t}")
    # The first two steps only filled the ring.
    for t in (1, 2):
        for a, b in zip(jax.tree.leaves(got[t]), jax.tree.leaves(got[0]), strict=True):
            np.testing.assert_array_equal(a, b)
    assert jax.tree.leaves(state.comm["stale"])[0].shape[0] == 2


def test_staleness_zero_is_the_normal_step():
    """Staleness 0 keeps no ring and takes the plain step's parameters, bit for bit, where a
    stale run (the staleness test's, staleness 2) has moved elsewhere after 3 steps."""
    plain, _ = _run("data=8", "dp", None, 3)
    zero, state = _run("data=8", "dp", SyncConfig(staleness=0), 3)
    assert state.comm == {}
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(zero), strict=True):
        np.testing.assert_array_equal(a, b)
    # and the stale run really differs from it (its first 3 batches are these)
    stale, _ = _run("data=8", "dp", SyncConfig(staleness=2), STEPS)
    assert not np.allclose(jax.tree.leaves(stale[3])[0], jax.tree.leaves(plain[-1])[0])


@pytest.mark.pair("hsdp", "compression")
@pytest.mark.pair("compression", "accumulation")
def test_compressed_step_with_accumulation_matches_one_microbatch_on_hsdp():
    """The manual step accumulates per replica, then compresses once: two microbatches give
    the one-microbatch update up to int8's rounding (a block's values move by at most
    scale/2 = max|g|/254 per quantisation; 2e-3 of the parameters here is far below one LR
    step, 0.1·|g|, and far above fp32 noise)."""
    batches = _batches(2)
    sync = SyncConfig(grad_compression="int8")
    one, state1 = _train("data=4,fsdp=2", "hsdp", sync, batches)
    two, state2 = _train("data=4,fsdp=2", "hsdp", sync, batches, accum=2)
    start, end = jax.tree.leaves(one[0]), jax.tree.leaves(one[-1])
    moved = max(float(np.abs(a - b).max()) for a, b in zip(start, end, strict=True))
    for a, b in zip(end, jax.tree.leaves(two[-1]), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-3)
    assert moved > 1e-2  # the steps really moved the parameters
    res = jax.tree.leaves(state2.comm["residual"])
    assert res[0].shape[0] == 4 and max(float(jnp.abs(r).max()) for r in res) > 0


def _trainer(tmp_path, sync, steps, resume=False):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, MLP.num_features)).astype(np.float32)
    y = rng.integers(0, MLP.num_classes, 256).astype(np.int32)
    data = make_arrays_dataset(x, y, batch_size=B)
    mesh = make_mesh("data=8")
    config = TrainConfig(steps=steps, run_dir=str(tmp_path), progress=False, eval_every=0)
    return Trainer(
        run=RunSpec(
            model=MLP,
            data=data,
            mesh=mesh,
            rules=S.rules_for("dp", mesh),
            train=config,
            sync=sync,
            checkpoint=CheckpointConfig(save_every=3, resume=resume, async_save=False),
        )
    )


@pytest.mark.parametrize(
    "sync",
    [
        SyncConfig(staleness=2),
        SyncConfig(sync_every=2, outer_optimizer="nesterov"),
        SyncConfig(grad_compression="int8"),
        SyncConfig(gossip="exponential", sync_every=4),
        SyncConfig(client_fraction=0.5, sync_every=4, outer_optimizer="adam", outer_lr=0.05),
    ],
    ids=["staleness", "diloco", "int8-residual", "gossip-mid-average", "federated-mid-round"],
)
def test_comm_state_survives_a_checkpoint_and_other_settings_are_refused(tmp_path, sync):
    """A run cut at step 3 saves its ``comm`` state, restores it exactly, and ends where the
    run that went on in memory ends; another sync setting refuses the checkpoint."""
    first = _trainer(tmp_path / "cut", sync, 6)
    first.fit(until=3)
    first.save(wait=True)
    ring = jax.device_get(first.state.comm)
    first.checkpoints.close()
    again = _trainer(tmp_path / "cut", sync, 6, resume=True)
    assert int(again.state.step) == 3
    for a, b in zip(jax.tree.leaves(ring), jax.tree.leaves(again.state.comm), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    # what was saved is not the initial state: gradients in flight, replicas' own parameters
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(ring)) > 0
    again.fit()
    again.checkpoints.close()
    first.checkpoints.close()
    first.checkpoints = None  # the unbroken run: the cut one going on, saving nothing more
    first.fit()
    assert int(first.state.step) == 6
    for a, b in zip(
        jax.tree.leaves(first.state.params), jax.tree.leaves(again.state.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="other synchronisation settings"):
        _trainer(tmp_path / "cut", SyncConfig(), 6, resume=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sync_every": 0}, "sync_every=0: must be a positive integer"),
        ({"staleness": -1}, "staleness=-1: must be an integer ≥ 0"),
        ({"grad_compression": "topk:0"}, "(0, 1], e.g. --grad-compression topk:0.01"),
        ({"grad_compression": "topk:x"}, "top-k fraction must be a number"),
        ({"grad_compression": "int4"}, "choose from none, bf16, int8, topk:FRACTION, sign"),
        ({"outer_optimizer": "lion"}, "choose from average, nesterov, adam"),
        ({"gossip": "star", "sync_every": 4}, "choose from ring, torus, exponential, complete"),
        ({"client_fraction": 0.0, "sync_every": 4}, "client_fraction=0.0"),
        ({"outer_lr": 0.0}, "outer_lr=0.0"),
        ({"outer_momentum": 1.0}, "outer_momentum=1.0"),
    ],
)
def test_bad_settings_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=None) as err:
        SyncConfig(**kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("mesh", "strategy", "sync", "field", "words"),
    [
        ({"fsdp": 8}, "fsdp", SyncConfig(grad_compression="int8"), "grad_compression", "dp, zero1"),
        ({"fsdp": 8}, "fsdp", SyncConfig(sync_every=4), "sync_every", "this layout has none"),
        ({"seq": 2, "data": 2, "tensor": 2}, "dp+tp", SyncConfig(grad_compression="sign"),
         "mesh.seq", "gradient compression with context parallelism beside tensor"),
        ({"data": 8}, "dp", SyncConfig(sync_every=4, grad_compression="bf16"),
         "grad_compression", "drop one"),
        ({"data": 8}, "dp", SyncConfig(sync_every=4, staleness=1), "staleness", "drop one"),
        ({"data": 8}, "dp", SyncConfig(outer_optimizer="nesterov"), "outer_optimizer",
         "add --sync-every"),
        ({"data": 8}, "dp", SyncConfig(gossip="ring"), "sync_every", "add --sync-every"),
        ({"data": 8}, "dp", SyncConfig(gossip="ring", sync_every=4, outer_optimizer="adam"),
         "outer_optimizer", "replicas' mean"),
        ({"data": 6}, "dp", SyncConfig(gossip="exponential", sync_every=4), "gossip",
         "power-of-two"),
        ({"data": 2, "fsdp": 4}, "hsdp", SyncConfig(gossip="torus", sync_every=4), "gossip",
         "two replica axes"),
        ({"data": 1}, "dp", SyncConfig(client_fraction=0.5, sync_every=4), "client_fraction",
         "this layout has none"),
    ],
)  # fmt: skip
def test_the_run_check_refuses_what_cannot_run(mesh, strategy, sync, field, words):
    sizes = {"pipe": 1, "data": 1, "fsdp": 1, "expert": 1, "seq": 1, "tensor": 1, **mesh}
    data = make_arrays_dataset(np.zeros((64, 8), np.float32), np.zeros(64, np.int32), batch_size=16)
    rules = S.rules_for(strategy, sizes)
    no_dir = TrainConfig(run_dir="")  # no run directory to check
    problems = check_run(
        RunSpec(model=MLP, data=data, mesh=sizes, rules=rules, sync=sync, train=no_dir)
    )
    mine = [p for p in problems if p.field == field]
    assert any(words in str(p) for p in mine), problems


def test_hsdp_keeps_replicas_over_data_and_a_residual_per_replica():
    mesh = make_mesh("data=4,fsdp=2")
    rules = S.rules_for("hsdp", mesh)
    sync = SyncConfig(grad_compression="int8")
    graphdef, state, shardings = init_train_state(lambda: build_model(MLP), TX, mesh, rules)
    state, shardings = with_sync(sync, TX, state, shardings, mesh, rules)
    for p, r, sh in zip(
        jax.tree.leaves(state.params),
        jax.tree.leaves(state.comm["residual"]),
        jax.tree.leaves(shardings.comm["residual"]),
        strict=True,
    ):
        assert r.shape == (4, *p.shape) and sh.spec[0] == "data"
        assert r.sharding == sh and float(jnp.abs(r).max()) == 0.0


def test_the_inspector_reads_compressed_gradients_as_the_gradient_reduction():
    """`mt.inspect` of the real step: the codec's collectives land in the gradient-reduction
    bucket at their analytic bytes, unflagged, and int8 sends a quarter of float32's bytes
    over the replica axes (data here; tensor stays with the compiler)."""
    import meshtrain as mt
    from meshtrain.models.base import DataSpec

    cfg = mt.GPTConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16, vocab_size=128)
    spec = DataSpec("lm", 16, 16, 128, None)
    mesh = make_mesh("data=4,tensor=2")
    rules = S.rules_for("dp+tp", mesh)

    def over_data(report):
        return sum(r.wire_bytes for r in report.rows if r.axes == ("data",))

    run = mt.RunSpec(model=cfg, data=spec, mesh=mesh, rules=rules, train=TrainConfig(steps=100))
    plain = mt.inspect(run)
    for scheme, ratio in (("int8", 0.25), ("topk:0.01", None)):
        report = mt.inspect(run.replace(sync=SyncConfig(grad_compression=scheme)))
        assert not report.flags, report.flags
        got = report.measured["gradient reduction"]
        want = report.expectation.bytes["gradient reduction"]
        assert abs(got / want - 1) <= 0.10, (scheme, got, want)
        kinds = {r.kind for r in report.rows if r.axes == ("data",) and r.bytes > 64}
        assert kinds <= {"all-to-all", "all-gather"}, kinds  # no float32 all-reduce left
        if ratio:
            assert abs(over_data(report) / over_data(plain) - ratio) <= 0.1 * ratio
