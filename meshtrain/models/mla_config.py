"""The settings of latent attention (`meshtrain.models.mla`) inside `GPTConfig`: their defaults,
checks, parameter count and attention widths."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshtrain import validate
from meshtrain.problem import Problem

if TYPE_CHECKING:
    from meshtrain.models.gpt_config import GPTConfig

ATTENTIONS = ("mha", "mla")
# The mla_* fields and their defaults (small: a CPU-sized model).
DEFAULTS = {
    "mla_q_rank": 0,
    "mla_kv_rank": 64,
    "mla_nope_dim": 32,
    "mla_rope_dim": 16,
    "mla_v_dim": 32,
}


def problems(cfg: GPTConfig) -> list[Problem]:
    """What is wrong with `cfg`'s attention kind and mla_* fields; empty when nothing."""
    v = validate
    found = v.one_of("gpt.attention", cfg.attention, ATTENTIONS, example="mla")
    if found:
        return found
    if cfg.attention == "mha":
        return [
            Problem(
                f"gpt.{name}",
                getattr(cfg, name),
                f"has no effect with attention='mha'; set --gpt.attention mla or leave {name} "
                f"at {default}",
            )
            for name, default in DEFAULTS.items()
            if getattr(cfg, name) != default
        ]
    found = v.non_negative("gpt.mla_q_rank", cfg.mla_q_rank, note="0: one query projection")
    for name in ("mla_kv_rank", "mla_nope_dim", "mla_rope_dim", "mla_v_dim"):
        found += v.positive(f"gpt.{name}", getattr(cfg, name), example=DEFAULTS[name])
    if found:
        return found
    found += v.require(
        cfg.mla_rope_dim % 2 == 0,
        "gpt.mla_rope_dim",
        cfg.mla_rope_dim,
        f"must be even (RoPE turns pairs of dims); use {cfg.mla_rope_dim + 1}",
    )
    refusals = [
        ("style", cfg.style == "llama", "latent attention is Llama-style (RoPE, RMSNorm); "
         "set --gpt.style llama"),
        ("n_kv_heads", cfg.n_kv_heads == 0, "latent attention makes keys and values for every "
         "head from its latent; leave n_kv_heads at 0"),
        ("qkv_bias", not cfg.qkv_bias, "latent attention has no projection biases; leave it "
         "False"),
        ("sliding_window", cfg.sliding_window == 0, "latent attention with a sliding window is "
         "not implemented; leave it 0"),
        ("head_dim", cfg.head_dim == 0, "latent attention's head widths are mla_nope_dim, "
         "mla_rope_dim and mla_v_dim; leave head_dim at 0"),
        ("qk_norm", not cfg.qk_norm, "latent attention normalises its latents, not each head; "
         "leave qk_norm False"),
        ("rope_scaling", cfg.rope_scaling == "none", "latent attention's RoPE scaling (yarn) is "
         "not implemented yet; leave it 'none'"),
        ("attention_impl", cfg.attention_impl == "xla", "latent attention runs the xla path "
         "only (the pallas and cudnn kernels take one head width for q, k and v); set "
         "--gpt.attention-impl xla"),
    ]  # fmt: skip
    for name, ok, why in refusals:
        found += v.require(ok, f"gpt.{name}", getattr(cfg, name), f"with attention='mla': {why}")
    return found


def attention_params(cfg: GPTConfig) -> int:
    """Matmul parameters of one block's attention (projections only)."""
    D, H = cfg.d_model, cfg.n_heads
    if cfg.attention != "mla":
        G, K = cfg.kv_heads, cfg.head_width
        return D * H * K + 2 * D * G * K + H * K * D
    N, R, V = cfg.mla_nope_dim, cfg.mla_rope_dim, cfg.mla_v_dim
    Q, C = cfg.mla_q_rank, cfg.mla_kv_rank
    q = Q * (D + H * (N + R)) if Q else D * H * (N + R)
    return q + D * (C + R) + C * H * (N + V) + H * V * D


def attention_widths(cfg: GPTConfig) -> tuple[int, int]:
    """The per-head widths of the scores (q·k) and of the weighted sum (p·v)."""
    if cfg.attention != "mla":
        return cfg.head_width, cfg.head_width
    return cfg.mla_nope_dim + cfg.mla_rope_dim, cfg.mla_v_dim
