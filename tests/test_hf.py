"""Tests for meshtrain.hf: Hugging Face import and export (GPT-2, Llama, Llama 3.1's RoPE
scaling, Mistral, Qwen2) against fixtures made by transformers (scripts/make_hf_fixtures.py;
no torch here). Refusals are in test_hf_errors.py, the adapter registry in
test_hf_registry.py."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hf_helpers import (
    ATOL,
    EXPECTED,
    FIXTURES,
    NAMES,
    abstract,
    copy,
    edit_config,
    edit_tensors,
    forward,
    random_params,
    read,
    reference,
)
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from meshtrain import hf
from meshtrain.layout import activation_rules, named, rules_for, state_specs
from meshtrain.mesh import make_mesh
from meshtrain.models import GPTConfig, layers


@pytest.fixture(scope="module")
def loaded():
    """name → (config, params, jitted forward(params, tokens)) for each fixture."""
    out = {}
    for name in NAMES:
        cfg, params = hf.load_pretrained(FIXTURES / name)
        out[name] = (cfg, params, forward(cfg))
    return out


def _max_error(forward, params, name) -> float:
    tokens, want = reference(name)
    return float(np.abs(np.asarray(forward(params, tokens)) - want).max())


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(loaded, name):
    cfg, params, forward = loaded[name]
    assert cfg == EXPECTED[name]
    tokens, want = reference(name)
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


def _qkv_biases_dropped(p):
    for n in "qkv":
        p["blocks"]["attn"][n]["bias"] = np.zeros_like(p["blocks"]["attn"][n]["bias"])


def _bias_heads_flipped(p):  # q bias reshaped [K, H] instead of [H, K]
    b = np.asarray(p["blocks"]["attn"]["q"]["bias"])
    L, H, K = b.shape
    p["blocks"]["attn"]["q"]["bias"] = b.reshape(L, K, H).swapaxes(1, 2)


@pytest.mark.parametrize(
    "name,mistake",
    [
        ("gpt2", _swap_qk),
        ("gpt2", _conv1d_untransposed),
        ("llama", _interleaved_rope),
        ("llama", _wrong_gqa_groups),
        ("qwen2", _qkv_biases_dropped),
        ("qwen2", _bias_heads_flipped),
    ],
)
def test_plausible_mapping_mistakes_fail_the_tolerance(loaded, name, mistake):
    """The parity check can fail: each classic conversion slip moves the logits far past ATOL."""
    _, params, forward = loaded[name]
    wrong = jax.tree.map(np.asarray, params)
    mistake(wrong)
    err = _max_error(forward, wrong, name)
    assert err > 100 * ATOL, f"{mistake.__name__} moved the logits by only {err:.1e}"


def _unblended_llama3(inv_freq_k, factor, low, high, original):
    """Llama 3.1's scaling without the blend: the middle band kept as is."""
    slow = original * inv_freq_k / (2 * np.pi) < low
    return jnp.where(slow, inv_freq_k / factor, inv_freq_k)


