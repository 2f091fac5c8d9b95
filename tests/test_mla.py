"""Multi-head latent attention (`meshtrain.models.mla`) and the dense DeepSeek-V3 import: logits
against transformers' (fixtures by scripts/make_hf_mla_fixture.py; no torch here), plausible
slips that must miss them, export round trips, the checks, and equality with one device under
fsdp+tp with remat, a gpipe pipeline and context parallelism, on packed batches.

Tolerances: float32 logits within 1e-5 of the largest |logit| (measured 5e-7 and 1e-6), 16-bit
compute as `HALF_REL`; training steps as tests/test_pipeline.py's (1e-5 relative on losses,
2e-5 of each parameter's largest entry).
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hf_helpers import FIXTURES, copy, edit_config, forward, random_params, read, reference
from _pipeline_helpers import LOSS_RTOL, assert_close
from _pipeline_helpers import random_params as random_model
from flax import nnx
from test_pipeline_packed import packed_batch

from meshtrain import hf, metrics
from meshtrain.hf import deepseek_v3
from meshtrain.layout import activation_rules, batch_shardings, rules_for, shard_batch
from meshtrain.lower import init_train_state, jit_train_step
from meshtrain.mesh import make_mesh
from meshtrain.models import GPTConfig, MoEConfig, build_model, mla
from meshtrain.pipeline import PipelineConfig
from meshtrain.problem import RunCheckError
from meshtrain.run import RunSpec
from meshtrain.state import TrainState
from meshtrain.train.step import train_step

NAMES = ("deepseek_v3_dense/qlora", "deepseek_v3_dense/qproj")
REL = 1e-5  # of the largest |logit|
_SIZES = dict(d_model=64, n_layers=2, n_heads=4, d_ff=96, norm_eps=1e-6, max_seq_len=64)
_LATENT = dict(attention="mla", mla_kv_rank=24, mla_nope_dim=16, mla_rope_dim=8, mla_v_dim=12)
EXPECTED = {
    name: GPTConfig(vocab_size=128, **_SIZES, **_LATENT, mla_q_rank=rank)
    for name, rank in zip(NAMES, (32, 0), strict=True)
}


def _rel_error(cfg, params, name) -> float:
    tokens, want = reference(name)
    got = np.asarray(forward(cfg)(params, tokens))[..., : cfg.vocab_size]
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
    cfg, params = hf.load_pretrained(FIXTURES / name)
    assert cfg == EXPECTED[name]
    assert _rel_error(cfg, params, name) <= REL
    assert np.abs(reference(name)[1]).max() > 2.0  # far from uniform: the check bites


# Of the largest |logit|; measured 9.6e-3 (bfloat16) and 1.3e-3 (float16).
HALF_REL = {"bfloat16": 2.5e-2, "float16": 4e-3}


@pytest.mark.parametrize("dtype", HALF_REL)
def test_half_precision_logits_stay_near_transformers(dtype):
    """The projections and attention in a 16-bit compute dtype (float32 parameters): within a
    few roundings of transformers' float32 logits, and visibly not float32."""
    name = NAMES[0]
    cfg, params = hf.load_pretrained(FIXTURES / name)
    err = _rel_error(dataclasses.replace(cfg, dtype=dtype), params, name)
    assert 1e-4 < err <= HALF_REL[dtype]


def _rope_on_nope_part(x_BTHE, nope, cos, sin):
    rope = cos.shape[-1] * 2
    rotated = mla.layers.apply_rope(x_BTHE[..., :rope], cos, sin)
    return jnp.concatenate([rotated, x_BTHE[..., rope:]], axis=-1)


def _scale_by_value_width(q_BTHE, k_BTHE, v_BTHV, **kw):
    E, V = q_BTHE.shape[-1], v_BTHV.shape[-1]
    return mla.layers.causal_attention(q_BTHE * np.sqrt(E / V), k_BTHE, v_BTHV, **kw)


SLIPS = {
    "rope rows left interleaved": (deepseek_v3, "_deinterleave", np.arange),
    "rope on the nope dims": (mla, "rotate_rope_part", _rope_on_nope_part),
    "softmax scale of the value width": (mla, "attend", _scale_by_value_width),
}


