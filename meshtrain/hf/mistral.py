"""Mistral (``MistralForCausalLM``, ``MistralModel``): Llama's layout plus a sliding window.

The weights are stored exactly as Llama's (`meshtrain.hf.llama.LAYOUT`, no biases). The one
difference is ``sliding_window``: when set, query t attends to keys (t − window, t], the same
window in every layer (`GPTConfig.sliding_window`); ``null`` is full causal attention.
transformers assumes 4096 when the field is absent, as Mistral 7B v0.1 used.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshtrain import validate
from meshtrain.filevalues import Key
from meshtrain.hf import llama
from meshtrain.hf.adapter import Adapter, refuse
from meshtrain.models.gpt import GPTConfig
from meshtrain.problem import Problem

DEFAULT_WINDOW = 4096  # MistralConfig's default, used when config.json has no sliding_window


def config_from_hf(hf: Mapping) -> GPTConfig:
    """The `GPTConfig` of a Mistral ``config.json``."""
    window = hf.get("sliding_window", DEFAULT_WINDOW)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise refuse("sliding_window", window, "it must be a positive integer, or null for none")
    return GPTConfig(**llama.fields_from_hf(hf), sliding_window=window or 0)


def config_to_hf(cfg: GPTConfig) -> dict:
    """Mistral's own ``config.json`` fields for `cfg`."""
    return llama.fields_to_hf(cfg) | dict(sliding_window=cfg.sliding_window or None)


def export_problems(cfg: GPTConfig) -> list[Problem]:
    """Why Mistral cannot hold `cfg`; empty when it can."""
    return (
        llama.mha_problems(cfg)
        + llama.no_qk_norm(cfg, "Mistral")
        + validate.require(
            not cfg.qkv_bias,
            "gpt.qkv_bias",
            cfg.qkv_bias,
            "Mistral's projections have no biases (Qwen2's have)",
        )
    )


ADAPTER = Adapter(
    model_type="mistral",
    architectures=("MistralForCausalLM", "MistralModel"),
    layout=llama.LAYOUT,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    export_problems=export_problems,
    keys=llama.KEYS | {"sliding_window": Key(int, 1, null=True, field="gpt.sliding_window")},
)