@pytest.mark.parametrize(
    "name,change",
    [
        ("llama3", dict(rope_scaling="none", rope_original_max_seq_len=8192)),  # scaling off
        ("llama3", dict(rope_original_max_seq_len=128)),  # max_position_embeddings instead
        ("llama3", dict(rope_factor=4.0)),
        ("llama3", _unblended_llama3),
        ("mistral", dict(sliding_window=0)),  # window off
        ("mistral", dict(sliding_window=15)),  # [t - w, t) instead of (t - w, t]
        ("mistral", dict(sliding_window=17)),
    ],
    ids=lambda c: (
        c
        if isinstance(c, str)
        else getattr(c, "__name__", None) or ",".join(f"{k}={v}" for k, v in c.items())
    ),
)
def test_feature_slips_fail_the_tolerance(loaded, monkeypatch, name, change):
    """Each new feature is visible in the fixture: getting it wrong (or leaving it out) moves
    the logits far past ATOL."""
    cfg, params, _ = loaded[name]
    if callable(change):
        monkeypatch.setattr(layers, "llama3_frequencies", change)
    else:
        cfg = dataclasses.replace(cfg, **change)
    err = _max_error(forward(cfg), params, name)
    assert err > 100 * ATOL, f"{change} moved the logits by only {err:.1e}"


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "qwen2", "qwen3"])
def test_load_onto_mesh_fsdp_tp(name):
    """Placed on data=2 × fsdp=2 × tensor=2 by fsdp+tp rules: intended shardings, same logits."""
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    rules = rules_for("fsdp+tp", mesh)
    model = hf.load_model(FIXTURES / name, mesh=mesh, rules=rules)
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

    tokens, ref = reference(name)
    tokens = np.concatenate([tokens, tokens[::-1]])  # batch 4 = data × fsdp

    @jax.jit
    def forward(params, tokens):
        with activation_rules(mesh, rules):
            return nnx.merge(graphdef, params)(tokens)

    got = np.asarray(forward(params, tokens))
    np.testing.assert_allclose(got, np.concatenate([ref, ref[::-1]]), rtol=0, atol=ATOL)


_LLAMA3 = dict(rope_scaling="llama3", rope_factor=32.0, rope_original_max_seq_len=8192)
# name → (config, the architecture it is written as)
ROUND_TRIP = {
    "gpt2-untied": (
        GPTConfig(style="gpt2", d_model=32, n_layers=2, n_heads=2, max_seq_len=16),
        "GPT2LMHeadModel",
    ),
    "gpt2-tied-dff": (
        GPTConfig(
            style="gpt2", d_model=32, n_layers=3, n_heads=4, d_ff=48, tie_embeddings=True,
            norm_eps=1e-4,
        ),
        "GPT2LMHeadModel",
    ),
    "llama-gqa-tied": (
        GPTConfig(
            d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, tie_embeddings=True, rope_theta=5e5
        ),
        "LlamaForCausalLM",
    ),
    "llama-mha-untied": (
        GPTConfig(d_model=48, n_layers=1, n_heads=3, d_ff=80, vocab_size=100),
        "LlamaForCausalLM",
    ),
    "llama3-scaled": (
        GPTConfig(d_model=32, n_layers=2, n_heads=2, rope_theta=5e5, **_LLAMA3),
        "LlamaForCausalLM",
    ),
    "mistral-window": (
        GPTConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, sliding_window=8),
        "MistralForCausalLM",
    ),
    "qwen2-bias-tied": (
        GPTConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, qkv_bias=True,
                  tie_embeddings=True, rope_theta=1e6),
        "Qwen2ForCausalLM",
    ),
    "qwen2-bias-window-llama3": (
        GPTConfig(d_model=32, n_layers=1, n_heads=2, qkv_bias=True, sliding_window=5, **_LLAMA3),
        "Qwen2ForCausalLM",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_export_then_import_is_identity(tmp_path, name):
    cfg, architecture = ROUND_TRIP[name]
    params = random_params(cfg, seed=len(name))
    if name == "llama-gqa-tied":  # the nnx.Module form of the argument
        hf.save_pretrained(tmp_path / name, nnx.merge(nnx.graphdef(abstract(cfg)), params))
    else:
        hf.save_pretrained(tmp_path / name, params, cfg)
    assert json.loads((tmp_path / name / "config.json").read_text())["architectures"] == [
        architecture
    ]
    cfg2, params2 = hf.load_pretrained(tmp_path / name)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, jax.tree.map(np.asarray, params2))
    tensors = read(tmp_path / name / "model.safetensors")
    want = {hf.adapter_for(cfg).key(k): v for k, v in hf.hf_shapes(cfg).items()}
    assert {k: v.shape for k, v in tensors.items()} == want
    assert {v.dtype for v in tensors.values()} == {np.dtype(np.float32)}


