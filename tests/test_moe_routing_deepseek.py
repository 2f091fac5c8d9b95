"""DeepSeek-V3's router in the MoE: sigmoid scores, group-limited top-k, the routed scale and
auxiliary-loss-free balancing.

- The choice equals transformers' ``DeepseekV3TopkRouter`` (a fixture made by
  ``scripts/make_hf_deepseek_router.py``) and a numpy reference on fresh random inputs; taking
  the weights from the biased scores (a deliberately wrong variant) does not.
- The bias is model state, never a parameter: no gradient reaches it, the optimizer (AdamW with
  weight decay) does not hold or touch it, and after each step it is exactly
  ``γ · sign(mean load − load)`` of the load the whole batch put on the experts.
- Three steps under dp+tp, hsdp, fsdp and zero1 with expert=2, gradient accumulation (2
  microbatches, with full remat) and context parallelism equal one device: losses, metrics,
  parameters and the bias; a checkpoint restores the bias. Without the bias, a gpipe pipeline
  equals the plain step.
- What does not run together is refused in one line before compiling.

Everything is float32; inputs come from seeded generators.
"""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import token_batches
from _pipeline_helpers import LOSS_RTOL, assert_close, random_params
from flax import nnx

from meshtrain.check import check_run
from meshtrain.checkpoint import CheckpointManager
from meshtrain.checkpoint import restore as restore_checkpoint
from meshtrain.layout import batch_shardings, rules_for, shard_batch
from meshtrain.lower import init_train_state, jit_train_step
from meshtrain.mesh import make_mesh
from meshtrain.models import DataSpec, MoEConfig, build_model
from meshtrain.models.moe_balance import update
from meshtrain.models.moe_routing import Choice, load_balance_loss, route
from meshtrain.pipeline import PipelineConfig
from meshtrain.replicas import SyncConfig
from meshtrain.run import RunSpec, TrainConfig
from meshtrain.state import TrainState, abstract_target
from meshtrain.train.step import train_step

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "deepseek_v3_router.npz"
T, B, STEPS, RATE = 8, 8, 3, 0.02
CFG = MoEConfig(
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    n_layers=2,
    n_experts=8,
    top_k=2,
    d_expert=16,
    vocab_size=64,
    vocab_multiple=16,
    max_seq_len=T,
    dispatch="dropless",
    router_scores="sigmoid",
    expert_groups=4,
    groups_per_token=2,
    routed_scale=2.5,
    bias_update_rate=RATE,
    aux_loss_coef=0.0,
)  # fmt: skip  (DeepSeek-V3's balancing: the bias alone; z-loss on)
TX = optax.adamw(1e-2, weight_decay=0.1)


# --- the routing math ----------------------------------------------------------------------


def _reference(logits, bias, top_k, groups, keep, renormalize, scale, *, biased_weights=False):
    """numpy, token by token: DeepSeek-V3's choice; ids sorted, and their weights."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    ids, weights = [], []
    for s in scores:
        b = s + bias
        per = len(s) // groups
        group_score = [np.sort(b[g * per : (g + 1) * per])[-2:].sum() for g in range(groups)]
        chosen = np.argsort(-np.asarray(group_score), kind="stable")[:keep]
        allowed = [e for g in chosen for e in range(g * per, (g + 1) * per)]
        top = sorted(sorted(allowed, key=lambda e: -b[e])[:top_k])
        w = (b if biased_weights else s)[top]
        if renormalize:
            w = w / w.sum()
        ids.append(top)
        weights.append(w * scale)
    return np.asarray(ids), np.asarray(weights)


def _routed(logits, bias, top_k, choice, renormalize):
    """meshtrain's choice on [N, E] logits: ids sorted per token, and their weights."""
    r = route(
        jnp.asarray(logits)[None],
        top_k,
        renormalize=renormalize,
        capacity_slots=None,
        choice=choice,
        bias_E=jnp.asarray(bias),
    )
    ids, weights = np.asarray(r.expert_BTK[0]), np.asarray(r.weight_BTK[0])
    order = np.argsort(ids, axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


@pytest.mark.parametrize(
    ("case", "top_k", "choice", "renormalize"),
    [
        ("grouped", 4, Choice("sigmoid", 4, 2, 2.5), True),
        ("flat", 2, Choice("sigmoid", 1, 1, 1.0), False),
    ],
)
def test_the_choice_equals_transformers_deepseek_v3_router(case, top_k, choice, renormalize):
    f = np.load(FIXTURE)
    logits = f[f"{case}_x"] @ f[f"{case}_weight"].T  # meshtrain's router is [D, E]
    np.testing.assert_allclose(logits, f[f"{case}_logits"], rtol=1e-5, atol=1e-5)
    ids, weights = _routed(f[f"{case}_logits"], f[f"{case}_bias"], top_k, choice, renormalize)
    np.testing.assert_array_equal(ids, f[f"{case}_ids"])
    np.testing.assert_allclose(weights, f[f"{case}_weights"], rtol=1e-6, atol=1e-6)


def test_the_choice_equals_a_numpy_reference_and_not_weights_from_biased_scores():
    rng = np.random.default_rng(7)
    E, N = 12, 96
    logits = rng.normal(0, 1.5, (N, E)).astype(np.float32)
    bias = rng.normal(0, 0.3, E).astype(np.float32)
    ids, weights = _routed(logits, bias, 3, Choice("sigmoid", 3, 2, 1.8), True)
    want_ids, want_w = _reference(logits, bias, 3, 3, 2, True, 1.8)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=1e-6, atol=1e-6)
    assert len({tuple(i) for i in ids}) > 10  # many different choices were tested
    # the deliberately wrong variant (weights from the biased scores) is told apart
    _, wrong = _reference(logits, bias, 3, 3, 2, True, 1.8, biased_weights=True)
    assert not np.allclose(weights, wrong, rtol=1e-3, atol=1e-3)
    # and so is a choice that ignores the groups
    flat_ids, _ = _routed(logits, bias, 3, Choice("sigmoid", 1, 1, 1.8), True)
    assert (flat_ids != ids).any()


