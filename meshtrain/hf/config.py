"""``config.json`` ↔ `GPTConfig`, through the registered adapters, and config comparison."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from meshtrain import filevalues
from meshtrain.hf.registry import adapter_for, adapter_for_hf
from meshtrain.models.gpt import GPTConfig
from meshtrain.problem import RunCheckError

FIX = "fix the file, or download the model again"  # a wrong value inside config.json

# The GPTConfig fields (and properties, after defaults) that decide a GPT's weights and math;
# the rest (remat, dtype, kernels) are training choices that HF files do not hold.
_WEIGHTS_AND_MATH = (
    "style",
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "kv_heads",
    "head_width",
    "ff_dim",
    "norm_eps",
    "tie_embeddings",
    "qkv_bias",
    "qk_norm",
    "sliding_window",
    "attention",
    "mla_q_rank",
    "mla_kv_rank",
    "mla_nope_dim",
    "mla_rope_dim",
    "mla_v_dim",
)
# Positions: a learned table sized max_seq_len (gpt2), or RoPE (llama; max_seq_len only caps
# the sequence length there).
_POSITIONS = {
    "gpt2": ("max_seq_len",),
    "llama": (
        "rope_theta",
        "rope_scaling",
        "rope_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_original_max_seq_len",
    ),
}


def config_from_hf(
    hf: Mapping, *, where: str = "config.json", fix: str = FIX, flag_fix: str = ""
) -> GPTConfig:
    """The `GPTConfig` a Hugging Face ``config.json`` describes.

    Args:
        hf: the parsed ``config.json``.
        where: a label for error messages (the file).
        fix: what fixes a wrong value in the file, ending each line about one.
        flag_fix: for a key that fills a `GPTConfig` setting, the other fix, with ``{flag}``
            for the setting with dashes (see `meshtrain.filevalues.checked`).

    Returns:
        The config; ``d_ff`` and ``n_kv_heads`` are 0 where they equal meshtrain's defaults.

    Raises:
        ValueError: ``where: ...`` naming the architecture or field meshtrain cannot reproduce;
            a `RunCheckError` of ``where: key=value: ...; fix`` lines for values of the wrong
            type or out of range (every one at once).
    """
    try:
        adapter = adapter_for_hf(hf)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    values = filevalues.checked(hf, adapter.keys, where, fix, flag_fix=flag_fix)
    try:
        cfg = adapter.config_from_hf(values)
    except RunCheckError as e:
        keys, flags = adapter.keys, flag_fix
        raise filevalues.relabel(e, values, keys, where, fix, flag_fix=flags, whole=True) from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if cfg.d_ff == dataclasses.replace(cfg, d_ff=0).ff_dim:
        cfg = dataclasses.replace(cfg, d_ff=0)
    return cfg


def config_to_hf(
    cfg: GPTConfig, *, dtype: str = "float32", architecture: str | None = None
) -> dict:
    """The Hugging Face ``config.json`` for `cfg`.

    Args:
        cfg: the model config.
        dtype: the dtype the weights are saved in.
        architecture: the class name or ``model_type`` to write; None chooses the first
            registered architecture that holds `cfg` (see `meshtrain.hf.adapter_for`).

    Returns:
        A JSON-serialisable dict.
    """
    adapter = adapter_for(cfg, architecture)
    common = dict(
        architectures=[adapter.name],
        model_type=adapter.model_type,
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=cfg.tie_embeddings,
        dtype=dtype,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return common | adapter.config_to_hf(cfg)


def same_architecture(a: GPTConfig, b: GPTConfig) -> list[str]:
    """The fields (after defaults) in which two configs describe different weights or math."""
    fields = _WEIGHTS_AND_MATH + _POSITIONS.get(a.style, ())
    return [
        f"{f}: {getattr(a, f)!r} vs {getattr(b, f)!r}"
        for f in fields
        if getattr(a, f) != getattr(b, f)
    ]
