"""Makes the Hugging Face interchange fixtures in tests/fixtures/hf/ with the reference code.

Run once, by hand, never by the test suite: it needs torch and transformers, which meshtrain does
not. Python 3.11, in a venv of its own (install the CPU torch==2.13.0 first and exactly, so pip
does not pull a CUDA build)::

    python3.11 -m venv .venv-hf
    .venv-hf/bin/pip install torch==2.13.0
    .venv-hf/bin/pip install transformers safetensors numpy
    .venv-hf/bin/python scripts/make_hf_fixtures.py              # all fixtures
    .venv-hf/bin/python scripts/make_hf_fixtures.py mistral qwen2  # only these

The fixtures were made with torch 2.13.0+cpu, transformers 5.23.0, safetensors 0.8.0 and numpy
2.4.6; `versions.json` beside them records what ran. Making only some fixtures is refused when
the installed versions differ from the recorded ones (make them all then).

For each tiny random model (fixed seeds) it writes
``tests/fixtures/hf/<name>/{config.json, model.safetensors}`` via ``save_pretrained`` and
``tests/fixtures/hf/<name>_logits.npz`` (``tokens`` [2, T] int32, ``logits`` [2, T, V] float32):

- ``gpt2``: ``GPT2LMHeadModel``, tied head, weights stored as float16 (T = 24);
- ``llama``: ``LlamaForCausalLM`` with grouped-query attention (4 query / 2 key-value heads),
  untied head, weights stored as bfloat16 (T = 24);
- ``llama3``: ``LlamaForCausalLM`` with Llama 3.1's RoPE scaling (``rope_type="llama3"``,
  original context 64, so of the 8 rotary frequencies one is kept, two are blended and five
  slowed down 8×), tied head, bfloat16 (T = 40, long enough for the slowed rotations to turn);
- ``mistral``: ``MistralForCausalLM`` with ``sliding_window=16`` < T = 40, GQA, untied head,
  float16;
- ``qwen2``: ``Qwen2ForCausalLM`` with q/k/v biases (made non-zero), tied head, bfloat16
  (T = 40);
- ``mixtral``: ``MixtralForCausalLM`` with 4 experts of width 48, top-2, GQA, untied head,
  float16 (T = 24);
- ``qwen3``: ``Qwen3ForCausalLM`` with query/key norms (made non-1), 6 query and 2 key/value
  heads of width 24 on a width of 64 (6 × 24 ≠ 64), tied head, bfloat16 (T = 40);
- ``qwen3_moe``: ``Qwen3MoeForCausalLM`` with heads of 16 on a width of 48 (4 × 16 ≠ 48), 4
  layers of which layers 1 and 3 are sparse (``decoder_sparse_step=2``), 8 experts of width
  32, top-3 with ``norm_topk_prob``, untied head, float16 (T = 24).

Parameters are rounded to the storage dtype first and the logits computed from the rounded
weights in float32, so a float32 implementation can match them to float32 rounding. Buffers
such as RoPE's ``inv_freq`` stay float32: casting the whole model to bfloat16 and back would
round them too and shift the reference logits by ~5e-3. The initialiser scale is raised above
transformers' default 0.02 so that attention is far from uniform and a wrong mapping of any
weight moves the logits well past the test tolerance.

``--verify DIR`` instead loads a directory exported by ``meshtrain.hf.save_pretrained`` with
transformers and compares its logits with ``DIR/meshtrain_logits.npz`` (``tokens``, ``logits``)
written by meshtrain: the check that exported files load in the reference implementation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from _hf_tiny import (
    REFERENCE,
    llama_fields,
    mixtral_fields,
    plain_rope,
    qwen3_fields,
    qwen3_moe_fields,
)
from _hf_tiny import versions as tiny_versions

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
BATCH = 2


def _gpt2() -> transformers.PreTrainedModel:
    """Tiny GPT-2: vocab 256, width 64, 2 layers, 4 heads (head width 16), MLP 128."""
    cfg = transformers.GPT2Config(
        vocab_size=256,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_inner=128,
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **REFERENCE,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _llama() -> transformers.PreTrainedModel:
    """Tiny Llama with GQA: vocab 256, width 64, 2 layers, 4 query and 2 key/value heads."""
    cfg = transformers.LlamaConfig(
        **llama_fields(
            vocab_size=256,
            max_position_embeddings=64,
            rope_parameters=plain_rope(1000.0),
            tie_word_embeddings=False,
        )
    )
    return transformers.LlamaForCausalLM(cfg)


def _llama3() -> transformers.PreTrainedModel:
    """Tiny Llama with Llama 3.1's RoPE scaling. With theta 10⁴ and head width 16 the
    wavelengths are 6.3, 20, 63, 199, ... positions; against the original context of 64 (high
    boundary 64 / 4 = 16, low boundary 64 / 1) the first is kept, the next two are blended and
    the rest are slowed down 8×."""
    rope = dict(
        rope_type="llama3",
        rope_theta=10_000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    cfg = transformers.LlamaConfig(**llama_fields(rope_parameters=rope, tie_word_embeddings=True))
    return transformers.LlamaForCausalLM(cfg)


def _mistral() -> transformers.PreTrainedModel:
    """Tiny Mistral whose sliding window (16) is shorter than the fixture's sequence (40)."""
    cfg = transformers.MistralConfig(
        **llama_fields(
            sliding_window=16, rope_parameters=plain_rope(10_000.0), tie_word_embeddings=False
        )
    )
    return transformers.MistralForCausalLM(cfg)


