"""The configuration fields of the tiny reference models behind the Hugging Face fixtures,
shared by `make_hf_fixtures.py` and `make_hf_mixtral_steps.py` (imported from beside them; it
needs neither torch nor transformers)."""

from __future__ import annotations

# Every tiny reference model: an initialiser scale above transformers' 0.02 (attention far from
# uniform, so a wrong mapping of any weight moves the logits), token ids 0, eager attention.
REFERENCE = dict(
    initializer_range=0.1,
    bos_token_id=0,
    eos_token_id=0,
    attn_implementation="eager",
)


def llama_fields(**changes) -> dict:
    """A tiny Llama-layout config's fields (Llama, Mistral, Qwen2, Mixtral): vocab 128, width 64,
    2 layers, 4 query and 2 key/value heads (head width 16), MLP 96, `changes` on top."""
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        **REFERENCE,
    )
    return fields | changes


def mixtral_fields(**changes) -> dict:
    """A tiny Mixtral's fields: `llama_fields` with 4 experts, top-2 routing, unscaled RoPE
    (base 10⁴) and an untied head, `changes` on top."""
    return (
        llama_fields(
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters=plain_rope(10_000.0),
            tie_word_embeddings=False,
        )
        | changes
    )


def qwen3_fields(**changes) -> dict:
    """A tiny Qwen3's fields, unlike `llama_fields` on purpose: width 64 but 6 query and 2
    key/value heads of width 24 (6 × 24 = 144 ≠ 64), MLP 80, RoPE base 10⁶, tied head."""
    fields = llama_fields(
        num_attention_heads=6,
        head_dim=24,
        intermediate_size=80,
        rope_parameters=plain_rope(1_000_000.0),
        tie_word_embeddings=True,
    )
    return fields | changes


def qwen3_moe_fields(**changes) -> dict:
    """A tiny Qwen3-MoE's fields: width 48, 4 query and 2 key/value heads of width 16 (64 ≠ 48),
    4 layers of which every second is sparse (``decoder_sparse_step=2``; the others a dense MLP
    of 64), 8 experts of width 32, top-3 with ``norm_topk_prob``, untied head."""
    fields = llama_fields(
        hidden_size=48,
        head_dim=16,
        intermediate_size=64,
        num_hidden_layers=4,
        decoder_sparse_step=2,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        rope_parameters=plain_rope(10_000.0),
        tie_word_embeddings=False,
    )
    return fields | changes


def plain_rope(theta: float) -> dict:
    """``rope_parameters`` of unscaled RoPE with base `theta`."""
    return {"rope_type": "default", "rope_theta": theta}


def versions() -> dict:
    """The versions a fixture was made with (imports torch and transformers when called)."""
    import sys

    import numpy as np
    import safetensors
    import torch
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }
