"""Tests for meshtrain.hf: Hugging Face GPT-2 / Llama import and export, against fixtures made by
transformers (scripts/make_hf_fixtures.py; no torch here)."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import save_file

from meshtrain import hf
from meshtrain.layout import activation_rules, named, rules_for, state_specs
from meshtrain.mesh import make_mesh
from meshtrain.models import GPT, GPTConfig, layers

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
STYLES = ("gpt2", "llama")
# float32 logits, |logit| up to ~3.4: measured max error 1.4e-6 (gpt2) and 2.3e-6 (llama).
ATOL = 2e-5

# What the fixtures' config.json files describe (see scripts/make_hf_fixtures.py).
EXPECTED = {
    "gpt2": GPTConfig(
        style="gpt2", vocab_size=256, max_seq_len=32, d_model=64, n_layers=2, n_heads=4,
        d_ff=128, norm_eps=1e-5, tie_embeddings=True,
    ),
    "llama": GPTConfig(
        style="llama", vocab_size=256, max_seq_len=64, d_model=64, n_layers=2, n_heads=4,
        n_kv_heads=2, d_ff=96, rope_theta=1000.0, norm_eps=1e-6, tie_embeddings=False,
    ),
}  # fmt: skip


def _reference(style):
    """The fixture's tokens [2, T] and transformers' float32 logits [2, T, V]."""
    ref = np.load(FIXTURES / f"{style}_logits.npz")
    return ref["tokens"], ref["logits"]


def _abstract(cfg):
    """The GPT of `cfg` as shape structs (no initialisers run)."""
    return nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))


def _random_params(cfg, seed):
    """Fresh random float32 params (biases and norm scales included) with the model's tree; the
    padded vocabulary's rows are zero, as the model keeps them."""
    rng = np.random.default_rng(seed)
    abstract = nnx.to_pure_dict(nnx.state(_abstract(cfg), nnx.Param))
    params = jax.tree.map(lambda x: rng.normal(0, 0.5, x.shape).astype(np.float32), abstract)
    params["embed"]["embedding"][cfg.vocab_size :] = 0
    if "head" in params:
        params["head"]["kernel"][:, cfg.vocab_size :] = 0
    return params


