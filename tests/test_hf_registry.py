"""The meshtrain.hf adapter registry: which architecture a config exports as, an architecture
added from outside the package in one adapter and one register line, and generic code that
knows no architecture."""

import ast
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from _hf_helpers import random_params

import meshtrain.hf
from meshtrain import hf, validate
from meshtrain.hf import llama, registry
from meshtrain.models import GPTConfig

SMALL = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)


@pytest.mark.parametrize(
    "cfg,architecture",
    [
        (GPTConfig(style="gpt2", d_model=32, n_heads=4), "GPT2LMHeadModel"),
        (GPTConfig(**SMALL), "LlamaForCausalLM"),
        (GPTConfig(**SMALL, rope_scaling="llama3"), "LlamaForCausalLM"),
        (GPTConfig(**SMALL, sliding_window=64), "MistralForCausalLM"),
        (GPTConfig(**SMALL, qkv_bias=True), "Qwen2ForCausalLM"),
        (GPTConfig(**SMALL, qkv_bias=True, sliding_window=64), "Qwen2ForCausalLM"),
        (GPTConfig(**SMALL, head_dim=16), "LlamaForCausalLM"),  # wider heads: still Llama
        (GPTConfig(**SMALL, qk_norm=True), "Qwen3ForCausalLM"),
        (GPTConfig(**SMALL, qk_norm=True, head_dim=12, sliding_window=64), "Qwen3ForCausalLM"),
    ],
)
def test_a_config_exports_as_the_first_architecture_that_holds_it(cfg, architecture):
    adapter = hf.adapter_for(cfg)
    assert adapter.name == architecture
    assert hf.config_to_hf(cfg)["architectures"] == [architecture]
    assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg


def test_the_earlier_public_names_keep_their_meaning():
    assert {k: hf.ARCHITECTURES[k] for k in ("GPT2LMHeadModel", "LlamaForCausalLM")} == {
        "GPT2LMHeadModel": "gpt2",
        "LlamaForCausalLM": "llama",
    }
    assert set(hf.ADAPTERS) == {"gpt2", "llama", "mistral", "qwen2", "qwen3", "deepseek_v3"}
    assert hf.adapter_for_hf({"model_type": "mistral"}).name == "MistralForCausalLM"


@pytest.fixture
def registry_copy(monkeypatch):
    """The registry, restored after the test."""
    monkeypatch.setattr(registry, "ADAPTERS", dict(registry.ADAPTERS))
    monkeypatch.setattr(registry, "ARCHITECTURES", dict(registry.ARCHITECTURES))


# An architecture of your own: Llama's layout under another name, whose config.json calls the
# sliding window "attention_window" (and a separate "window_enabled" flag).


def _tiny_from_hf(hf_config):
    window = hf_config["attention_window"] if hf_config.get("window_enabled") else 0
    return GPTConfig(**llama.fields_from_hf(hf_config), sliding_window=window)


def _tiny_to_hf(cfg):
    window = dict(window_enabled=bool(cfg.sliding_window), attention_window=cfg.sliding_window)
    return llama.fields_to_hf(cfg) | window


TINY = hf.Adapter(
    model_type="tiny",
    architectures=("TinyForCausalLM", "TinyModel"),
    layout=llama.LAYOUT,
    config_from_hf=_tiny_from_hf,
    config_to_hf=_tiny_to_hf,
    export_problems=lambda cfg: validate.require(
        not cfg.qkv_bias, "gpt.qkv_bias", cfg.qkv_bias, "Tiny has no biases"
    ),
)


def test_an_architecture_is_one_adapter_and_one_register_line(registry_copy, tmp_path):
    hf.register(TINY)
    cfg = GPTConfig(**SMALL, sliding_window=8)
    params = random_params(cfg, seed=0)
    hf.save_pretrained(tmp_path / "t", params, cfg, architecture="TinyForCausalLM")
    written = json.loads((tmp_path / "t" / "config.json").read_text())
    assert (written["architectures"], written["model_type"]) == (["TinyForCausalLM"], "tiny")
    assert (written["window_enabled"], written["attention_window"]) == (True, 8)
    cfg2, params2 = hf.load_pretrained(tmp_path / "t")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, jax.tree.map(np.asarray, params2))
    # Registered after Mistral: a windowed config still exports as Mistral by default.
    assert hf.adapter_for(cfg).name == "MistralForCausalLM"


def test_a_name_is_registered_once(registry_copy):
    with pytest.raises(ValueError, match=r"hf adapter 'llama': model_type or architectures"):
        hf.register(llama.ADAPTER)
    renamed = dataclasses.replace(TINY, architectures=("TinyForCausalLM", "LlamaModel"))
    with pytest.raises(ValueError, match=r"architectures \['LlamaModel'\] already registered"):
        hf.register(renamed)
    assert "tiny" not in registry.ADAPTERS


GENERIC = ("adapter", "registry", "config", "convert", "files", "pretrained")


@pytest.mark.parametrize("module", GENERIC)
def test_generic_code_imports_no_architecture(module):
    """Only the package's __init__ (the register lines) names the architecture modules."""
    path = Path(meshtrain.hf.__file__).parent / f"{module}.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            imported |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
    arch = {f"meshtrain.hf.{m}" for m in ("gpt2", "llama", "mistral", "qwen2")}
    assert not imported & arch, f"{module}.py imports {sorted(imported & arch)}"
