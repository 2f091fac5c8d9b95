"""Qwen3 (``Qwen3ForCausalLM``, ``Qwen3Model``): Llama's layout plus query/key norms.

The weights are Llama's (`meshtrain.hf.llama.LAYOUT`) with ``self_attn.q_norm.weight`` and
``self_attn.k_norm.weight``, one [head_dim] RMSNorm scale each, applied to every query and key
head after the projections and before RoPE (``GPTConfig.qk_norm``, eps ``rms_norm_eps``).
The projections have no biases (``attention_bias`` would bias ``o_proj`` too: refused). The
heads are ``head_dim`` wide, 128 when the file does not say, whatever ``hidden_size`` is
(Qwen3-0.6B: hidden 1024, 16 heads × 128). The sliding window follows Qwen2's rules
(`meshtrain.hf.qwen2.window_from_hf`): on every layer or on none.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshtrain import validate
from meshtrain.hf import llama, qwen2
from meshtrain.hf.adapter import Adapter, expect
from meshtrain.models.gpt import GPTConfig
from meshtrain.problem import Problem

DEFAULT_HEAD_DIM = 128  # Qwen3Config's head_dim when config.json has none


def config_from_hf(hf: Mapping) -> GPTConfig:
    """The `GPTConfig` of a Qwen3 ``config.json``."""
    expect(hf, "attention_bias", False, False)  # it biases o_proj too; not modelled
    fields = llama.fields_from_hf(hf, default_head_dim=DEFAULT_HEAD_DIM)
    return GPTConfig(**fields, qk_norm=True, sliding_window=qwen2.window_from_hf(hf))


def config_to_hf(cfg: GPTConfig) -> dict:
    """Qwen3's own ``config.json`` fields for `cfg`."""
    return qwen2.config_to_hf(cfg) | dict(attention_bias=False)


def export_problems(cfg: GPTConfig) -> list[Problem]:
    """Why Qwen3 cannot hold `cfg`; empty when it can."""
    problems = llama.mha_problems(cfg) + validate.require(
        cfg.qk_norm, "gpt.qk_norm", cfg.qk_norm, "Qwen3 always normalises queries and keys"
    )
    return problems + validate.require(
        not cfg.qkv_bias,
        "gpt.qkv_bias",
        cfg.qkv_bias,
        "Qwen3's attention_bias also biases o_proj (Qwen2 holds q/k/v biases)",
    )


ADAPTER = Adapter(
    model_type="qwen3",
    architectures=("Qwen3ForCausalLM", "Qwen3Model"),
    layout=llama.LAYOUT,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    export_problems=export_problems,
    keys=qwen2.KEYS,
)