def _read(path):
    """Every tensor of a safetensors file: key → numpy array (stored dtype)."""
    with safe_open(path, framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def loaded():
    """style → (config, params, jitted forward(params, tokens)) for each fixture."""
    out = {}
    for style in STYLES:
        cfg, params = hf.load_pretrained(FIXTURES / style)
        graphdef = nnx.graphdef(_abstract(cfg))
        out[style] = (cfg, params, jax.jit(lambda p, t, g=graphdef: nnx.merge(g, p)(t)))
    return out


@pytest.mark.parametrize("style", STYLES)
def test_logits_match_transformers(loaded, style):
    cfg, params, forward = loaded[style]
    assert cfg == EXPECTED[style]
    tokens, want = _reference(style)
    got = np.asarray(forward(params, tokens))
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    assert np.abs(want).max() > 1.0  # attention and logits far from uniform: the check bites


def _permute(x, axis, perm):
    return np.take(np.asarray(x), perm, axis=axis)


def _swap_qk(p):
    p["blocks"]["attn"]["q"], p["blocks"]["attn"]["k"] = (
        p["blocks"]["attn"]["k"],
        p["blocks"]["attn"]["q"],
    )


def _conv1d_untransposed(p):
    o = p["blocks"]["attn"]["o"]
    L, H, K, D = o["kernel"].shape
    o["kernel"] = np.asarray(o["kernel"]).reshape(L, D, D).swapaxes(1, 2).reshape(L, H, K, D)


def _interleaved_rope(p):
    K = p["blocks"]["attn"]["q"]["kernel"].shape[-1]
    pairs = np.concatenate([np.arange(0, K, 2), np.arange(1, K, 2)])
    for n in "qk":
        p["blocks"]["attn"][n]["kernel"] = _permute(p["blocks"]["attn"][n]["kernel"], -1, pairs)


def _wrong_gqa_groups(p):
    order = [0, 2, 1, 3]  # query head h served by kv head h % G instead of h // (H / G)
    p["blocks"]["attn"]["q"]["kernel"] = _permute(p["blocks"]["attn"]["q"]["kernel"], 2, order)
    p["blocks"]["attn"]["o"]["kernel"] = _permute(p["blocks"]["attn"]["o"]["kernel"], 1, order)


@pytest.mark.parametrize(
    "style,mistake",
    [
        ("gpt2", _swap_qk),
        ("gpt2", _conv1d_untransposed),
        ("llama", _interleaved_rope),
        ("llama", _wrong_gqa_groups),
    ],
)
def test_plausible_mapping_mistakes_fail_the_tolerance(loaded, style, mistake):
    """The parity check can fail: each classic conversion slip moves the logits far past ATOL."""
    _, params, forward = loaded[style]
    wrong = jax.tree.map(np.asarray, params)
    mistake(wrong)
    tokens, want = _reference(style)
    err = np.abs(np.asarray(forward(wrong, tokens)) - want).max()
    assert err > 100 * ATOL, f"{mistake.__name__} moved the logits by only {err:.1e}"


@pytest.mark.parametrize("style", STYLES)
def test_load_onto_mesh_fsdp_tp(style):
    """Placed on data=2 × fsdp=2 × tensor=2 by fsdp+tp rules: intended shardings, same logits."""
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    rules = rules_for("fsdp+tp", mesh)
    model = hf.load_model(FIXTURES / style, mesh=mesh, rules=rules)
    graphdef, state = nnx.split(model, nnx.Param)
    want = named(state_specs(state, rules.params, mesh, warn=False), mesh)
    params = nnx.to_pure_dict(state)
    for (path, x), s in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want), strict=True
    ):
        assert x.sharding.is_equivalent_to(s, x.ndim), jax.tree_util.keystr(path)
    assert params["embed"]["embedding"].sharding.spec == P("tensor", ("data", "fsdp"))
    assert len(params["blocks"]["attn"]["q"]["kernel"].addressable_shards[0].data.flatten()) == (
        params["blocks"]["attn"]["q"]["kernel"].size // 8
    )

    tokens, ref = _reference(style)
    tokens = np.concatenate([tokens, tokens[::-1]])  # batch 4 = data × fsdp

    @jax.jit
    def forward(params, tokens):
        with activation_rules(mesh, rules):
            return nnx.merge(graphdef, params)(tokens)

    got = np.asarray(forward(params, tokens))
    np.testing.assert_allclose(got, np.concatenate([ref, ref[::-1]]), rtol=0, atol=ATOL)


ROUND_TRIP = {
    "gpt2-untied": GPTConfig(style="gpt2", d_model=32, n_layers=2, n_heads=2, max_seq_len=16),
    "gpt2-tied-dff": GPTConfig(
        style="gpt2", d_model=32, n_layers=3, n_heads=4, d_ff=48, tie_embeddings=True, norm_eps=1e-4
    ),
    "llama-gqa-tied": GPTConfig(
        d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, tie_embeddings=True, rope_theta=5e5
    ),
    "llama-mha-untied": GPTConfig(d_model=48, n_layers=1, n_heads=3, d_ff=80, vocab_size=100),
}


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_export_then_import_is_identity(tmp_path, name):
    cfg = ROUND_TRIP[name]
    params = _random_params(cfg, seed=len(name))
    if name == "llama-gqa-tied":  # the nnx.Module form of the argument
        hf.save_pretrained(tmp_path / name, nnx.merge(nnx.graphdef(_abstract(cfg)), params))
    else:
        hf.save_pretrained(tmp_path / name, params, cfg)
    cfg2, params2 = hf.load_pretrained(tmp_path / name)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, jax.tree.map(np.asarray, params2))
    tensors = _read(tmp_path / name / "model.safetensors")
    want = {hf._hf_key(cfg, k): v for k, v in hf.hf_shapes(cfg).items()}
    assert {k: v.shape for k, v in tensors.items()} == want
    assert {v.dtype for v in tensors.values()} == {np.dtype(np.float32)}