def test_softmax_routing_is_unchanged_by_the_new_defaults():
    logits = np.random.default_rng(3).normal(0, 1, (1, 16, 8)).astype(np.float32)
    r = route(jnp.asarray(logits), 2, renormalize=True, capacity_slots=None)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    top = np.sort(p, axis=-1)[..., ::-1][..., :2]
    np.testing.assert_allclose(np.asarray(r.weight_BTK), top / top.sum(-1, keepdims=True), 1e-6)


def test_the_balancing_loss_reads_normalised_sigmoid_scores_beside_the_bias():
    """With sigmoid scores an auxiliary loss may run beside the bias (DeepSeek-V3 keeps a small
    one): its P_e is the mean of the scores normalised over the experts per token."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 1, (2, 8, 6)).astype(np.float32)
    bias = jnp.asarray(rng.normal(0, 1, 6), jnp.float32)
    sigmoid = Choice("sigmoid")
    r = route(
        jnp.asarray(logits), 2, renormalize=True, capacity_slots=None, choice=sigmoid, bias_E=bias
    )
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    probs = (s / s.sum(-1, keepdims=True)).mean((0, 1))
    frac = np.bincount(np.asarray(r.expert_BTK).ravel(), minlength=6) / r.expert_BTK.size
    got = load_balance_loss(jnp.asarray(logits), r.expert_BTK, "sigmoid")
    np.testing.assert_allclose(float(got), 6 * np.sum(frac * probs), rtol=1e-5)
    softmax = float(load_balance_loss(jnp.asarray(logits), r.expert_BTK))
    assert abs(softmax - float(got)) > 1e-3  # the softmax form is told apart


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"router_scores": "tanh"}, "moe.router_scores='tanh'"),
        ({"expert_groups": 3}, "moe.expert_groups=3: does not divide n_experts=8"),
        ({"expert_groups": 4, "groups_per_token": 5}, "groups_per_token=5: more than expert_gr"),
        ({"expert_groups": 4, "groups_per_token": 1, "top_k": 3}, "top_k=3: more than the 2 ex"),
        ({"bias_update_rate": -0.1}, "moe.bias_update_rate=-0.1"),
        ({"routed_scale": 0.0}, "moe.routed_scale=0.0: must be a number > 0"),
    ],
)
def test_bad_router_settings_are_one_clear_error(changes, message):
    with pytest.raises(ValueError, match=message) as e:
        MoEConfig(**changes)
    assert len(str(e.value).strip().splitlines()) == 1


# --- the bias in the train step --------------------------------------------------------------


def _params(cfg):
    """The initial parameters on the host (shared by every layout of a test)."""
    return jax.tree.map(
        np.asarray, jax.jit(lambda: nnx.to_pure_dict(nnx.state(build_model(cfg), nnx.Param)))()
    )


PARAMS = {}


def _run(spec, *, accum=1, devices=None, cfg=CFG, strategy="fsdp"):
    """STEPS steps of `cfg` on `spec` from shared parameters: per-step metrics, the final host
    state, and the graphdef."""
    if cfg not in PARAMS:
        PARAMS[cfg] = _params(cfg)
    n = int(np.prod([int(kv.split("=")[1]) for kv in spec.split(",")]))
    mesh = make_mesh(spec, devices=devices or jax.devices()[:n])
    rules = rules_for(strategy, mesh)
    batches = token_batches(STEPS, cfg.vocab_size, B, T, seed=1)
    graphdef, state, shardings = init_train_state(
        lambda: build_model(cfg), TX, mesh, rules, PARAMS[cfg]
    )
    run = RunSpec(mesh=mesh, rules=rules, train=TrainConfig(accum_steps=accum))
    shard = batch_shardings(batches[0], mesh, rules)
    step = jit_train_step(run, graphdef, TX, shardings, shard)
    metrics = []
    for batch in batches:
        state, m = step(state, shard_batch(batch, mesh, rules))
        metrics.append({k: float(v) for k, v in m.items()})
        metrics[-1]["bias"] = np.asarray(_moe_rest(state)["bias"])
    return metrics, jax.device_get(state), graphdef


_ONE = {}


def _one_device():
    if "run" not in _ONE:
        _ONE["run"] = _run("data=1", devices=jax.devices()[:1])
    return _ONE["run"]


def _moe_rest(state):
    return state.rest["groups"]["moe_block"]["moe"]


def test_the_bias_is_state_without_gradient_and_moves_by_the_whole_batchs_load():
    metrics, state, graphdef = _one_device()
    assert "bias" not in state.params["groups"]["moe_block"]["moe"]
    n_params = len(jax.tree.leaves(state.params))
    n_moments = sum(x.ndim > 0 for x in jax.tree.leaves(state.opt_state))
    assert n_moments == 2 * n_params  # AdamW's moments: the parameters' only, no bias
    # No gradient reaches the bias: the loss's derivative in it is exactly zero (jitted: one
    # program each).
    batch = token_batches(1, CFG.vocab_size, B, T, seed=1)[0]
    params = jax.tree.map(jnp.asarray, PARAMS[CFG])
    bias = jnp.asarray(_moe_rest(state)["bias"])
    load = jnp.zeros_like(bias)

    def loss(bias):
        rest = {"groups": {"moe_block": {"moe": {"bias": bias, "load": load}}}}
        model = nnx.merge(graphdef, params, rest)
        out = model(jnp.asarray(batch["inputs"]))
        return jnp.mean(out.logits**2) + out.aux_loss, model.groups.moe_block.moe.load[...]

    # The derivative at the bias after 3 steps; the load counted from a zero bias.
    grad, _ = jax.jit(jax.grad(loss, has_aux=True))(bias)
    assert np.all(np.asarray(grad) == 0)
    # The first step's bias is γ·sign(mean − load) of the first batch's load on the initial
    # parameters, and the count is zero again (weight decay did not touch it).
    _, counted = jax.jit(loss)(jnp.zeros_like(bias))
    counted = np.asarray(counted)
    assert counted.sum() == CFG.n_layers * B * T * CFG.top_k
    np.testing.assert_array_equal(
        np.asarray(update(jnp.zeros_like(bias), jnp.asarray(counted), RATE)),
        metrics[0]["bias"],
    )
    assert np.all(_moe_rest(state)["load"] == 0)
    assert metrics[0]["moe_router_bias_max"] == pytest.approx(RATE)
    assert not np.array_equal(_moe_rest(state)["bias"], metrics[0]["bias"])  # it kept moving
    assert all(m["moe_expert_load_cv"] > 0 for m in metrics)


@pytest.mark.parametrize(
    ("spec", "accum", "strategy"),
    [
        pytest.param("data=4,tensor=2", 1, "dp+tp", id="dp+tp"),
        pytest.param("data=2,fsdp=4", 1, "hsdp", id="hsdp"),
        pytest.param("expert=2,fsdp=4", 1, "fsdp", id="fsdp-expert2"),
        pytest.param("expert=2,data=4", 1, "zero1", id="zero1-expert2"),
        pytest.param("data=2", 2, "dp", id="accumulate2-remat"),
        pytest.param("seq=2,expert=2,data=2", 1, "dp", id="context2"),
    ],
)
def test_three_steps_equal_one_device_bias_included(spec, accum, strategy):
    want, want_state, _ = _one_device()
    cfg = dataclasses.replace(CFG, remat="full") if accum > 1 else CFG  # remat beside it
    PARAMS.setdefault(cfg, PARAMS[CFG])  # the same parameters
    got, state, _ = _run(spec, accum=accum, strategy=strategy, cfg=cfg)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for name in ("loss", "moe_expert_load_cv", "moe_router_bias_min", "moe_router_bias_max"):
            np.testing.assert_allclose(g[name], w[name], rtol=0, atol=1e-5, err_msg=(step, name))
        np.testing.assert_array_equal(g["bias"], w["bias"], err_msg=step)
    np.testing.assert_array_equal(_moe_rest(state)["bias"], _moe_rest(want_state)["bias"])
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want_state.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-5)


def test_a_checkpoint_restores_the_bias(tmp_path):
    _, state, _ = _one_device()
    mesh = make_mesh("data=2", devices=jax.devices()[:2])
    rules = rules_for("dp", mesh)
    _, placed, shardings = init_train_state(lambda: build_model(CFG), TX, mesh, rules, state.params)
    placed = placed._replace(rest=jax.device_put(state.rest, shardings.rest))
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(3, placed)
    like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        placed, shardings)  # fmt: skip
    restored = restore_checkpoint(tmp_path / "ck", abstract_target(like, shardings)).state
    bias = _moe_rest(restored)["bias"]
    assert np.abs(np.asarray(bias)).max() > 0
    np.testing.assert_array_equal(np.asarray(bias), _moe_rest(state)["bias"])


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mesh", "extra", "words"),
    [
        ({"pipe": 2, "data": 4}, {"pipeline": PipelineConfig(microbatches=2)}, "with pipelines"),
        ({"data": 8}, {"sync": SyncConfig(grad_compression="int8")}, "own step"),
    ],
)
def test_balancing_with_what_it_was_not_proven_under_is_refused_in_one_line(mesh, extra, words):
    full = {"pipe": 1, "data": 1, "fsdp": 1, "expert": 1, "seq": 1, "tensor": 1, **mesh}
    run = RunSpec(model=CFG, data=DataSpec("lm", 16, T, 64), mesh=full,
                  rules=rules_for("dp", full), **extra)  # fmt: skip
    problems = [p for p in check_run(run) if p.field == "moe.bias_update_rate"]
    assert len(problems) == 1, check_run(run)
    assert words in problems[0].message and "--moe.bias-update-rate 0" in problems[0].message
    unbiased = dataclasses.replace(run, model=dataclasses.replace(CFG, bias_update_rate=0.0))
    assert not [p for p in check_run(unbiased) if p.field == "moe.bias_update_rate"]


# --- without the bias, in a pipeline ----------------------------------------------------------


@pytest.mark.pair("gpipe", "moe-dropless")
def test_sigmoid_grouped_routing_without_bias_in_a_pipeline_equals_the_plain_step():
    """Without the bias the router holds no state: a gpipe pipeline (2 microbatches) over
    ``pipe=2,expert=2,data=2`` equals the unpipelined step, run with 2 accumulated microbatches
    (the router losses are averaged per microbatch in both)."""
    cfg = dataclasses.replace(CFG, bias_update_rate=0.0, aux_loss_coef=0.1)
    graphdef, params = random_params(cfg, seed=3)
    batch = token_batches(1, cfg.vocab_size, B, T, seed=2)[0]
    tx = optax.sgd(0.5)
    plain = RunSpec(train=TrainConfig(accum_steps=2))
    state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), {})
    want_state, want = jax.jit(lambda st, b: train_step(graphdef, tx, st, b, run=plain))(
        state, batch
    )
    mesh = make_mesh("pipe=2,expert=2,data=2")
    rules = rules_for("dp", mesh)
    host = jax.tree.map(np.asarray, params)
    graphdef, sharded, shardings = init_train_state(lambda: build_model(cfg), tx, mesh, rules, host)
    shard = batch_shardings(batch, mesh, rules)
    run = RunSpec(mesh=mesh, rules=rules, pipeline=PipelineConfig(microbatches=2))
    step = jit_train_step(run, graphdef, tx, shardings, shard)
    sharded, got = step(sharded, shard_batch(batch, mesh, rules))
    for k in ("loss", "task_loss", "moe_aux_loss"):
        np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=LOSS_RTOL, err_msg=k)
    assert float(got["loss"] - got["task_loss"]) > 0.05  # the router loss is in it
    assert_close(jax.tree.map(np.asarray, sharded.params), want_state.params, "gpipe")


def test_a_deepseek_router_is_not_written_as_mixtral():
    from meshtrain.hf.mixtral import config_to_hf

    config_to_hf(MoEConfig())  # Mixtral's router: written
    for changes in (
        {"router_scores": "sigmoid"},
        {"routed_scale": 2.0},
        {"bias_update_rate": 1e-3},
    ):
        with pytest.raises(ValueError, match="Mixtral's router is a softmax"):
            config_to_hf(MoEConfig(**changes))
