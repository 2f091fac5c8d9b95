"""meshtrain.hf refusals: each bad config.json, tensor file, mesh or export gives one clear
line that names the field, tensor or fix."""

import json

import numpy as np
import pytest
from _hf_helpers import FIXTURES, copy, edit_config, edit_tensors, random_params

from meshtrain import hf
from meshtrain.layout import rules_for
from meshtrain.mesh import make_mesh
from meshtrain.models import GPTConfig


def _refused(match, fn, *args, **kwargs) -> str:
    """Runs `fn`, expecting a one-line ValueError matching `match`; returns the message."""
    with pytest.raises(ValueError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def _rope(**changes):
    """The llama3 fixture's rope_parameters with `changes` (None drops a key)."""
    rope = json.loads((FIXTURES / "llama3" / "config.json").read_text())["rope_parameters"]
    rope.update(changes)
    return {k: v for k, v in rope.items() if v is not None}


SLIDE = dict(use_sliding_window=True, sliding_window=8)
DROP = object()  # a config_changes value: remove the key


@pytest.mark.parametrize(
    "name,config_changes,match",
    [
        (
            "llama",
            {"architectures": ["GemmaForCausalLM"]},
            r"'GemmaForCausalLM'\] is not supported",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            "RoPE scaling 'linear'",
        ),
        ("llama", {"attention_bias": True}, "attention_bias=True is not supported"),
        ("llama", {"head_dim": 7}, r"head_dim=7: odd; RoPE rotates pairs"),
        ("llama", {"num_key_value_heads": 3}, "num_key_value_heads=3: does not divide n_heads=4"),
        ("llama", {"hidden_size": None}, "hidden_size=null: must not be null"),
        ("gpt2", {"activation_function": "relu"}, "activation_function='relu' is not supported"),
        ("gpt2", {"n_layer": 3}, r"missing \['h.2.attn.c_attn.bias'"),
        ("gpt2", {"tie_word_embeddings": False}, r"missing \['lm_head.weight'\]"),
        ("llama3", {"rope_parameters": _rope(factor=None)}, "'llama3' needs field 'factor'"),
        ("llama3", {"rope_parameters": _rope(factor=0.5)}, r"rope_factor=0.5: must be a number"),
        (
            "llama3",
            {"rope_parameters": _rope(low_freq_factor=4.0, high_freq_factor=1.0)},
            r"rope_low_freq_factor=4.0: and rope_high_freq_factor=1.0 must satisfy",
        ),
        (
            "llama3",
            {"rope_parameters": _rope(partial_rotary_factor=0.5)},
            "partial_rotary_factor=0.5 is not supported: meshtrain rotates the whole head",
        ),
        ("llama3", {"rope_parameters": _rope(rope_type="yarn")}, "RoPE scaling 'yarn'"),
        ("mistral", {"sliding_window": 0}, "sliding_window=0: must be a positive integer"),
        ("mistral", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        (
            "qwen2",
            {**SLIDE, "max_window_layers": 1, "layer_types": DROP},
            r"max_window_layers=1 is not supported: with use_sliding_window=true it gives 1 of 2 ",
        ),
        (
            "qwen2",
            {**SLIDE, "layer_types": ["full_attention", "sliding_attention"]},
            r"layer_types=\['full_attention', 'sliding_attention'\] is not supported: with",
        ),
        (
            "qwen2",
            {"layer_types": ["sliding_attention"] * 2},
            "names sliding layers but use_sliding_window is false",
        ),
        ("qwen2", {"layer_types": ["chunked_attention"] * 2}, "expected 2 entries of"),
    ],
)
def test_bad_config_is_refused_clearly(tmp_path, name, config_changes, match):
    path = copy(tmp_path, name)
    drop = [k for k, v in config_changes.items() if v is DROP]
    edit_config(path, drop=drop, **{k: v for k, v in config_changes.items() if k not in drop})
    message = _refused(match, hf.load_pretrained, path)
    assert message.startswith((f"{path}: ", f"{path / 'config.json'}: ")), message  # the file


def test_base_model_without_a_head_says_so(tmp_path):
    """``LlamaModel`` weights (no ``model.`` prefix, no ``lm_head``) with an untied config:
    not "weights and config.json from different models", but what they are and what to load."""
    path = copy(tmp_path, "llama")
    edit_config(path, architectures=["LlamaModel"])

    def base_model(t):
        t.pop("lm_head.weight")
        t.update({k.removeprefix("model."): t.pop(k) for k in list(t)})

    edit_tensors(path, base_model)
    message = _refused(
        r"LlamaModel is a base model without a language-model head: its files have no "
        r"'lm_head.weight' and config.json has tie_word_embeddings=false",
        hf.load_pretrained,
        path,
    )
    assert "Load the checkpoint of the model with its head (LlamaForCausalLM)" in message
    assert "same model" not in message


def test_bad_tensors_are_refused_clearly(tmp_path):
    path = copy(tmp_path, "llama")
    edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        hf.load_pretrained(path)

    path = copy(tmp_path / "b", "llama")
    edit_tensors(path, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64)}))
    with pytest.raises(ValueError, match=r"unexpected \['layers.0.self_attn.q_proj.bias'\]"):
        hf.load_pretrained(path)

    path = copy(tmp_path / "q", "qwen2")
    edit_tensors(path, lambda t: t.pop("model.layers.0.self_attn.v_proj.bias"))
    with pytest.raises(ValueError, match=r"missing \['layers.0.self_attn.v_proj.bias'\]"):
        hf.load_pretrained(path)

    path = copy(tmp_path / "c", "llama")
    wrong = np.zeros((64, 64), np.float32)
    edit_tensors(path, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": wrong}))
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
    mesh = make_mesh("data=1,tensor=8")  # 4 query heads (the 2 kv heads would be replicated)
    with pytest.raises(ValueError, match=r"\(heads=4\) is not divisible by mesh tensor=8"):
        hf.load_pretrained(FIXTURES / "llama", mesh=mesh, rules=rules_for("tp", mesh))
    with pytest.raises(ValueError, match="pass mesh and rules together"):
        hf.load_pretrained(FIXTURES / "llama", mesh=mesh)


LLAMA_GQA_TIED = GPTConfig(
    d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, tie_embeddings=True, rope_theta=5e5
)


def test_bad_exports_are_refused_clearly(tmp_path):
    gqa_gpt2 = GPTConfig(style="gpt2", d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)
    with pytest.raises(ValueError, match="GPT-2 has no grouped-query attention"):
        hf.save_pretrained(tmp_path / "a", {}, gqa_gpt2)
    cfg = LLAMA_GQA_TIED
    params = random_params(cfg, seed=0)
    with pytest.raises(ValueError, match="dtype='int8': choose from float32, float16, bfloat16"):
        hf.save_pretrained(tmp_path / "b", params, cfg, dtype="int8")
    with pytest.raises(ValueError, match="pass config="):
        hf.save_pretrained(tmp_path / "c", params)
    with pytest.raises(ValueError, match="params do not fit config"):
        hf.save_pretrained(tmp_path / "c", params, GPTConfig(d_model=48, n_layers=1, n_heads=3))
    assert not (tmp_path / "c").exists()
    hf.save_pretrained(tmp_path / "d", params, cfg)
    with pytest.raises(ValueError, match="already holds a model"):
        hf.save_pretrained(tmp_path / "d", params, cfg)


@pytest.mark.parametrize(
    "cfg,architecture,match",
    [
        (
            GPTConfig(style="gpt2", d_model=32, n_layers=1, n_heads=4, sliding_window=8),
            None,
            r"GPT2LMHeadModel: sliding_window=8: GPT-2 has no sliding-window attention",
        ),
        (
            GPTConfig(d_model=32, n_layers=1, n_heads=4, qkv_bias=True),
            "MistralForCausalLM",
            r"MistralForCausalLM: qkv_bias=True: Mistral's projections have no biases",
        ),
        (
            LLAMA_GQA_TIED,
            "Qwen2ForCausalLM",
            r"Qwen2ForCausalLM: qkv_bias=False: Qwen2's q/k/v projections always have biases",
        ),
        (LLAMA_GQA_TIED, "gpt2", r"GPT2LMHeadModel: holds style='gpt2' models, not 'llama'"),
        (LLAMA_GQA_TIED, "GemmaForCausalLM", r"architecture='GemmaForCausalLM' is not registered"),
    ],
)
def test_configs_no_architecture_holds_are_refused_clearly(tmp_path, cfg, architecture, match):
    _refused(match, hf.save_pretrained, tmp_path, {}, cfg, architecture=architecture)
    _refused(match, hf.config_to_hf, cfg, architecture=architecture)
    assert not any(tmp_path.iterdir())
