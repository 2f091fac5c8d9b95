"""Whole-model conversion, generic over the layout: the layers one by one, stacked along
meshtrain's leading ``layers`` dimension, the top-level tensors, and the untied ``lm_head``.

The files hold the true ``vocab_size`` rows; meshtrain's embedding and head hold
``cfg.padded_vocab`` (see `GPTConfig.vocab_multiple`): import pads them with zero rows, export
drops the padding, and ``config.json`` keeps the true ``vocab_size``."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from meshtrain.hf.adapter import HEAD, Adapter, Getter, Shape
from meshtrain.hf.registry import adapter_for
from meshtrain.models.gpt import GPTConfig


def shapes(adapter: Adapter, cfg: GPTConfig) -> dict[str, Shape]:
    """Every tensor of `cfg` in `adapter`'s layout: name (without the model prefix) → shape."""
    layout = adapter.layout
    out = dict(layout.top_shapes(cfg))
    layer = layout.layer_shapes(cfg)
    for i in range(cfg.n_layers):
        out |= {f"{layout.block}.{i}.{name}": shape for name, shape in layer.items()}
    if not cfg.tie_embeddings:
        out[HEAD] = (cfg.vocab_size, cfg.d_model)
    return out


def hf_shapes(cfg: GPTConfig, architecture: str | None = None) -> dict[str, Shape]:
    """Every tensor of the HF layout of `cfg`: name (without the model prefix) → shape.

    Args:
        cfg: the model config.
        architecture: as for `meshtrain.hf.save_pretrained` (None: chosen from `cfg`).
    """
    return shapes(adapter_for(cfg, architecture), cfg)


def to_meshtrain(get: Getter, adapter: Adapter, cfg: GPTConfig) -> dict:
    """Nested meshtrain params (numpy) from HF tensors fetched by name without the prefix."""
    layout = adapter.layout
    layers = [
        layout.layer_to_meshtrain(lambda name, i=i: get(f"{layout.block}.{i}.{name}"), cfg)
        for i in range(cfg.n_layers)
    ]
    params = {"blocks": jax.tree.map(lambda *xs: np.stack(xs), *layers)}  # [layers, ...]
    params |= layout.top_to_meshtrain(get, cfg)
    if not cfg.tie_embeddings:
        params["head"] = {"kernel": get(HEAD).T}
    return _pad_vocab(params, cfg)


def _pad_vocab(params: dict, cfg: GPTConfig) -> dict:
    """The embedding and head of `params` (``vocab_size`` ids) zero-padded to ``padded_vocab``."""
    extra = cfg.padded_vocab - cfg.vocab_size
    params["embed"]["embedding"] = np.pad(params["embed"]["embedding"], ((0, extra), (0, 0)))
    if "head" in params:
        params["head"]["kernel"] = np.pad(params["head"]["kernel"], ((0, 0), (0, extra)))
    return params


def _unpad_vocab(params: Mapping, cfg: GPTConfig) -> dict:
    """`params` with the embedding and head cut back to ``vocab_size`` ids (a shallow copy)."""
    V = cfg.vocab_size
    params = dict(params, embed={"embedding": params["embed"]["embedding"][:V]})
    if "head" in params:
        params["head"] = {"kernel": params["head"]["kernel"][:, :V]}
    return params


def to_hf(params: Mapping, adapter: Adapter, cfg: GPTConfig) -> dict[str, np.ndarray]:
    """HF tensors (name without the prefix → numpy) from nested meshtrain params (numpy)."""
    layout = adapter.layout
    params = _unpad_vocab(params, cfg)
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.n_layers):
        layer = jax.tree.map(lambda x, i=i: x[i], dict(params["blocks"]))
        out |= {f"{layout.block}.{i}.{k}": v for k, v in layout.layer_to_hf(layer, cfg).items()}
    out |= layout.top_to_hf(params, cfg)
    if not cfg.tie_embeddings:
        out[HEAD] = params["head"]["kernel"].T
    return out