@pytest.mark.parametrize("slip", SLIPS)
def test_plausible_slips_miss_transformers(monkeypatch, slip):
    module, attr, wrong = SLIPS[slip]
    monkeypatch.setattr(module, attr, wrong)
    name = NAMES[0]
    cfg, params = hf.load_pretrained(FIXTURES / name)
    assert _rel_error(cfg, params, name) > 100 * REL


@pytest.mark.parametrize("rank", [0, 16])
def test_export_then_import_is_identity(tmp_path, rank):
    cfg = GPTConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=2,
                    attention="mla", mla_q_rank=rank, mla_kv_rank=8, mla_nope_dim=6,
                    mla_rope_dim=4, mla_v_dim=10)  # fmt: skip
    params = random_params(cfg, seed=rank)
    hf.save_pretrained(tmp_path / "m", params, cfg)
    written = json.loads((tmp_path / "m" / "config.json").read_text())
    assert written["architectures"] == ["DeepseekV3ForCausalLM"]
    assert written["first_k_dense_replace"] == cfg.n_layers and written["rope_interleave"]
    cfg2, params2 = hf.load_pretrained(tmp_path / "m")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, jax.tree.map(np.asarray, params2))


def test_reexport_of_fixture_reproduces_its_tensors(tmp_path):
    """Export writes the rope rows interleaved again, as transformers stores them."""
    name = NAMES[0]
    cfg, params = hf.load_pretrained(FIXTURES / name)
    hf.save_pretrained(tmp_path / "m", params, cfg, dtype="bfloat16")
    want, got = (
        read(FIXTURES / name / "model.safetensors"),
        read(tmp_path / "m" / "model.safetensors"),
    )
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_moe_layers_are_refused_in_one_line(tmp_path):
    path = copy(tmp_path, NAMES[0])
    edit_config(path, first_k_dense_replace=1)
    with pytest.raises(ValueError, match="first_k_dense_replace=1.*n_routed_experts=256") as e:
        hf.load_pretrained(path)
    assert "\n" not in str(e.value) and "not implemented yet" in str(e.value)


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (dict(rope_interleave=False), "rope_interleave=False"),
        (dict(num_key_value_heads=2), "num_key_value_heads=2"),
    ],
)
def test_unsupported_deepseek_fields_are_refused(tmp_path, changes, field):
    path = copy(tmp_path, NAMES[1])
    edit_config(path, **changes)
    with pytest.raises(ValueError, match=field):
        hf.load_pretrained(path)


def test_llama_layouts_refuse_latent_attention():
    cfg = EXPECTED[NAMES[0]]
    assert hf.adapter_for(cfg).name == "DeepseekV3ForCausalLM"
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        with pytest.raises(ValueError, match="attention"):
            hf.adapter_for(cfg, arch)
    assert hf.adapter_for(dataclasses.replace(cfg, **{k: getattr(GPTConfig, k) for k in
        ("attention", "mla_q_rank", "mla_kv_rank", "mla_nope_dim", "mla_rope_dim",
         "mla_v_dim")})).name == "LlamaForCausalLM"  # fmt: skip


# --- the checks and the counts -----------------------------------------------------------------


@pytest.mark.parametrize(
    "changes,line",
    [
        (dict(mla_rope_dim=7), "gpt.mla_rope_dim=7: must be even"),
        (dict(mla_kv_rank=0), "gpt.mla_kv_rank=0: must be a positive integer"),
        (dict(style="gpt2"), "gpt.style='gpt2': with attention='mla'"),
        (dict(n_kv_heads=2), "gpt.n_kv_heads=2: with attention='mla'"),
        (dict(attention_impl="cudnn"), "gpt.attention_impl='cudnn': with attention='mla'"),
        (dict(sliding_window=8), "gpt.sliding_window=8: with attention='mla'"),
        (dict(rope_scaling="llama3"), "gpt.rope_scaling='llama3': with attention='mla'"),
        (dict(attention="mha", mla_v_dim=8), "gpt.mla_v_dim=8: has no effect with attention='mha'"),
        (dict(attention="gqa"), "gpt.attention='gqa': choose from mha, mla"),
    ],
)
def test_bad_settings_get_one_line_each(changes, line):
    with pytest.raises(RunCheckError) as e:
        GPTConfig(**_LATENT | changes)
    assert any(str(p).startswith(line) for p in e.value.problems), e.value.problems


