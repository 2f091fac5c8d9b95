"""Qwen2 (``Qwen2ForCausalLM``, ``Qwen2Model``): Llama's layout plus q/k/v biases.

The weights are Llama's (`meshtrain.hf.llama.LAYOUT`) with ``self_attn.{q,k,v}_proj.bias``
(``GPTConfig.qkv_bias``); ``o_proj`` has none. Qwen2 can also slide a window over the layers
from ``max_window_layers`` on (``use_sliding_window``, or an explicit ``layer_types`` list).
meshtrain gives every layer the same attention, so it reads a window that covers all layers or
none, and refuses a mix, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshtrain import validate
from meshtrain.filevalues import Key
from meshtrain.hf import llama
from meshtrain.hf.adapter import Adapter, need, refuse
from meshtrain.models.gpt import GPTConfig
from meshtrain.problem import Problem

FULL, SLIDING = "full_attention", "sliding_attention"
DEFAULT_WINDOW, DEFAULT_WINDOW_LAYERS = 4096, 28  # Qwen2Config's defaults
# The keys Qwen2 reads: Llama's, and the sliding window's (Qwen3 reads the same).
KEYS = llama.KEYS | {
    "sliding_window": Key(int, 1, null=True, field="gpt.sliding_window"),
    "use_sliding_window": Key(bool),
    "max_window_layers": Key(int, 0, null=True),
}


def window_from_hf(hf: Mapping) -> int:
    """The sliding window every layer uses (0: none), as transformers derives it per layer."""
    n_layers = need(hf, "num_hidden_layers")
    use = hf.get("use_sliding_window", False)
    window = hf.get("sliding_window", DEFAULT_WINDOW) if use else None
    first = hf.get("max_window_layers", DEFAULT_WINDOW_LAYERS)
    field, types = "layer_types", hf.get("layer_types")
    if types is None:  # transformers' rule when the file lists no layer types
        field = "max_window_layers"
        types = [SLIDING if window is not None and i >= first else FULL for i in range(n_layers)]
    if len(types) != n_layers or not set(types) <= {FULL, SLIDING}:
        raise refuse(
            "layer_types", types, f"expected {n_layers} entries of {FULL!r} or {SLIDING!r}"
        )
    n_sliding = types.count(SLIDING)
    if n_sliding == 0:
        return 0
    if window is None:
        raise refuse(
            "layer_types", types, "it names sliding layers but use_sliding_window is false"
        )
    if n_sliding < n_layers:
        got = first if field == "max_window_layers" else types
        raise refuse(
            field,
            got,
            f"with use_sliding_window=true it gives {n_sliding} of {n_layers} layers a sliding "
            "window; meshtrain gives every layer the same attention (a window on all layers, "
            "max_window_layers=0, or on none)",
        )
    if not isinstance(window, int) or window < 1:
        raise refuse("sliding_window", window, "it must be a positive integer")
    return window


def config_from_hf(hf: Mapping) -> GPTConfig:
    """The `GPTConfig` of a Qwen2 ``config.json``."""
    fields = llama.fields_from_hf(hf)
    return GPTConfig(**fields, qkv_bias=True, sliding_window=window_from_hf(hf))


def config_to_hf(cfg: GPTConfig) -> dict:
    """Qwen2's own ``config.json`` fields for `cfg`."""
    window = cfg.sliding_window
    return llama.fields_to_hf(cfg) | dict(
        use_sliding_window=bool(window),
        sliding_window=window or None,
        max_window_layers=0 if window else cfg.n_layers,
        layer_types=[SLIDING if window else FULL] * cfg.n_layers,
    )


def export_problems(cfg: GPTConfig) -> list[Problem]:
    """Why Qwen2 cannot hold `cfg`; empty when it can."""
    return (
        llama.mha_problems(cfg)
        + llama.no_qk_norm(cfg, "Qwen2")
        + validate.require(
            cfg.qkv_bias,
            "gpt.qkv_bias",
            cfg.qkv_bias,
            "Qwen2's q/k/v projections always have biases",
        )
    )


ADAPTER = Adapter(
    model_type="qwen2",
    architectures=("Qwen2ForCausalLM", "Qwen2Model"),
    layout=llama.LAYOUT,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    export_problems=export_problems,
    keys=KEYS,
)