def _qwen2() -> transformers.PreTrainedModel:
    """Tiny Qwen2: q/k/v biases, tied head, no sliding window."""
    cfg = transformers.Qwen2Config(
        **llama_fields(rope_parameters=plain_rope(1_000_000.0), tie_word_embeddings=True)
    )
    return transformers.Qwen2ForCausalLM(cfg)


def _mixtral() -> transformers.PreTrainedModel:
    """Tiny Mixtral: 4 experts, top-2, GQA, untied head, no sliding window."""
    cfg = transformers.MixtralConfig(**mixtral_fields(intermediate_size=48))
    return transformers.MixtralForCausalLM(cfg)


def _qwen3() -> transformers.PreTrainedModel:
    """Tiny Qwen3: query/key norms, heads wider in all than the model (6 × 24 > 64)."""
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**qwen3_fields()))


def _qwen3_moe() -> transformers.PreTrainedModel:
    """Tiny Qwen3-MoE: dense and sparse layers alternating, 8 experts, top-3 renormalised."""
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**qwen3_moe_fields()))


def _randomise_norms(model: torch.nn.Module, gen: torch.Generator, biases: bool) -> None:
    """Norm scales and biases start at 1 and 0; perturb them so their mapping is tested too
    (with `biases`, every projection bias as well)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and ("ln" in name or "norm" in name):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            elif biases and name.endswith("_proj.bias"):
                p.add_(0.5 * torch.randn(p.shape, generator=gen))


# name → (builder, storage dtype, seed, sequence length, perturb projection biases)
FIXTURES = {
    "gpt2": (_gpt2, torch.float16, 1234, 24, False),
    "llama": (_llama, torch.bfloat16, 5678, 24, False),
    "llama3": (_llama3, torch.bfloat16, 31, 40, False),
    "mistral": (_mistral, torch.float16, 7, 40, False),
    "qwen2": (_qwen2, torch.bfloat16, 2, 40, True),
    "mixtral": (_mixtral, torch.float16, 11, 24, False),
    "qwen3": (_qwen3, torch.bfloat16, 23, 40, False),
    "qwen3_moe": (_qwen3_moe, torch.float16, 29, 24, False),
}


def _make(
    out: Path, name: str, build, dtype: torch.dtype, seed: int, seq: int, biases: bool
) -> None:
    """Builds, rounds to `dtype`, saves, and records float32 logits on fixed tokens."""
    torch.manual_seed(seed)
    model = build().eval()
    _randomise_norms(model, torch.Generator().manual_seed(seed + 1), biases)
    with torch.no_grad():  # round the parameters only: buffers (RoPE's inv_freq) stay float32
        for p in model.parameters():
            p.copy_(p.to(dtype).to(torch.float32))
    tokens = np.random.default_rng(seed).integers(0, model.config.vocab_size, (BATCH, seq))
    tokens = tokens.astype(np.int32)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens).long()).logits.numpy().astype(np.float32)
    model.to(dtype).save_pretrained(out / name, safe_serialization=True)  # exact: pre-rounded
    np.savez(out / f"{name}_logits.npz", tokens=tokens, logits=logits)
    print(f"{name}: {out / name}, logits {logits.shape}, |logits| max {np.abs(logits).max():.3f}")


def _verify(path: Path) -> None:
    """Loads a meshtrain export with transformers and compares logits with meshtrain's."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    model = model.to(torch.float32).eval()
    ref = np.load(path / "meshtrain_logits.npz")
    with torch.no_grad():
        logits = model(torch.from_numpy(ref["tokens"]).long()).logits.numpy()
    err = float(np.abs(logits - ref["logits"]).max())
    rel = err / float(np.abs(ref["logits"]).max())
    name = type(model).__name__
    print(f"{path}: {name}, max |transformers - meshtrain| = {err:.2e} ({rel:.1e} of max |logit|)")
    if rel > 1e-5:
        sys.exit(f"{path}: logits differ by {err:.2e}, {rel:.1e} of the largest logit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"fixtures to make: {', '.join(FIXTURES)} (all)")
    parser.add_argument("--verify", type=Path, nargs="*", help="check meshtrain exports instead")
    parser.add_argument("--out", type=Path, default=OUT, help=f"fixture directory ({OUT})")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float32)
    if args.verify:
        for path in args.verify:
            _verify(path)
        return
    unknown = sorted(set(args.names) - set(FIXTURES))
    if unknown:
        sys.exit(f"unknown fixtures {unknown}; choose from {', '.join(FIXTURES)}")
    versions = {**tiny_versions(), "attn_implementation": "eager"}
    recorded = args.out / "versions.json"
    if args.names and set(args.names) != set(FIXTURES) and recorded.exists():
        if json.loads(recorded.read_text()) != versions:
            sys.exit(
                f"{recorded} records {recorded.read_text()} but this is {versions}: make every "
                "fixture (no names) so that one set of versions made them all"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or FIXTURES:
        _make(args.out, name, *FIXTURES[name])
    recorded.write_text(json.dumps(versions, indent=2) + "\n")
    print(json.dumps(versions))


if __name__ == "__main__":
    main()
