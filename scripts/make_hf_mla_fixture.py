"""Makes the dense DeepSeek-V3 fixtures in tests/fixtures/hf/deepseek_v3_dense/ with the reference
code: the oracle for meshtrain's multi-head latent attention (`meshtrain.models.mla`).

Run once, by hand, never by the test suite: it needs torch and transformers, which meshtrain does
not (the same venv as `make_hf_fixtures.py`)::

    .venv-hf/bin/python scripts/make_hf_mla_fixture.py

It refuses to run under other versions than those `tests/fixtures/hf/versions.json` records
(torch 2.13.0+cpu, transformers 5.23.0, safetensors 0.8.0, numpy 2.4.6), so one set of versions
made every Hugging Face fixture.

Two tiny random ``DeepseekV3ForCausalLM`` models, all layers dense (``first_k_dense_replace`` =
``num_hidden_layers``, so no mixture of experts is built), unscaled RoPE (base 10⁴) with
DeepSeek-V3's interleaved rotary dims (``rope_interleave=True``), untied head, vocab 128, width
64, 2 layers, 4 heads of q/k width 16 + 8 (nope + rope) and value width 12, MLP 96:

- ``qlora``: queries through the low-rank pair ``q_a_proj`` (rank 32), ``q_a_layernorm``,
  ``q_b_proj``; key/value latent rank 24;
- ``qproj``: ``q_lora_rank=None``, one ``q_proj``; key/value latent rank 24.

Each goes to ``deepseek_v3_dense/<name>/{config.json, model.safetensors}`` (weights stored as
bfloat16) and ``deepseek_v3_dense/<name>_logits.npz`` (``tokens`` [2, 24] int32, ``logits``
[2, 24, 128] float32). As in `make_hf_fixtures.py`, the parameters are rounded to the storage
dtype first and the logits computed from them in float32; the norm scales are perturbed and the
initialiser scale raised so that a wrong mapping of any weight moves the logits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from _hf_tiny import REFERENCE, plain_rope
from _hf_tiny import versions as tiny_versions

HF = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
OUT = HF / "deepseek_v3_dense"
BATCH, SEQ = 2, 24


def _fields(q_lora_rank: int | None) -> dict:
    """A tiny dense DeepSeek-V3's config fields."""
    return dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        first_k_dense_replace=2,  # every layer dense: no router, no experts
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters=plain_rope(10_000.0),
        rope_interleave=True,
        tie_word_embeddings=False,
        **REFERENCE,
    )


# name → (q_lora_rank, seed)
FIXTURES = {"qlora": (32, 17), "qproj": (None, 23)}


def _make(name: str, q_lora_rank: int | None, seed: int) -> None:
    """Builds, rounds to bfloat16, saves, and records float32 logits on fixed tokens."""
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**_fields(q_lora_rank))
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 1 and "norm" in pname:  # norm scales start at 1: perturb them
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
        for p in model.parameters():  # buffers (RoPE's inv_freq) stay float32
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (BATCH, SEQ)).astype(np.int32)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens).long()).logits.numpy().astype(np.float32)
    model.to(torch.bfloat16).save_pretrained(OUT / name, safe_serialization=True)
    np.savez(OUT / f"{name}_logits.npz", tokens=tokens, logits=logits)
    print(f"{name}: logits {logits.shape}, |logits| max {np.abs(logits).max():.3f}")


def main() -> None:
    torch.set_default_dtype(torch.float32)
    versions = {**tiny_versions(), "attn_implementation": "eager"}
    recorded = json.loads((HF / "versions.json").read_text())
    if recorded != versions:
        sys.exit(f"versions.json records {recorded} but this is {versions}; use those versions")
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (rank, seed) in FIXTURES.items():
        _make(name, rank, seed)
    print(json.dumps(versions))


if __name__ == "__main__":
    main()