def test_flop_count_follows_the_latent_widths():
    """matmul_params is the model's kernel entries; attention is counted over q·k (E = 24) and
    p·v (V = 12) apart."""
    for cfg in EXPECTED.values():
        model = nnx.eval_shape(lambda cfg=cfg: build_model(cfg))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        kernels = [x.size for p, x in jax.tree_util.tree_leaves_with_path(params)
                   if "kernel" in jax.tree_util.keystr(p)]  # fmt: skip
        assert cfg.matmul_params() == sum(kernels)
        T = 32
        assert cfg.flops_per_token(T) == 6 * sum(kernels) + 6 * 2 * 4 * (24 + 12) * T
        assert metrics.gpt_flops_per_token(cfg, T, "palm") == cfg.flops_per_token(T)
    # by hand, mla_q_rank=32: q 64·32 + 32·4·24, kv_a 64·32, kv_b 24·4·28, o 4·12·64
    assert EXPECTED[NAMES[0]].attention_params() == 2048 + 3072 + 2048 + 2688 + 3072


def test_moe_blocks_take_latent_attention():
    cfg = MoEConfig(d_model=32, n_heads=2, n_experts=2, top_k=1, vocab_size=64,
                    vocab_multiple=64, max_seq_len=8, attention="mla", mla_kv_rank=8,
                    mla_nope_dim=8, mla_rope_dim=4, mla_v_dim=8)  # fmt: skip
    model = nnx.eval_shape(lambda: build_model(cfg))
    assert isinstance(model.groups.moe_block.attn, mla.LatentAttention)
    graphdef, params = random_model(cfg, seed=8)
    logits = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t).logits)(params, np.zeros((1, 8), int))
    assert logits.shape == (1, 8, 64) and np.all(np.isfinite(np.asarray(logits)))
    # q 32·2·12, kv_a 32·12, kv_b 8·2·16, o 2·8·32; attention over E = 12 and V = 8
    assert cfg.backbone.attention_params() == 768 + 384 + 256 + 512
    assert cfg.flops_per_token(8) - 6 * cfg.matmul_params() == 6 * 2 * 2 * (12 + 8) * 8


# --- layouts against one device ----------------------------------------------------------------

B, T, VOCAB, STEPS = 16, 16, 64, 2
TX = optax.sgd(0.5)
CFG = GPTConfig(d_model=32, n_layers=4, n_heads=4, max_seq_len=T, vocab_size=VOCAB,
                vocab_multiple=64, attention="mla", mla_q_rank=16, mla_kv_rank=8,
                mla_nope_dim=6, mla_rope_dim=4, mla_v_dim=6)  # fmt: skip


_ONE_DEVICE = {}


def _one_device(cfg, batches):
    """Random parameters and STEPS plain steps of `cfg` on `batches` (one run per config)."""
    if cfg not in _ONE_DEVICE:
        _ONE_DEVICE[cfg] = _plain_steps(cfg, batches)
    return _ONE_DEVICE[cfg]


def _batches():
    rng = np.random.default_rng(17)
    return [packed_batch(rng) for _ in range(STEPS)]


def _plain_steps(cfg, batches):
    graphdef, params = random_model(cfg, seed=3)
    state = TrainState(jnp.zeros((), jnp.int32), params, TX.init(params), {})
    plain = jax.jit(lambda st, b: train_step(graphdef, TX, st, b, run=RunSpec()))
    losses = []
    for batch in batches:
        state, metrics = plain(state, batch)
        losses.append(float(metrics["loss"]))
    return (graphdef, params), losses, jax.tree.map(np.asarray, state.params)