def test_a_plain_llama_config_exports_as_mistral_when_asked(tmp_path):
    cfg = ROUND_TRIP["llama-mha-untied"][0]
    params = random_params(cfg, seed=0)
    hf.save_pretrained(tmp_path / "m", params, cfg, architecture="MistralForCausalLM")
    written = json.loads((tmp_path / "m" / "config.json").read_text())
    assert written["architectures"] == ["MistralForCausalLM"]
    assert written["sliding_window"] is None  # full attention, not transformers' default 4096
    cfg2, params2 = hf.load_pretrained(tmp_path / "m")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, jax.tree.map(np.asarray, params2))


def test_padded_vocabulary_is_dropped_on_export_and_zero_on_import(tmp_path):
    """A GPT-2-shaped vocabulary of 50257 ids is 50304 rows in meshtrain (vocab_multiple=128):
    the files and config.json hold 50257; import pads with zero rows, and the padding changes
    no real logit (the same file loaded unpadded gives the same logits)."""
    cfg = GPTConfig(
        style="gpt2", vocab_size=50257, d_model=32, n_layers=1, n_heads=2, max_seq_len=16,
        tie_embeddings=True,
    )  # fmt: skip
    assert cfg.padded_vocab == 50304
    params = random_params(cfg, seed=5)
    hf.save_pretrained(tmp_path / "m", params, cfg)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["vocab_size"] == 50257
    wte = read(tmp_path / "m" / "model.safetensors")["transformer.wte.weight"]
    np.testing.assert_array_equal(wte, params["embed"]["embedding"][:50257])

    cfg2, params2 = hf.load_pretrained(tmp_path / "m")
    assert cfg2 == cfg and params2["embed"]["embedding"].shape == (50304, 32)
    jax.tree.map(np.testing.assert_array_equal, params, jax.tree.map(np.asarray, params2))

    plain = dataclasses.replace(cfg, vocab_multiple=1)
    _, unpadded = hf.load_pretrained(tmp_path / "m", config=plain)
    tokens = np.random.default_rng(0).integers(0, 50257, (2, 16))
    run = lambda c, p: np.asarray(nnx.merge(nnx.graphdef(abstract(c)), p)(tokens))
    padded_logits, want = run(cfg, params2), run(plain, unpadded)
    np.testing.assert_allclose(padded_logits[..., :50257], want, rtol=0, atol=ATOL)
    assert np.all(padded_logits[..., 50257:] == layers.PADDED_LOGIT)


@pytest.mark.parametrize("name", NAMES)
def test_reexport_of_fixture_reproduces_its_files(loaded, tmp_path, name):
    """Fixture → meshtrain → export in the fixture's dtype: same keys, shapes, dtypes, bits."""
    cfg, params, _ = loaded[name]
    fixture_json = json.loads((FIXTURES / name / "config.json").read_text())
    hf.save_pretrained(tmp_path / name, params, cfg, dtype=fixture_json["dtype"])
    want, got = (
        read(FIXTURES / name / "model.safetensors"),
        read(tmp_path / name / "model.safetensors"),
    )
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {
        k: (v.shape, v.dtype) for k, v in want.items()
    }
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key
    exported = json.loads((tmp_path / name / "config.json").read_text())
    assert hf.config_from_hf(exported) == hf.config_from_hf(fixture_json) == cfg
    for key in ("architectures", "model_type", "vocab_size", "tie_word_embeddings", "dtype"):
        assert exported[key] == fixture_json[key], key
    for key in ("rope_parameters", "sliding_window", "use_sliding_window", "layer_types"):
        assert exported.get(key) == fixture_json.get(key), key


def test_llama3_scaling_reads_from_rope_scaling_as_llama_3_1_files_write_it(loaded, tmp_path):
    """Llama 3.1/3.2 files (transformers 4) put the scaling under ``rope_scaling`` and theta at
    the top level; transformers 5 puts both under ``rope_parameters``. Same config either way;
    without original_max_position_embeddings transformers takes max_position_embeddings."""
    path = copy(tmp_path, "llama3")
    rope = json.loads((path / "config.json").read_text())["rope_parameters"]
    theta = rope.pop("rope_theta")
    edit_config(path, drop=["rope_parameters"], rope_scaling=rope, rope_theta=theta)
    cfg, params = hf.load_pretrained(path)
    assert cfg == EXPECTED["llama3"]
    jax.tree.map(np.testing.assert_array_equal, params, loaded["llama3"][1])

    del rope["original_max_position_embeddings"]
    edit_config(path, rope_scaling=rope)
    assert hf.load_pretrained(path)[0].rope_original_max_seq_len == 128


