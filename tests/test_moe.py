"""Mixture of experts: expert-parallel dispatch (capacity and dropless) equals the one-device
math in the loss and every gradient; drops are counted exactly and dropped tokens pass through
unchanged; the router losses match their closed forms (Mixtral's pooled over the blocks and
the real tokens, exactly so in gpipe and circular pipelines over expert and data); checkpoints
reshard bit-equal; bad settings are one clear line before anything compiles; the CLI trains an
MoE over ``expert``."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _pipeline_helpers import LOSS_RTOL, assert_close, random_params
from flax import nnx

from meshtrain import checkpoint as ckpt
from meshtrain import cli
from meshtrain.check import check_run
from meshtrain.checkpoint import CheckpointManager
from meshtrain.layout import (
    activation_rules,
    batch_shardings,
    named,
    rules_for,
    shard_batch,
    state_specs,
)
from meshtrain.lower import init_train_state, jit_train_step
from meshtrain.mesh import make_mesh
from meshtrain.models import DataSpec, MoEConfig, build_model
from meshtrain.models.moe import Experts
from meshtrain.models.moe_dispatch import dispatch
from meshtrain.models.moe_routing import (
    load_balance_loss,
    load_stats,
    pooled_load_balance_loss,
    route,
    router_sums,
    z_loss,
)
from meshtrain.optim import OptimConfig, make_optimizer
from meshtrain.pipeline import PipelineConfig
from meshtrain.run import RunSpec, TrainConfig
from meshtrain.state import TrainState, abstract_target, abstract_train_state
from meshtrain.train.step import train_step

# One worker builds the module-scoped reference run(s) for all of them (under --dist loadgroup).
pytestmark = pytest.mark.xdist_group("moe")

B, T, D = 8, 8, 32
# capacity_factor = n_experts: every expert has room for every choice, so nothing drops.
LAYER = MoEConfig(d_model=D, n_heads=2, n_experts=8, top_k=2, d_expert=16, capacity_factor=8.0)


def _mesh(spec: str, strategy: str = "fsdp"):
    n = int(np.prod([int(kv.split("=")[1]) for kv in spec.split(",")]))
    mesh = make_mesh(spec, devices=jax.devices()[:n])
    return mesh, rules_for(strategy, mesh)


def _split(ctor):
    """``(graphdef, state)`` of the module `ctor` builds, its values initialised in one
    compiled program (built eagerly, each initialiser would be a program of its own)."""
    graphdef, state = nnx.split(nnx.eval_shape(ctor))
    nnx.replace_by_pure_dict(state, jax.jit(lambda: nnx.to_pure_dict(nnx.state(ctor())))())
    return graphdef, state


def _placed(state, mesh, rules):
    """`state` laid out on `mesh` by the parameter rules."""
    specs = state_specs(state, rules.params, mesh, warn=False)
    return jax.device_put(nnx.to_pure_dict(state), named(specs, mesh))


def _layer_losses(graphdefs, mesh=None, rules=None):
    """jit(state, x) → per dispatch kind: (loss, grads wrt state and x) of one MoE layer, the
    loss mixing its output with the aux and z losses (so the router gets gradients)."""

    def loss(graphdef, state, x_BTD, *, r_BTD):
        y_BTD, stats = nnx.merge(graphdef, state)(x_BTD)
        return jnp.sum(y_BTD * r_BTD) + stats["aux_loss"] + 0.1 * stats["z_loss"], stats

    def both(state, x_BTD, r_BTD):
        out = {}
        for kind, graphdef in graphdefs.items():
            fn = jax.value_and_grad(functools.partial(loss, graphdef, r_BTD=r_BTD), (0, 1), True)
            if mesh is None:
                out[kind] = fn(state, x_BTD)
            else:
                with activation_rules(mesh, rules):
                    out[kind] = fn(state, x_BTD)
        return out

    return jax.jit(both)


@pytest.fixture(scope="module")
def layer():
    """Graphdefs of one MoE layer per dispatch kind (same parameters), its state, inputs and
    the one-device results."""
    graphdefs, state = {}, None
    for kind in ("capacity", "dropless"):
        cfg = dataclasses.replace(LAYER, dispatch=kind)
        graphdefs[kind], state = _split(lambda cfg=cfg: Experts(cfg, rngs=nnx.Rngs(0)))
    kx, kr = jax.random.split(jax.random.key(1))
    x_BTD = jax.random.normal(kx, (B, T, D))
    r_BTD = jax.random.normal(kr, (B, T, D))
    reference = _layer_losses(graphdefs)(nnx.to_pure_dict(state), x_BTD, r_BTD)
    return graphdefs, state, x_BTD, r_BTD, reference


@pytest.mark.parametrize(
    ("spec", "strategy"),
    [
        ("expert=8", "dp"),
        ("data=2,expert=2,tensor=2", "dp+tp"),
        ("fsdp=2,expert=4", "fsdp"),
    ],
)
@pytest.mark.pair("dp", "moe-capacity")
@pytest.mark.pair("dp", "moe-dropless")
@pytest.mark.pair("tp", "moe-capacity")
@pytest.mark.pair("tp", "moe-dropless")
@pytest.mark.pair("fsdp", "moe-capacity")
@pytest.mark.pair("fsdp", "moe-dropless")
def test_expert_parallel_loss_and_grads_equal_one_device(layer, spec, strategy):
    graphdefs, state, x_BTD, r_BTD, reference = layer
    mesh, rules = _mesh(spec, strategy)
    with jax.set_mesh(mesh):
        got = _layer_losses(graphdefs, mesh, rules)(_placed(state, mesh, rules), x_BTD, r_BTD)
    for kind in graphdefs:
        (loss, stats), grads = got[kind]
        (want, want_stats), want_grads = reference[kind]
        assert float(stats["dropped_fraction"]) == 0.0
        np.testing.assert_allclose(loss, want, rtol=1e-5, err_msg=kind)
        leaves = jax.tree_util.tree_leaves_with_path(grads)
        assert len(leaves) == 5  # router, gate, up, down, and x
        for (where, g), w in zip(leaves, jax.tree.leaves(want_grads), strict=True):
            assert float(jnp.max(jnp.abs(w))) > 0, where  # every gradient is live
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"{kind} {where}")
        # The expert weights really are split over `expert`.
        if "expert" in spec:
            gate = got[kind][1][0]["gate"]
            assert gate.sharding.shard_shape(gate.shape)[0] == 8 // mesh.shape["expert"]


@pytest.mark.pair("fsdp", "moe-capacity")
@pytest.mark.pair("tp", "moe-capacity")
def test_model_loss_and_grads_equal_one_device_on_a_hybrid_mesh():
    cfg = MoEConfig(
        d_model=32, n_heads=2, n_experts=4, top_k=2, d_expert=32, moe_every=2, n_layers=2,
        vocab_size=64, vocab_multiple=16, max_seq_len=16, shared_expert=16,
        capacity_factor=4.0,
    )  # fmt: skip
    graphdef, state = _split(lambda: build_model(cfg, seed=0))
    tokens = jax.random.randint(jax.random.key(2), (B, T), 0, 64)

    def loss(state, mesh=None, rules=None):
        def fn(s):
            out = nnx.merge(graphdef, s)(tokens)
            ce = -jnp.mean(jax.nn.log_softmax(out.logits)[..., 0])
            return ce + out.aux_loss, out.metrics

        if mesh is None:
            return jax.value_and_grad(fn, has_aux=True)(state)
        with activation_rules(mesh, rules):
            return jax.value_and_grad(fn, has_aux=True)(state)

    (want, want_m), want_g = jax.jit(loss)(nnx.to_pure_dict(state))
    mesh, rules = _mesh("expert=2,fsdp=2,tensor=2", "fsdp+tp")
    with jax.set_mesh(mesh):
        (got, got_m), got_g = jax.jit(lambda s: loss(s, mesh, rules))(_placed(state, mesh, rules))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert float(got_m["moe_dropped_fraction"]) == 0.0
    for k in want_m:
        np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5, err_msg=k)
    for (where, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g), strict=True
    ):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(where))


def _constructed_logits(n_experts=4):
    """Router logits [2, T, E] with a known routing: in row 0 every token prefers expert 0
    (then 1); in row 1 token t prefers expert t mod E (then the next one)."""
    logits = np.full((2, T, n_experts), -1.0, np.float32)
    logits[0, :, 0], logits[0, :, 1] = 3.0, 1.0
    for t in range(T):
        logits[1, t, t % n_experts], logits[1, t, (t + 1) % n_experts] = 2.0, 0.5
    return jnp.asarray(logits)


@pytest.mark.parametrize("spec", [None, "expert=2"])
def test_capacity_drops_exactly_the_overflow_and_dropped_tokens_pass_through(spec):
    E, k, factor = 4, 2, 1.0
    logits = _constructed_logits(E)
    slots = MoEConfig(n_experts=E, top_k=k, capacity_factor=factor).capacity_slots(T)
    assert slots == 4  # ⌈1.0 · 8 · 2 / 4⌉
    routing = route(logits, k, renormalize=True, capacity_slots=slots)
    # Row 0: 8 first choices to expert 0 and 8 second choices to expert 1, 4 slots each: the
    # first 4 tokens keep both choices, the last 4 keep none. Row 1: 4 choices per expert.
    want_keep = np.zeros((2, T, k), bool)
    want_keep[0, :4] = True
    want_keep[1] = True
    np.testing.assert_array_equal(routing.keep_BTK, want_keep)
    stats = load_stats(routing, E)
    assert float(stats["dropped_fraction"]) == 8 / 32
    x_BTD = jax.random.normal(jax.random.key(3), (2, T, D))
    w = jax.random.normal(jax.random.key(4), (3, E, D, 16)) * 0.2
    weights = (w[0], w[1], w[2].transpose(0, 2, 1))
    run = jax.jit(dispatch, static_argnames=("kind", "n_experts", "slots"))
    if spec is None:
        y = run(x_BTD, routing, weights, kind="capacity", n_experts=E, slots=slots)
    else:
        mesh, rules = _mesh(spec, "dp")
        with jax.set_mesh(mesh), activation_rules(mesh, rules):
            y = run(x_BTD, routing, weights, kind="capacity", n_experts=E, slots=slots)
    y = np.asarray(y)
    np.testing.assert_array_equal(y[0, 4:], 0.0)  # dropped: the block adds exactly nothing
    assert np.all(np.abs(y[0, :4]).sum(-1) > 0) and np.all(np.abs(y[1]).sum(-1) > 0)
    # A kept token gets Σ_k weight · expert_k(x), computed directly.
    dropless = run(x_BTD, routing, weights, kind="dropless", n_experts=E, slots=0)
    np.testing.assert_allclose(y[0, :4], np.asarray(dropless)[0, :4], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y[1], np.asarray(dropless)[1], rtol=1e-5, atol=1e-6)


def test_router_losses_equal_their_closed_forms():
    logits = _constructed_logits(4)
    routing = route(logits, 2, renormalize=True, capacity_slots=None)
    p = np.exp(np.asarray(logits, np.float64))
    lse = np.log(p.sum(-1))
    p /= p.sum(-1, keepdims=True)
    # f_e: row 0 sends 8 choices each to experts 0 and 1; row 1 sends 4 to each expert.
    f = np.array([12, 12, 4, 4]) / 32
    P = p.mean(axis=(0, 1))
    np.testing.assert_allclose(
        load_balance_loss(logits, routing.expert_BTK), 4 * (f * P).sum(), 1e-6
    )
    np.testing.assert_allclose(z_loss(logits), (lse**2).mean(), rtol=1e-6)
    # Balanced, uniform routing gives exactly 1.
    uniform = jnp.zeros((1, 4, 4))
    experts = jnp.asarray([[[0], [1], [2], [3]]])
    assert float(load_balance_loss(uniform, experts)) == pytest.approx(1.0)
    # Renormalised top-2 weights sum to 1, in the top-2 order.
    np.testing.assert_allclose(routing.weight_BTK.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(routing.expert_BTK[0, :, 0], 0)


def test_mixtral_router_loss_pools_the_blocks_real_tokens():
    # Two blocks' router logits over the same tokens; the last 3 positions of row 1 are padding.
    blocks = [_constructed_logits(4), jnp.flip(_constructed_logits(4), axis=-1)]
    real_BT = np.ones((2, T), bool)
    real_BT[1, -3:] = False
    choices, probs, n = np.zeros(4), np.zeros(4), 0
    totals = []
    for logits in blocks:
        routing = route(logits, 2, renormalize=True, capacity_slots=None)
        totals.append(router_sums(logits, routing.expert_BTK, jnp.asarray(real_BT)))
        p = np.exp(np.asarray(logits, np.float64))
        p /= p.sum(-1, keepdims=True)
        chosen = np.argsort(-p, axis=-1)[..., :2]  # [B, T, 2]
        for e in range(4):
            choices[e] += ((chosen == e).any(-1) & real_BT).sum()
        probs += p[real_BT].sum(0)
        n += real_BT.sum()
    total = jax.tree.map(jnp.add, *totals)
    np.testing.assert_allclose(total["router_choices"], choices)
    np.testing.assert_allclose(total["router_probs"], probs, rtol=1e-6)
    assert float(total["router_tokens"]) == n == 2 * (2 * T - 3)
    got = pooled_load_balance_loss(*(total[k] for k in ("router_choices", "router_probs",
                                                         "router_tokens")))  # fmt: skip
    np.testing.assert_allclose(got, 4 * np.sum(choices / n * probs / n), rtol=1e-6)
    # Not the mean of the blocks' own losses, nor meshtrain's sum of them.
    each = [4 * np.sum(t["router_choices"] * t["router_probs"]) / t["router_tokens"] ** 2
            for t in totals]  # fmt: skip
    assert abs(float(got) - np.mean(each)) > 1e-2
    # Balanced, uniform routing gives k (meshtrain's gives 1).
    uniform = jnp.zeros((1, 4, 4))
    experts = jnp.asarray([[[0, 1], [2, 3], [0, 1], [2, 3]]])
    sums = router_sums(uniform, experts)
    assert float(pooled_load_balance_loss(*sums.values())) == pytest.approx(2.0)


# Four MoE blocks (two per stage in gpipe; one per stage and chunk in the circular schedule of
# two repeats), four experts (two per expert shard), Mixtral's loss. One model for both
# schedules: the unpipelined step is run once.
PIPED = MoEConfig(d_model=32, n_layers=4, n_heads=2, n_experts=4, top_k=2, d_expert=16,
                  vocab_size=64, vocab_multiple=16, max_seq_len=T, dispatch="dropless",
                  router_losses="mixtral", aux_loss_coef=0.5, z_loss_coef=0.0)  # fmt: skip


@functools.cache
def _unpipelined():
    """Random parameters, a batch with padding in its first microbatch only, and one plain SGD
    step on it without a pipeline: ``(graphdef, params, batch, tx, state after, metrics)``."""
    graphdef, params = random_params(PIPED, seed=3)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, PIPED.vocab_size, (B, T + 1)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[:2, T // 2 :] = 0  # padding in the first microbatch only
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
             "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))}  # fmt: skip
    tx = optax.sgd(0.5)
    state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), {})
    want_state, want = jax.jit(lambda st, b: train_step(graphdef, tx, st, b))(state, batch)
    return graphdef, params, batch, tx, want_state, want


@pytest.mark.parametrize(
    "pipeline",
    [
        pytest.param(PipelineConfig(microbatches=2),
                     marks=pytest.mark.pair("gpipe", "moe-dropless"), id="gpipe"),
        pytest.param(PipelineConfig(schedule="circular", repeats=2, microbatches=2),
                     marks=pytest.mark.pair("circular", "moe-dropless"), id="circular"),
    ],
)  # fmt: skip
def test_mixtral_router_loss_in_a_pipeline_equals_the_unpipelined_step(pipeline):
    graphdef, params, batch, tx, want_state, want = _unpipelined()
    assert float(want["loss"] - want["task_loss"]) > 0.5  # the router loss is in it

    mesh = make_mesh("pipe=2,expert=2,data=2")
    rules = rules_for("dp", mesh)
    # host copies of the parameters moved into the layout (no initialiser program is compiled;
    # the step donates its state, so the shared `params` must not be aliased)
    host = jax.tree.map(np.asarray, params)
    graphdef, sharded, shardings = init_train_state(lambda: build_model(PIPED), tx, mesh, rules,
                                                    host)  # fmt: skip
    shard = batch_shardings(batch, mesh, rules)
    step = jit_train_step(RunSpec(mesh=mesh, rules=rules, pipeline=pipeline), graphdef, tx,
                          shardings, shard)  # fmt: skip
    sharded, got = step(sharded, shard_batch(batch, mesh, rules))
    # One loss over the whole batch's real tokens in every block, as one unpipelined step.
    for k in ("loss", "task_loss", "moe_aux_loss"):
        np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=LOSS_RTOL, err_msg=k)
    assert_close(jax.tree.map(np.asarray, sharded.params), want_state.params, pipeline.schedule)


@pytest.mark.pair("moe-capacity", "resume-relayout")
def test_checkpoint_restores_from_expert_4_onto_expert_2_data_2_bit_equal(tmp_path):
    cfg = MoEConfig(d_model=32, n_heads=2, n_experts=4, d_expert=16, vocab_size=64)
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=1), 10)
    rng = np.random.default_rng(0)
    layouts = {}
    for spec in ("expert=4", "expert=2,data=2"):
        mesh, rules = _mesh(spec, "fsdp")
        target = abstract_train_state(lambda: build_model(cfg), tx, mesh, rules)
        layouts[spec] = (target, jax.tree.map(lambda x: x.sharding, target))
    target, shardings = layouts["expert=4"]
    state = jax.tree.map(
        lambda x, s: (
            jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), s)
            if np.issubdtype(x.dtype, np.floating)
            else jax.device_put(np.full(x.shape, 3, x.dtype), s)
        ),
        target,
        shardings,
    )
    gate = state.params["groups"]["moe_block"]["moe"]["gate"]
    assert gate.sharding.shard_shape(gate.shape)[1] == 1  # [layers, E/4, D, F]
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(3, state)
    like, new_shardings = layouts["expert=2,data=2"]
    restored = ckpt.restore(tmp_path / "ck", abstract_target(like, new_shardings))
    want = jax.device_get(state)
    for got, w, s in zip(*map(jax.tree.leaves, (restored.state, want, new_shardings)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), w)
        assert got.sharding == s
    gate = restored.state.params["groups"]["moe_block"]["moe"]["gate"]
    assert gate.sharding.shard_shape(gate.shape)[1] == 2


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"top_k": 9}, "top_k=9: more than n_experts=8"),
        ({"capacity_factor": 0.0}, "moe.capacity_factor=0.0: must be a number > 0"),
        ({"capacity_factor": -1.0}, "moe.capacity_factor=-1.0: must be a number > 0"),
        ({"dispatch": "ragged"}, "dispatch='ragged'"),
        ({"moe_every": 3}, "moe.moe_every=3: does not divide n_layers=2"),
    ],
)
def test_bad_moe_configs_are_one_clear_error(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        MoEConfig(**changes)


@pytest.mark.parametrize(
    ("n_experts", "mesh", "field", "message"),
    [
        (4, "expert=8", "moe.n_experts", "fewer experts than the 8 shards of the expert axis"),
        (6, "expert=4,data=2", "moe.n_experts", "not divisible by the expert axis of size 4"),
    ],
)
def test_experts_the_mesh_cannot_split_are_found_before_compiling(n_experts, mesh, field, message):
    cfg = MoEConfig(n_experts=n_experts, top_k=1)
    sizes = dict((k, int(v)) for k, v in (kv.split("=") for kv in mesh.split(",")))
    data = DataSpec("lm", 16, 32, 256)

    def check(model, mesh, rules):
        """The run check of `model` on `data`, with no run directory to check."""
        no_dir = TrainConfig(run_dir="")
        return check_run(RunSpec(model=model, data=data, mesh=mesh, rules=rules, train=no_dir))

    problems = check(cfg, sizes, rules_for("dp", sizes))
    assert [p.field for p in problems] == [field], problems
    assert message in str(problems[0])
    # A model without experts is still refused on expert > 1; an MoE is not.
    gpt = check(None, {"expert": 8}, rules_for("dp"))
    assert [p.field for p in gpt] == ["mesh.expert"]
    ok = check(MoEConfig(), {"expert": 8}, rules_for("dp"))
    assert ok == []
    # Pipelines: the MoE's groups are its stages' layers (tests/test_moe_pipeline.py trains it).
    piped = check(MoEConfig(), {"pipe": 2}, rules_for("dp"))
    assert piped == []
    odd = check(MoEConfig(n_layers=3), {"pipe": 2}, rules_for("dp"))
    assert [p.field for p in odd] == ["moe.n_layers"]
    # Context parallelism runs (tests/test_moe_context.py proves it equal to one device).
    split = check(MoEConfig(), {"seq": 2}, rules_for("dp"))
    assert split == []


def test_cli_bad_expert_split_is_one_line_exit_2(capsys, tmp_path):
    argv = ["train", "--model", "moe", "--mesh", "expert=8", "--strategy", "dp"]
    argv += ["--moe.n-experts", "6", "--moe.top-k", "1"]
    code = cli.main([*argv, "--run-dir", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith(
        "meshtrain train: error: moe.n_experts=6: fewer experts than the 8 shards of the "
        "expert axis; raise --moe.n-experts to a multiple of 8 or set expert to a divisor of 6"
    ), err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cli_trains_an_moe_over_expert_and_data_with_accumulation_bf16_and_remat(tmp_path, capsys):
    run = tmp_path / "run"
    argv = [  # no --strategy: the default, auto, picks dp for this mesh
        "train", "--model", "moe", "--mesh", "expert=4,data=2",
        "--steps", "1", "--accum-steps", "2", "--log-every", "1", "--eval-every", "0",
        "--data.source", "synthetic", "--data.seq-len", "16", "--data.batch-size", "16",
        "--moe.d-model", "32", "--moe.n-heads", "2", "--moe.d-expert", "32",
        "--moe.max-seq-len", "16", "--moe.dtype", "bfloat16", "--moe.remat", "full",
        "--moe.dispatch", "dropless", "--sample-tokens", "0",
        "--data.val-fraction", "0",  # no held-out data: no evaluation
        "--run-dir", str(run), "--no-progress",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    assert "expert=4 (8 cpu devices) · strategy dp\n" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "moe_aux_loss" in r][-1]
    assert last["moe_dropped_fraction"] == 0.0  # dropless
    assert last["moe_tokens_per_expert_mean"] == pytest.approx(8 * 16 * 2 / 8)  # per microbatch
    assert last["moe_tokens_per_expert_min"] <= last["moe_tokens_per_expert_max"]
    assert np.isfinite(last["loss"]) and last["loss"] > last["task_loss"]
    assert (run / "checkpoints" / "1").is_dir()