def _laid_out(model, batches, mesh, rules, pipeline=None):
    graphdef, state, shardings = init_train_state(lambda: model, TX, mesh, rules)
    shard = batch_shardings(batches[0], mesh, rules)
    run = RunSpec(mesh=mesh, rules=rules, **({"pipeline": pipeline} if pipeline else {}))
    step = jit_train_step(run, graphdef, TX, shardings, shard)
    losses = []
    for batch in batches:
        state, metrics = step(state, shard_batch(batch, mesh, rules))
        losses.append(float(metrics["loss"]))
    return losses, state


GPIPE = PipelineConfig(schedule="gpipe", microbatches=4)
# mesh, strategy, context parallelism, pipeline, remat of the laid-out run, value width: the
# value width 6 is below the query/key width 10, as in DeepSeek-V3 (context parallelism pads
# the values); 12 is above it (the queries and keys are padded).
LAYOUTS = {
    "fsdp+tp,remat": ("fsdp=4,tensor=2", "fsdp+tp", "ring", None, "save-attention-out", 6),
    "gpipe": ("pipe=2,data=4", "dp", "ring", GPIPE, "none", 6),
    "ring": ("data=4,seq=2", "dp", "ring", None, "none", 6),
    "ulysses,wide-values": ("data=4,seq=2", "dp", "ulysses", None, "none", 12),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_steps_equal_one_device(layout):
    mesh_spec, strategy, context, pipeline, remat, v_dim = LAYOUTS[layout]
    cfg = dataclasses.replace(CFG, mla_v_dim=v_dim)
    batches = _batches()
    (_, params), want_losses, want_params = _one_device(cfg, batches)
    graphdef, _ = random_model(dataclasses.replace(cfg, remat=remat), seed=3)
    mesh = make_mesh(mesh_spec)
    rules = rules_for(strategy, mesh, context_parallel=context)
    assert not cfg.check_layout(dict(mesh.shape), rules)
    losses, state = _laid_out(nnx.merge(graphdef, params), batches, mesh, rules, pipeline)
    np.testing.assert_allclose(losses, want_losses, rtol=LOSS_RTOL)
    assert_close(jax.tree.map(np.asarray, state.params), want_params, layout)
    if strategy == "fsdp+tp":  # heads over tensor; the model width, else the latent, over fsdp
        blocks = state.params["blocks"]["attn"]
        attn = {k: tuple(v["kernel"].sharding.spec) for k, v in blocks.items() if "kernel" in v}
        assert attn["kv_b"][:3] == (None, "fsdp", "tensor")
        assert attn["q_a"][:3] == (None, "fsdp", None)


def test_allgather_context_parallel_logits_equal_one_device():
    """The all-gather algorithm over seq=2 (forward only; its backward is the one the ring
    and Ulysses steps above share): the logits of a packed batch."""
    graphdef, params = random_model(CFG, seed=9)
    batch = _batches()[0]
    packed = {"segment_ids": batch["segment_ids"], "positions": batch["positions"]}
    mesh = make_mesh("data=4,seq=2")
    rules = rules_for("dp", mesh, context_parallel="allgather")

    def run(params, tokens, laid_out):
        model = nnx.merge(graphdef, params)
        if not laid_out:
            return model(tokens, **packed)
        with activation_rules(mesh, rules):
            return model(tokens, **packed)

    want = jax.jit(run, static_argnums=2)(params, batch["inputs"], False)
    got = jax.jit(run, static_argnums=2)(params, batch["inputs"], True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


def test_packed_documents_see_only_themselves():
    """A document's logits inside a packed row equal its logits alone, positions restarted."""
    graphdef, params = random_model(CFG, seed=4)
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, VOCAB, (1, 6)), rng.integers(0, VOCAB, (1, 10))
    row = np.concatenate([a, b], axis=1)
    seg = np.array([[1] * 6 + [2] * 10])
    pos = np.array([list(range(6)) + list(range(10))])
    run = jax.jit(lambda t, **kw: nnx.merge(graphdef, params)(t, **kw))
    packed = np.asarray(run(row, segment_ids=seg, positions=pos))
    np.testing.assert_allclose(packed[:, :6], np.asarray(run(a)), rtol=0, atol=1e-5)
    np.testing.assert_allclose(packed[:, 6:], np.asarray(run(b)), rtol=0, atol=1e-5)
