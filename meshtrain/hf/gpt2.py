"""GPT-2 (``GPT2LMHeadModel``, ``GPT2Model``) ↔ meshtrain's ``style="gpt2"`` GPT.

GPT-2 stores its projections as Conv1D weights ``[in, out]`` (meshtrain's own orientation)
and fuses q, k and v into one ``c_attn``::

    meshtrain (per layer)           GPT-2
    attn.q/k/v.kernel [D, H, K]     attn.c_attn.weight [D, 3D] (q | k | v)
    attn.q/k/v.bias   [H, K]        attn.c_attn.bias   [3D]
    attn.o.kernel     [H, K, D]     attn.c_proj.weight [D, D]
    mlp.up / mlp.down               mlp.c_fc [D, F] / mlp.c_proj [F, D] (with biases)
    norm1 / norm2                   ln_1 / ln_2 (LayerNorm)
    embed.embedding   [V, D]        wte [V, D]
    pos               [T, D]        wpe [n_positions, D]

GPT-2's ``gelu_new`` is the tanh GELU of `jax.nn.gelu`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from meshtrain import validate
from meshtrain.filevalues import Key
from meshtrain.hf.adapter import Adapter, Getter, Layout, expect, need
from meshtrain.models.gpt import GPTConfig
from meshtrain.problem import Problem

# The keys `config_from_hf` reads, and the GPTConfig setting each fills.
KEYS = {
    "vocab_size": Key(int, 1, required=True, field="gpt.vocab_size"),
    "n_positions": Key(int, 1, field="gpt.max_seq_len"),
    "n_embd": Key(int, 1, required=True, field="gpt.d_model"),
    "n_layer": Key(int, 1, required=True, field="gpt.n_layers"),
    "n_head": Key(int, 1, required=True, field="gpt.n_heads"),
    "n_inner": Key(int, 1, null=True, field="gpt.d_ff"),
    "layer_norm_epsilon": Key(float, 0, strict=True, field="gpt.norm_eps"),
    "tie_word_embeddings": Key(bool, field="gpt.tie_embeddings"),
    "scale_attn_weights": Key(bool),
    "scale_attn_by_inverse_layer_idx": Key(bool),
    "add_cross_attention": Key(bool),
}


def config_from_hf(hf: Mapping) -> GPTConfig:
    """The `GPTConfig` of a GPT-2 ``config.json``."""
    expect(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
    expect(hf, "scale_attn_weights", True, True)
    expect(hf, "scale_attn_by_inverse_layer_idx", False, False)
    expect(hf, "add_cross_attention", False, False)
    return GPTConfig(
        style="gpt2",
        vocab_size=need(hf, "vocab_size"),
        max_seq_len=hf.get("n_positions", 1024),
        d_model=need(hf, "n_embd"),
        n_layers=need(hf, "n_layer"),
        n_heads=need(hf, "n_head"),
        d_ff=hf.get("n_inner") or 0,
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def config_to_hf(cfg: GPTConfig) -> dict:
    """GPT-2's own ``config.json`` fields for `cfg`."""
    return dict(
        n_positions=cfg.max_seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_inner=cfg.ff_dim,
        activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm_eps,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def export_problems(cfg: GPTConfig) -> list[Problem]:
    """Why GPT-2 cannot hold `cfg`; empty when it can."""
    problems = validate.require(
        cfg.kv_heads == cfg.n_heads,
        "gpt.n_kv_heads",
        cfg.n_kv_heads,
        "GPT-2 has no grouped-query attention; use style='llama' or n_kv_heads=0",
    )
    problems += validate.require(
        cfg.head_width * cfg.n_heads == cfg.d_model,
        "gpt.head_dim",
        cfg.head_dim,
        "GPT-2's heads split d_model; set head_dim to 0 or d_model / n_heads",
    )
    return problems + validate.require(
        not cfg.sliding_window,
        "gpt.sliding_window",
        cfg.sliding_window,
        "GPT-2 has no sliding-window attention",
    )


# --- tensors ---------------------------------------------------------------------------------


def top_shapes(cfg: GPTConfig) -> dict:
    D = cfg.d_model
    return {
        "wte.weight": (cfg.vocab_size, D),
        "wpe.weight": (cfg.max_seq_len, D),
        "ln_f.weight": (D,),
        "ln_f.bias": (D,),
    }


def layer_shapes(cfg: GPTConfig) -> dict:
    D, F = cfg.d_model, cfg.ff_dim
    return {
        "ln_1.weight": (D,),
        "ln_1.bias": (D,),
        "attn.c_attn.weight": (D, 3 * D),
        "attn.c_attn.bias": (3 * D,),
        "attn.c_proj.weight": (D, D),
        "attn.c_proj.bias": (D,),
        "ln_2.weight": (D,),
        "ln_2.bias": (D,),
        "mlp.c_fc.weight": (D, F),
        "mlp.c_fc.bias": (F,),
        "mlp.c_proj.weight": (F, D),
        "mlp.c_proj.bias": (D,),
    }


def _affine(get: Getter, name: str, weight: str) -> dict:
    return {weight: get(name + ".weight"), "bias": get(name + ".bias")}


def layer_to_meshtrain(get: Getter, cfg: GPTConfig) -> dict:
    D, H, K = cfg.d_model, cfg.n_heads, cfg.head_width
    qkv_DX, qkv_X = get("attn.c_attn.weight"), get("attn.c_attn.bias")  # X = 3·D: q | k | v
    attn = {
        name: {
            "kernel": qkv_DX[:, j * D : (j + 1) * D].reshape(D, H, K),
            "bias": qkv_X[j * D : (j + 1) * D].reshape(H, K),
        }
        for j, name in enumerate("qkv")
    }
    attn["o"] = {
        "kernel": get("attn.c_proj.weight").reshape(H, K, D),
        "bias": get("attn.c_proj.bias"),
    }
    return {
        "norm1": _affine(get, "ln_1", "scale"),
        "attn": attn,
        "norm2": _affine(get, "ln_2", "scale"),
        "mlp": {
            "up": _affine(get, "mlp.c_fc", "kernel"),
            "down": _affine(get, "mlp.c_proj", "kernel"),
        },
    }


def layer_to_hf(blk: Mapping, cfg: GPTConfig) -> dict:
    D = cfg.d_model
    attn, mlp = blk["attn"], blk["mlp"]
    return {
        "ln_1.weight": blk["norm1"]["scale"],
        "ln_1.bias": blk["norm1"]["bias"],
        "attn.c_attn.weight": np.concatenate([attn[n]["kernel"].reshape(D, D) for n in "qkv"], 1),
        "attn.c_attn.bias": np.concatenate([attn[n]["bias"].reshape(D) for n in "qkv"]),
        "attn.c_proj.weight": attn["o"]["kernel"].reshape(D, D),
        "attn.c_proj.bias": attn["o"]["bias"],
        "ln_2.weight": blk["norm2"]["scale"],
        "ln_2.bias": blk["norm2"]["bias"],
        "mlp.c_fc.weight": mlp["up"]["kernel"],
        "mlp.c_fc.bias": mlp["up"]["bias"],
        "mlp.c_proj.weight": mlp["down"]["kernel"],
        "mlp.c_proj.bias": mlp["down"]["bias"],
    }


def top_to_meshtrain(get: Getter, cfg: GPTConfig) -> dict:
    return {
        "embed": {"embedding": get("wte.weight")},
        "pos": get("wpe.weight"),
        "norm": {"scale": get("ln_f.weight"), "bias": get("ln_f.bias")},
    }


def top_to_hf(params: Mapping, cfg: GPTConfig) -> dict:
    return {
        "wte.weight": params["embed"]["embedding"],
        "wpe.weight": params["pos"],
        "ln_f.weight": params["norm"]["scale"],
        "ln_f.bias": params["norm"]["bias"],
    }


LAYOUT = Layout(
    style="gpt2",
    prefix="transformer.",
    block="h",
    top_shapes=top_shapes,
    layer_shapes=layer_shapes,
    layer_to_meshtrain=layer_to_meshtrain,
    layer_to_hf=layer_to_hf,
    top_to_meshtrain=top_to_meshtrain,
    top_to_hf=top_to_hf,
)

ADAPTER = Adapter(
    model_type="gpt2",
    architectures=("GPT2LMHeadModel", "GPT2Model"),
    layout=LAYOUT,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    export_problems=export_problems,
    keys=KEYS,
)
