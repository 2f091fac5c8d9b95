"""Shared helpers for the meshtrain.hf tests: the fixtures transformers made
(scripts/make_hf_fixtures.py; no torch here), what their config.json files describe, and small
file edits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from meshtrain.models import GPT, GPTConfig

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
# float32 logits, |logit| up to ~3.4: measured max error 1.4e-6 (gpt2), 2.3e-6 (llama),
# 2.1e-6 (llama3), 2.4e-6 (mistral), 1.5e-6 (qwen2) and 3.8e-6 (qwen3).
ATOL = 2e-5

_SMALL = dict(vocab_size=128, max_seq_len=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
_SMALL |= dict(d_ff=96, norm_eps=1e-6)
# What the fixtures' config.json files describe.
EXPECTED = {
    "gpt2": GPTConfig(
        style="gpt2", vocab_size=256, max_seq_len=32, d_model=64, n_layers=2, n_heads=4,
        d_ff=128, norm_eps=1e-5, tie_embeddings=True,
    ),
    "llama": GPTConfig(
        style="llama", vocab_size=256, max_seq_len=64, d_model=64, n_layers=2, n_heads=4,
        n_kv_heads=2, d_ff=96, rope_theta=1000.0, norm_eps=1e-6, tie_embeddings=False,
    ),
    "llama3": GPTConfig(
        **_SMALL, rope_theta=10_000.0, tie_embeddings=True, rope_scaling="llama3",
        rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
        rope_original_max_seq_len=64,
    ),
    "mistral": GPTConfig(**_SMALL, rope_theta=10_000.0, sliding_window=16),
    "qwen2": GPTConfig(**_SMALL, rope_theta=1e6, tie_embeddings=True, qkv_bias=True),
    "qwen3": GPTConfig(
        **_SMALL | dict(n_heads=6, d_ff=80), head_dim=24, qk_norm=True, rope_theta=1e6,
        tie_embeddings=True,
    ),
}  # fmt: skip
NAMES = tuple(EXPECTED)


def reference(name: str) -> tuple[np.ndarray, np.ndarray]:
    """The fixture's tokens [2, T] and transformers' float32 logits [2, T, V]."""
    ref = np.load(FIXTURES / f"{name}_logits.npz")
    return ref["tokens"], ref["logits"]


def abstract(cfg: GPTConfig) -> GPT:
    """The GPT of `cfg` as shape structs (no initialisers run)."""
    return nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))


def forward(cfg: GPTConfig):
    """Jitted ``forward(params, tokens) -> logits`` of `cfg`'s GPT."""
    graphdef = nnx.graphdef(abstract(cfg))
    return jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))


def random_params(cfg: GPTConfig, seed: int) -> dict:
    """Fresh random float32 params (biases and norm scales included) with the model's tree; the
    padded vocabulary's rows are zero, as the model keeps them."""
    rng = np.random.default_rng(seed)
    tree = nnx.to_pure_dict(nnx.state(abstract(cfg), nnx.Param))
    params = jax.tree.map(lambda x: rng.normal(0, 0.5, x.shape).astype(np.float32), tree)
    params["embed"]["embedding"][cfg.vocab_size :] = 0
    if "head" in params:
        params["head"]["kernel"][:, cfg.vocab_size :] = 0
    return params


def read(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file: key → numpy array (stored dtype)."""
    with safe_open(path, framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def copy(tmp_path: Path, name: str) -> Path:
    """A writable copy of fixture `name` under `tmp_path`."""
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def edit_config(path: Path, drop=(), **changes) -> None:
    """Rewrites ``path/config.json`` with `changes` set and the keys in `drop` removed."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    for key in drop:
        cfg.pop(key, None)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn) -> None:
    """Rewrites ``path/model.safetensors`` after ``fn(tensors)`` edits the dict in place."""
    tensors = read(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors")