def test_qwen2_window_on_every_layer_is_read(tmp_path):
    """use_sliding_window with max_window_layers=0 slides every layer: one window for all."""
    path = copy(tmp_path, "qwen2")
    edit_config(path, drop=["layer_types"], use_sliding_window=True, sliding_window=8,
                max_window_layers=0)  # fmt: skip
    assert hf.load_pretrained(path)[0].sliding_window == 8
    edit_config(path, max_window_layers=2)  # no layer reaches it: no window
    assert hf.load_pretrained(path)[0].sliding_window == 0


def test_export_of_sharded_params(tmp_path):
    """Parameters sharded over fsdp+tp export to the same file as unsharded ones."""
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    cfg, params = hf.load_pretrained(
        FIXTURES / "llama", mesh=mesh, rules=rules_for("fsdp+tp", mesh)
    )
    hf.save_pretrained(tmp_path / "out", params, cfg, dtype="bfloat16")
    want, got = (
        read(FIXTURES / "llama" / "model.safetensors"),
        read(tmp_path / "out" / "model.safetensors"),
    )
    assert sorted(got) == sorted(want)
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)


def test_older_and_sharded_file_layouts_load_the_same(loaded, tmp_path):
    """Unprefixed keys with saved buffers (the hub's original gpt2 files) and a sharded index."""
    old = copy(tmp_path, "gpt2")

    def legacy(t):
        for key in list(t):
            t[key.removeprefix("transformer.")] = t.pop(key)
        t["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
        t["h.0.attn.masked_bias"] = np.array(-1e4, np.float32)

    edit_tensors(old, legacy)
    _, params = hf.load_pretrained(old)
    jax.tree.map(np.testing.assert_array_equal, params, loaded["gpt2"][1])

    sharded = tmp_path / "sharded"
    shutil.copytree(FIXTURES / "llama", sharded)
    tensors = read(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    weight_map = {}
    for i, part in enumerate((sorted(tensors)[:9], sorted(tensors)[9:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, sharded / name)
        weight_map |= dict.fromkeys(part, name)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _, params = hf.load_pretrained(sharded)
    jax.tree.map(np.testing.assert_array_equal, params, loaded["llama"][1])


def test_base_model_with_a_tied_head_loads(loaded, tmp_path):
    """``LlamaModel`` files (no ``model.`` prefix) load when the head is the embedding."""
    path = copy(tmp_path, "llama3")
    edit_config(path, architectures=["LlamaModel"])
    edit_tensors(path, lambda t: t.update({k.removeprefix("model."): t.pop(k) for k in list(t)}))
    _, params = hf.load_pretrained(path)
    jax.tree.map(np.testing.assert_array_equal, params, loaded["llama3"][1])


def test_config_override_keeps_training_fields_and_checks_the_rest():
    cfg = dataclasses.replace(EXPECTED["llama"], remat="full", dtype="bfloat16")
    got, _ = hf.load_pretrained(FIXTURES / "llama", config=cfg)
    assert got == cfg
    with pytest.raises(ValueError, match=r"config= does not match config.json \(n_layers: 3 vs 2"):
        hf.load_pretrained(FIXTURES / "llama", config=dataclasses.replace(cfg, n_layers=3))
    for name, change, match in [
        ("mistral", dict(sliding_window=0), r"sliding_window: 0 vs 16"),
        ("qwen2", dict(qkv_bias=False), r"qkv_bias: False vs True"),
        ("llama3", dict(rope_factor=4.0), r"rope_factor: 4.0 vs 8.0"),
    ]:
        with pytest.raises(ValueError, match=match):
            hf.load_pretrained(
                FIXTURES / name, config=dataclasses.replace(EXPECTED[name], **change)
            )
