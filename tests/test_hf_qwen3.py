"""Qwen3 and Qwen3-MoE interchange and the query/key norm: tiny random ``Qwen3ForCausalLM`` and
``Qwen3MoeForCausalLM`` made by transformers (`scripts/make_hf_fixtures.py`, heads whose width
times count is not the model's width) load with logits equal to transformers', and wrong
mappings (norms swapped, experts permuted) do not; exports reload to the same tensors; three
AdamW steps of a Qwen3-MoE with its router loss, and of a Qwen3, equal transformers' + torch's
(`scripts/make_hf_mixtral_steps.py qwen3_moe`, ``qwen3``); the attention's norm runs before
RoPE, as a reference written here says, and after RoPE would not match; a Qwen3-shaped model
trains as on one device under fsdp + tp, a 1F1B pipeline and ring context parallelism (plain
and packed); an imported Qwen3-MoE split over experts gives transformers' logits; bad settings
get one line each."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import initial_values, model_from, packed_layout
from _hf_helpers import FIXTURES, copy, edit_config, edit_tensors, forward, read, reference
from flax import nnx

from meshtrain import hf
from meshtrain.check import check_run
from meshtrain.hf import qwen3_moe
from meshtrain.hf.qwen3_moe import load_qwen3_moe, save_qwen3_moe
from meshtrain.layout import activation_rules, batch_shardings, rules_for, shard_batch
from meshtrain.lower import init_train_state, jit_train_step
from meshtrain.mesh import make_mesh, mesh_sizes
from meshtrain.models import DataSpec, GPTConfig, MoEConfig, logits_of
from meshtrain.models import layers as mlayers
from meshtrain.models.gpt import Attention
from meshtrain.optim import OptimConfig, make_optimizer
from meshtrain.pipeline import PipelineConfig
from meshtrain.run import RunSpec, TrainConfig
from meshtrain.state import TrainState
from meshtrain.train.step import train_step

# float32 logits: measured 1.3e-6 (qwen3) and 5.6e-7 (qwen3_moe) of the largest |logit|.
RTOL = 1e-5
QWEN3 = GPTConfig(
    vocab_size=128, max_seq_len=128, d_model=64, n_layers=2, n_heads=6, n_kv_heads=2, d_ff=80,
    head_dim=24, qk_norm=True, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True,
)  # fmt: skip


def _rel(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _moe_logits(model, tokens) -> np.ndarray:
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t: logits_of(nnx.merge(graphdef, s)(t)))
    return np.asarray(fwd(state, tokens))[..., : model.cfg.vocab_size]


# --- Qwen3 -----------------------------------------------------------------------------------


def test_qwen3_reads_its_config_and_its_logits_equal_transformers():
    cfg, params = hf.load_pretrained(FIXTURES / "qwen3")
    assert cfg == QWEN3 and cfg.head_width * cfg.n_heads != cfg.d_model
    tokens, want = reference("qwen3")
    got = np.asarray(forward(cfg)(params, tokens))[..., : cfg.vocab_size]
    assert _rel(got, want) <= RTOL


def test_qwen3_with_its_query_and_key_norms_swapped_does_not_match(tmp_path):
    path = copy(tmp_path, "qwen3")

    def swap(t):
        for i in range(2):
            q, k = (f"model.layers.{i}.self_attn.{n}_norm.weight" for n in "qk")
            t[q], t[k] = t[k], t[q]

    edit_tensors(path, swap)
    cfg, params = hf.load_pretrained(path)
    tokens, want = reference("qwen3")
    got = np.asarray(forward(cfg)(params, tokens))[..., : cfg.vocab_size]
    assert _rel(got, want) > 100 * RTOL


def _attention_reference(params, x_BTD, cfg: GPTConfig, norm_first: bool = True):
    """Qwen3's attention written out: project, RMS-normalise each head (before RoPE, or after
    with ``norm_first=False``: the wrong order), rotate, attend causally, project back."""
    K, eps = cfg.head_width, cfg.norm_eps
    rms = lambda a, s: a / jnp.sqrt(jnp.mean(a * a, -1, keepdims=True) + eps) * s  # noqa: E731
    q = jnp.einsum("btd,dhk->bthk", x_BTD, params["q"]["kernel"])
    k = jnp.einsum("btd,dgk->btgk", x_BTD, params["k"]["kernel"])
    v = jnp.einsum("btd,dgk->btgk", x_BTD, params["v"]["kernel"])
    cos, sin = mlayers.rope_tables(x_BTD.shape[1], K, cfg.rope_theta)

    def rotate(a):
        a1, a2 = a[..., : K // 2], a[..., K // 2 :]
        c, s = cos[None, :, None], sin[None, :, None]
        return jnp.concatenate([a1 * c - a2 * s, a2 * c + a1 * s], -1)

    qs, ks = params["q_norm"]["scale"], params["k_norm"]["scale"]
    if norm_first:
        q, k = rotate(rms(q, qs)), rotate(rms(k, ks))
    else:
        q, k = rms(rotate(q), qs), rms(rotate(k), ks)
    k = jnp.repeat(k, cfg.n_heads // cfg.kv_heads, axis=2)
    v = jnp.repeat(v, cfg.n_heads // cfg.kv_heads, axis=2)
    T = x_BTD.shape[1]
    scores = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(K)
    scores = jnp.where(np.tril(np.ones((T, T), bool)), scores, -jnp.inf)
    o = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores, -1), v)
    return jnp.einsum("bthk,hkd->btd", o, params["o"]["kernel"])


def test_the_head_norm_runs_before_rope_as_the_reference_and_not_after():
    cfg = dataclasses.replace(QWEN3, d_model=16, n_heads=4, head_dim=8)
    rng = np.random.default_rng(3)
    attn = Attention(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(attn, nnx.Param)
    params = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(1.0, 0.5, x.shape), jnp.float32),
        nnx.to_pure_dict(state),
    )
    nnx.replace_by_pure_dict(state, params)
    nnx.update(attn, state)
    x = jnp.asarray(rng.normal(size=(2, 12, 16)), jnp.float32)
    got = np.asarray(attn(x))
    want = np.asarray(_attention_reference(params, x, cfg))
    wrong = np.asarray(_attention_reference(params, x, cfg, norm_first=False))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got - wrong).max() > 1e-2


def test_qwen3_export_reloads_and_writes_transformers_names(tmp_path):
    cfg, params = hf.load_pretrained(FIXTURES / "qwen3")
    out = tmp_path / "export"
    hf.save_pretrained(out, params, cfg)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Qwen3ForCausalLM"] and written["head_dim"] == 24
    again_cfg, again = hf.load_pretrained(out)
    assert again_cfg == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = read(FIXTURES / "qwen3" / "model.safetensors")
    got = read(out / "model.safetensors")
    assert set(got) == set(want)
    for name, t in want.items():
        np.testing.assert_array_equal(got[name], np.asarray(t, np.float32), err_msg=name)


# --- Qwen3-MoE -------------------------------------------------------------------------------


def test_qwen3_moe_reads_its_config_and_its_logits_equal_transformers():
    model = load_qwen3_moe(FIXTURES / "qwen3_moe")
    cfg = model.cfg
    assert (cfg.n_experts, cfg.top_k, cfg.d_expert, cfg.d_ff, cfg.moe_every) == (8, 3, 32, 64, 2)
    assert cfg.renormalize and cfg.qk_norm and cfg.head_dim == 16 and cfg.d_model == 48
    assert (cfg.router_losses, cfg.aux_loss_coef, cfg.dispatch) == ("mixtral", 0.0, "dropless")
    tokens, want = reference("qwen3_moe")
    assert _rel(_moe_logits(model, tokens), want) <= RTOL


def test_an_imported_qwen3_moe_gives_transformers_logits_split_over_experts():
    model = load_qwen3_moe(FIXTURES / "qwen3_moe")
    mesh = make_mesh("expert=4,data=2")
    rules = rules_for("dp", mesh)
    graphdef, state = nnx.split(model)

    def fwd(state, tokens):
        with activation_rules(mesh, rules):
            return logits_of(nnx.merge(graphdef, state)(tokens))

    tokens, want = reference("qwen3_moe")
    with jax.set_mesh(mesh):
        rows = np.concatenate([tokens] * 4)  # 8 rows: one per device
        got = np.asarray(jax.jit(fwd)(state, rows))[:2, :, : model.cfg.vocab_size]
    assert _rel(got, want) <= RTOL


def test_qwen3_moe_with_permuted_experts_does_not_match(tmp_path):
    path = copy(tmp_path, "qwen3_moe")

    def permute(t):  # experts 0 and 1 trade weights; the router still sends as before
        for n in ("gate", "up", "down"):
            a, b = (f"model.layers.1.mlp.experts.{e}.{n}_proj.weight" for e in (0, 1))
            t[a], t[b] = t[b], t[a]

    edit_tensors(path, permute)
    tokens, want = reference("qwen3_moe")
    assert _rel(_moe_logits(load_qwen3_moe(path), tokens), want) > 100 * RTOL


def test_qwen3_moe_export_reloads_the_same_tensors(tmp_path):
    model = load_qwen3_moe(FIXTURES / "qwen3_moe")
    out = save_qwen3_moe(model, tmp_path / "export")
    want = read(FIXTURES / "qwen3_moe" / "model.safetensors")
    got = read(out / "model.safetensors")
    assert set(got) == set(want)
    for name, t in want.items():
        np.testing.assert_array_equal(got[name], np.asarray(t, np.float32), err_msg=name)
    assert load_qwen3_moe(out).cfg == model.cfg


@pytest.mark.parametrize(
    ("changes", "moe_every"),
    [
        ({"decoder_sparse_step": 1}, 1),
        ({"decoder_sparse_step": 4}, 4),
        ({"decoder_sparse_step": 1, "mlp_only_layers": [0, 2]}, 2),  # sparse 1, 3
    ],
)
def test_qwen3_moe_sparse_layers_every_nth_read_as_moe_every(changes, moe_every):
    hf_cfg = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text()) | changes
    assert qwen3_moe.config_from_hf(hf_cfg).moe_every == moe_every


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"decoder_sparse_step": 3}, r"decoder_sparse_step=3 is not supported: its sparse layers "
         r"\[2\] of 4 are not every n-th layer"),
        ({"decoder_sparse_step": 1, "mlp_only_layers": [3]}, r"mlp_only_layers=\[3\] is not "
         r"supported: its sparse layers \[0, 1, 2\] of 4"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"head_dim": 15}, r"config.json: head_dim=15: odd; RoPE rotates pairs"),
    ],
)  # fmt: skip
def test_qwen3_moe_refuses_what_meshtrain_cannot_hold_in_one_line(tmp_path, changes, match):
    path = copy(tmp_path, "qwen3_moe")
    edit_config(path, **changes)
    with pytest.raises(ValueError, match=match) as e:
        load_qwen3_moe(path)
    assert "\n" not in str(e.value)


def test_qwen3_moe_export_refuses_what_it_cannot_hold():
    cfg = MoEConfig(d_model=32, n_layers=2, qk_norm=False, router_losses="mixtral")
    with pytest.raises(ValueError, match="qk_norm=False"):
        qwen3_moe.config_to_hf(cfg)


# --- three AdamW steps against transformers + torch ------------------------------------------

# What scripts/make_hf_mixtral_steps.py trains with: AdamW, no clipping, no schedule.
ADAMW = OptimConfig(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, warmup_steps=0,
                    min_lr_ratio=1.0, clip_norm=0.0)  # fmt: skip
LOSS_RTOL, PARAM_ATOL = 1e-6, 1e-5


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3"])
def test_three_adamw_steps_equal_transformers_and_torch(name):
    steps = np.load(FIXTURES / f"{name}_steps.npz")
    if name == "qwen3_moe":  # with its router loss on
        model = load_qwen3_moe(FIXTURES / "qwen3_moe_steps")
        cfg = model.cfg
        assert (cfg.router_losses, cfg.aux_loss_coef, cfg.z_loss_coef) == ("mixtral", 0.1, 0.0)
        assert (cfg.top_k, cfg.renormalize, cfg.n_experts) == (3, False, 8)
    else:
        model = hf.load_model(FIXTURES / "qwen3_steps")
        assert model.cfg.qk_norm and model.cfg.head_dim == 24
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    tx = make_optimizer(ADAMW, len(steps["loss"]))
    state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), rest)
    step = jax.jit(lambda st, b: train_step(graphdef, tx, st, b))
    for s, want in enumerate(steps["loss"]):
        mask = steps["mask"][s]
        batch = {
            "inputs": steps["inputs"][s],
            "targets": np.maximum(steps["targets"][s], 0),
            "segment_ids": mask,
            "positions": np.broadcast_to(np.arange(mask.shape[1], dtype=np.int32), mask.shape),
        }
        state, metrics = step(state, batch)
        if "aux_loss" in steps:
            np.testing.assert_allclose(
                metrics["moe_aux_loss"], steps["aux_loss"][s], rtol=LOSS_RTOL
            )
        np.testing.assert_allclose(metrics["loss"], want, rtol=LOSS_RTOL, err_msg=f"step {s}")
    load = load_qwen3_moe if name == "qwen3_moe" else hf.load_model
    trained = nnx.to_pure_dict(nnx.state(load(FIXTURES / f"{name}_steps_trained"), nnx.Param))
    for (path, got), want, was in zip(
        jax.tree_util.tree_leaves_with_path(state.params),
        jax.tree.leaves(trained),
        jax.tree.leaves(params),
        strict=True,
    ):
        where = jax.tree_util.keystr(path)
        assert np.abs(np.asarray(want) - np.asarray(was)).max() > 1e-4, where  # it moved
        np.testing.assert_allclose(got, want, rtol=0, atol=PARAM_ATOL, err_msg=where)


# --- layouts: equal to one device ------------------------------------------------------------

B, T, LR = 8, 16, 0.1
SGD = OptimConfig(optimizer="sgd", lr=LR, momentum=0.0, weight_decay=0.0, clip_norm=0.0,
                  warmup_steps=0)  # fmt: skip
# Qwen3-shaped: query/key norms, 4 heads of 12 on a width of 32, 2 key/value heads.
LAYOUT_CFG = GPTConfig(
    n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=12, qk_norm=True, max_seq_len=T,
    vocab_size=64, vocab_multiple=16,
)  # fmt: skip


def _train_on(mesh_str, strategy, schedule=None, packed=False, devices=None):
    """Losses and final host parameters of 2 SGD steps of `LAYOUT_CFG` on one layout (on
    packed documents with `packed`)."""
    cfg = LAYOUT_CFG
    mesh = make_mesh(mesh_str, devices=devices)
    rules = rules_for(strategy, mesh, context_parallel="ring")
    tx = make_optimizer(SGD, 10)
    ctor = model_from(cfg, initial_values(cfg))
    graphdef, state, shardings = init_train_state(ctor, tx, mesh, rules)
    pipeline = PipelineConfig(schedule=schedule, microbatches=2) if schedule else PipelineConfig()
    run = RunSpec(mesh=mesh, rules=rules, train=TrainConfig(run_dir=""), optim=SGD,
                  pipeline=pipeline)  # fmt: skip
    data = DataSpec("lm", B, T, cfg.vocab_size, packed=packed)
    assert check_run(run.replace(model=cfg, data=data, mesh=mesh_sizes(mesh))) == []
    rng = np.random.default_rng(11)
    batches = []
    for _ in range(2):
        tokens = rng.integers(0, cfg.vocab_size, (B, T + 1), np.int32)
        batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
        if packed:
            layout = packed_layout(rng, B, T, longest=T // 3)
            batches[-1]["segment_ids"], batches[-1]["positions"] = layout
    step = jit_train_step(run, graphdef, tx, shardings, batch_shardings(batches[0], mesh, rules))
    losses = []
    for b in batches:
        state, m = step(state, shard_batch(b, mesh, rules))
        losses.append(float(m["loss"]))
    return np.array(losses), jax.tree.map(np.asarray, state.params)


_ONE_DEVICE: dict[bool, tuple] = {}


@pytest.mark.parametrize(
    ("mesh", "strategy", "schedule", "packed"),
    [
        ("fsdp=2,tensor=2,data=2", "fsdp+tp", None, False),  # heads split over tensor
        ("pipe=2,data=4", "dp", "1f1b", False),
        ("seq=2,data=4", "dp", None, False),  # ring context parallelism
        ("seq=2,data=4", "dp", None, True),  # ring, on packed documents
    ],
)
def test_a_qwen3_shaped_model_trains_as_on_one_device(mesh, strategy, schedule, packed):
    if packed not in _ONE_DEVICE:
        _ONE_DEVICE[packed] = _train_on("data=1", "dp", packed=packed, devices=jax.devices()[:1])
    want_loss, want = _ONE_DEVICE[packed]
    loss, got = _train_on(mesh, strategy, schedule, packed)
    np.testing.assert_allclose(loss, want_loss, rtol=0, atol=1e-5)
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(g, w, rtol=0, atol=5e-5, err_msg=jax.tree_util.keystr(path))
    start = jax.tree.leaves(initial_values(LAYOUT_CFG))
    moved = max(
        float(np.abs(w - s).max()) for w, s in zip(jax.tree.leaves(want), start, strict=True)
    )
    assert moved > 1e-3  # it trained


# --- bad settings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "line"),
    [
        ({"head_dim": 7}, "gpt.head_dim=7: odd; RoPE rotates pairs of a head's dims, so set "
         "--gpt.head-dim to an even width such as 8"),
        ({"head_dim": -4}, "gpt.head_dim=-4: must be an integer ≥ 0 (0 = d_model / n_heads)"),
        ({"d_model": 30, "n_heads": 4}, "gpt.d_model=30: not divisible by n_heads = 4; use a "
         "multiple of 4"),
        ({"style": "gpt2", "qk_norm": True}, "gpt.qk_norm=True: the query/key RMSNorm is for "
         "style='llama' (Qwen3); leave it False for gpt2"),
    ],
)  # fmt: skip
def test_bad_head_settings_get_one_line(fields, line):
    with pytest.raises(ValueError) as e:
        GPTConfig(**fields)
    assert str(e.value) == line


def test_heads_wider_than_d_model_need_not_divide_it():
    cfg = GPTConfig(d_model=30, n_heads=4, head_dim=16)  # 4 × 16 = 64 ≠ 30
    assert cfg.head_width == 16
    assert MoEConfig(d_model=30, n_heads=4, head_dim=16).backbone.head_width == 16
    with pytest.raises(ValueError, match="moe.head_dim=9: odd"):
        MoEConfig(head_dim=9)


def test_flops_count_the_heads_width_not_d_model():
    wide = dataclasses.replace(LAYOUT_CFG, head_dim=24)
    D, L = wide.d_model, wide.n_layers
    extra = L * (2 * D * 4 * 12 + 2 * D * 2 * 12)  # q, o: H·ΔK·D each; k, v: G·ΔK·D each
    assert wide.matmul_params() - LAYOUT_CFG.matmul_params() == extra
    assert (
        wide.flops_per_token(T) - LAYOUT_CFG.flops_per_token(T) == 6 * extra + 12 * L * 4 * 12 * T
    )


def test_query_heads_that_tensor_does_not_divide_are_refused_in_one_line():
    mesh = make_mesh("tensor=4,data=2")  # the fixture's 6 query heads
    with pytest.raises(ValueError) as e:
        hf.load_model(FIXTURES / "qwen3", mesh=mesh, rules=rules_for("tp", mesh))
    assert str(e.value) == (
        "parameter 'blocks/attn/o/kernel' (2, 6, 24, 64): dimension 1 (heads=6) is not divisible "
        "by mesh tensor=4 = 4; change the size to a multiple of 4 or shard 'heads' over fewer "
        "devices"
    )


def test_an_export_the_architecture_cannot_hold_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="LlamaForCausalLM: qk_norm=True: Llama has no query/key"):
        hf.adapter_for(QWEN3, "LlamaForCausalLM")
    with pytest.raises(
        ValueError, match="GPT2LMHeadModel: head_dim=24: GPT-2's heads split d_model"
    ):
        hf.adapter_for(GPTConfig(style="gpt2", d_model=64, n_heads=4, head_dim=24), "gpt2")