def test_padded_vocabulary_is_dropped_on_export_and_zero_on_import(tmp_path):
    """A GPT-2-shaped vocabulary of 50257 ids is 50304 rows in meshtrain (vocab_multiple=128):
    the files and config.json hold 50257; import pads with zero rows, and the padding changes
    no real logit (the same file loaded unpadded gives the same logits)."""
    cfg = GPTConfig(
        style="gpt2", vocab_size=50257, d_model=32, n_layers=1, n_heads=2, max_seq_len=16,
        tie_embeddings=True,
    )  # fmt: skip
    assert cfg.padded_vocab == 50304
    params = _random_params(cfg, seed=5)
    hf.save_pretrained(tmp_path / "m", params, cfg)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["vocab_size"] == 50257
    wte = _read(tmp_path / "m" / "model.safetensors")["transformer.wte.weight"]
    np.testing.assert_array_equal(wte, params["embed"]["embedding"][:50257])

    cfg2, params2 = hf.load_pretrained(tmp_path / "m")
    assert cfg2 == cfg and params2["embed"]["embedding"].shape == (50304, 32)
    jax.tree.map(np.testing.assert_array_equal, params, jax.tree.map(np.asarray, params2))

    plain = dataclasses.replace(cfg, vocab_multiple=1)
    _, unpadded = hf.load_pretrained(tmp_path / "m", config=plain)
    tokens = np.random.default_rng(0).integers(0, 50257, (2, 16))
    forward = lambda c, p: np.asarray(nnx.merge(nnx.graphdef(_abstract(c)), p)(tokens))
    padded_logits, want = forward(cfg, params2), forward(plain, unpadded)
    np.testing.assert_allclose(padded_logits[..., :50257], want, rtol=0, atol=ATOL)
    assert np.all(padded_logits[..., 50257:] == layers.PADDED_LOGIT)


@pytest.mark.parametrize("style", STYLES)
def test_reexport_of_fixture_reproduces_its_files(loaded, tmp_path, style):
    """Fixture → meshtrain → export in the fixture's dtype: same keys, shapes, dtypes, bits."""
    cfg, params, _ = loaded[style]
    fixture_json = json.loads((FIXTURES / style / "config.json").read_text())
    hf.save_pretrained(tmp_path / style, params, cfg, dtype=fixture_json["dtype"])
    want, got = (
        _read(FIXTURES / style / "model.safetensors"),
        _read(tmp_path / style / "model.safetensors"),
    )
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {
        k: (v.shape, v.dtype) for k, v in want.items()
    }
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key
    exported = json.loads((tmp_path / style / "config.json").read_text())
    assert hf.config_from_hf(exported) == hf.config_from_hf(fixture_json) == cfg
    for key in ("architectures", "model_type", "vocab_size", "tie_word_embeddings", "dtype"):
        assert exported[key] == fixture_json[key], key


def test_export_of_sharded_params(tmp_path):
    """Parameters sharded over fsdp+tp export to the same file as unsharded ones."""
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    cfg, params = hf.load_pretrained(
        FIXTURES / "llama", mesh=mesh, rules=rules_for("fsdp+tp", mesh)
    )
    hf.save_pretrained(tmp_path / "out", params, cfg, dtype="bfloat16")
    want, got = (
        _read(FIXTURES / "llama" / "model.safetensors"),
        _read(tmp_path / "out" / "model.safetensors"),
    )
    assert sorted(got) == sorted(want)
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)


def test_older_and_sharded_file_layouts_load_the_same(loaded, tmp_path):
    """Unprefixed keys with saved buffers (the hub's original gpt2 files) and a sharded index."""
    old = _copy(tmp_path, "gpt2")

    def legacy(t):
        for key in list(t):
            t[key.removeprefix("transformer.")] = t.pop(key)
        t["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
        t["h.0.attn.masked_bias"] = np.array(-1e4, np.float32)

    _edit_tensors(old, legacy)
    _, params = hf.load_pretrained(old)
    jax.tree.map(np.testing.assert_array_equal, params, loaded["gpt2"][1])

    sharded = tmp_path / "sharded"
    shutil.copytree(FIXTURES / "llama", sharded)
    tensors = _read(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    weight_map = {}
    for i, part in enumerate((sorted(tensors)[:9], sorted(tensors)[9:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, sharded / name)
        weight_map |= dict.fromkeys(part, name)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _, params = hf.load_pretrained(sharded)
    jax.tree.map(np.testing.assert_array_equal, params, loaded["llama"][1])


def test_config_override_keeps_training_fields_and_checks_the_rest():
    cfg = dataclasses.replace(EXPECTED["llama"], remat="full", dtype="bfloat16")
    got, _ = hf.load_pretrained(FIXTURES / "llama", config=cfg)
    assert got == cfg
    with pytest.raises(ValueError, match=r"config= does not match config.json \(n_layers: 3 vs 2"):
        hf.load_pretrained(FIXTURES / "llama", config=dataclasses.replace(cfg, n_layers=3))


def _copy(tmp_path, style):
    dst = tmp_path / style
    shutil.copytree(FIXTURES / style, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    tensors = _read(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize(
    "style,config_changes,match",
    [
        (
            "llama",
            {"architectures": ["MistralForCausalLM"]},
            r"'MistralForCausalLM'\] is not supported",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            "RoPE scaling 'linear'",
        ),
        ("llama", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("llama", {"head_dim": 32}, r"head_dim=32 × num_attention_heads=4 ≠ hidden_size=64"),
        ("llama", {"num_key_value_heads": 3}, "n_kv_heads=3 does not divide n_heads=4"),
        ("llama", {"hidden_size": None}, "field 'hidden_size' is missing"),
        ("gpt2", {"activation_function": "relu"}, "activation_function='relu' is not supported"),
        ("gpt2", {"n_layer": 3}, r"missing \['h.2.attn.c_attn.bias'"),
        ("gpt2", {"tie_word_embeddings": False}, r"missing \['lm_head.weight'\]"),
    ],
)
def test_bad_config_is_refused_clearly(tmp_path, style, config_changes, match):
    path = _copy(tmp_path, style)
    _edit_config(path, **config_changes)
    with pytest.raises(ValueError, match=match):
        hf.load_pretrained(path)


def test_bad_tensors_are_refused_clearly(tmp_path):
    path = _copy(tmp_path, "llama")
    _edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        hf.load_pretrained(path)

    path = _copy(tmp_path / "b", "llama")
    _edit_tensors(path, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64)}))
    with pytest.raises(ValueError, match=r"unexpected \['layers.0.self_attn.q_proj.bias'\]"):
        hf.load_pretrained(path)

    path = _copy(tmp_path / "c", "llama")
    wrong = np.zeros((64, 64), np.float32)
    _edit_tensors(path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": wrong}))
    with pytest.raises(
        ValueError,
        match=r"k_proj.weight' has shape \(64, 64\), but config.json implies \(32, 64\)",
    ):
        hf.load_pretrained(path)

    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        hf.load_pretrained(path)
    with pytest.raises(ValueError, match="no config.json"):
        hf.load_pretrained(tmp_path / "nowhere")


def test_bad_mesh_is_refused_before_reading():
    mesh = make_mesh("data=1,tensor=8")  # 4 query heads (2 kv heads would be replicated)
    with pytest.raises(ValueError, match=r"\(heads=4\) is not divisible by mesh tensor=8"):
        hf.load_pretrained(FIXTURES / "llama", mesh=mesh, rules=rules_for("tp", mesh))
    with pytest.raises(ValueError, match="pass mesh and rules together"):
        hf.load_pretrained(FIXTURES / "llama", mesh=mesh)


def test_bad_exports_are_refused_clearly(tmp_path):
    gqa_gpt2 = GPTConfig(style="gpt2", d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)
    with pytest.raises(ValueError, match="GPT-2 has no grouped-query attention"):
        hf.save_pretrained(tmp_path / "a", {}, gqa_gpt2)
    cfg = ROUND_TRIP["llama-gqa-tied"]
    params = _random_params(cfg, seed=0)
    with pytest.raises(ValueError, match="dtype='int8': choose from float32, float16, bfloat16"):
        hf.save_pretrained(tmp_path / "b", params, cfg, dtype="int8")
    with pytest.raises(ValueError, match="pass config="):
        hf.save_pretrained(tmp_path / "c", params)
    with pytest.raises(ValueError, match="params do not fit config"):
        hf.save_pretrained(tmp_path / "c", params, ROUND_TRIP["llama-mha-untied"])
    assert not (tmp_path / "c").exists()
    hf.save_pretrained(tmp_path / "d", params, cfg)
    with pytest.raises(ValueError, match="already holds a model"):
        hf.save_pretrained(tmp_path / "d", params, cfg)
