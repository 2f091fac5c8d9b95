"""Mixtral (``MixtralForCausalLM``) ↔ meshtrain's `MoEConfig` / `MoE`.

Mixtral stores attention and norms as Llama does (`meshtrain.hf.llama`) and, per layer, a
router and one SwiGLU MLP per expert::

    meshtrain (per layer, stacked)    Mixtral (layer i)
    moe.router  [D, E]                block_sparse_moe.gate.weight [E, D]
    moe.gate[e] [D, F]                block_sparse_moe.experts.e.w1.weight [F, D]
    moe.up[e]   [D, F]                block_sparse_moe.experts.e.w3.weight [F, D]
    moe.down[e] [F, D]                block_sparse_moe.experts.e.w2.weight [D, F]

Mixtral routes as `meshtrain.models.moe_routing.route` with ``renormalize=True``: softmax over
the experts, top-k, the k weights divided by their sum. Imported models use dropless dispatch,
so nothing is dropped and the logits equal transformers'.

An imported model trains with ``MixtralForCausalLM``'s objective: its load-balancing loss
(``router_losses="mixtral"``, pooled over the layers and the real tokens), weighted by
``router_aux_loss_coef`` when ``output_router_logits`` is true (transformers adds it to the
loss only then) and 0 otherwise, and no z-loss. The loss is the same under every layout and
pipeline schedule: pooled over the whole batch, as one unpipelined step (the hand-scheduled
schedules run one more forward per step for it, `meshtrain.pipeline.hand_scheduled`).
`load_mixtral`'s ``objective=`` changes that; `save_mixtral` writes the weight back
(``output_router_logits`` true when it is not 0).

This adapter stands beside the GPT registry (`meshtrain.hf.registry` holds `GPTConfig`
architectures): `load_mixtral` and `save_mixtral` are its two entry points.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from meshtrain.filevalues import Key
from meshtrain.hf import llama, moe_files
from meshtrain.models.moe import MoE
from meshtrain.models.moe_config import MoEConfig

ARCHITECTURE = "MixtralForCausalLM"
OBJECTIVE = moe_files.OBJECTIVE  # the fields `load_mixtral`'s objective= may set
_LLAMA = llama.KEYS.items()
# The config.json keys `config_from_hf` reads, and the MoEConfig setting each fills.
KEYS = {
    **{k: dataclasses.replace(v, field=v.field.replace("gpt.", "moe.")) for k, v in _LLAMA},
    "num_local_experts": Key(int, 1, field="moe.n_experts"),
    "num_experts_per_tok": Key(int, 1, field="moe.top_k"),
    "router_aux_loss_coef": Key(float, 0, field="moe.aux_loss_coef"),
    "output_router_logits": Key(bool),
    "sliding_window": Key(int, 1, null=True, field="moe.sliding_window"),
}


def config_from_hf(hf: Mapping) -> MoEConfig:
    """The `MoEConfig` of a Mixtral ``config.json``: dropless dispatch, and the training objective
    of ``MixtralForCausalLM`` with that config (Mixtral's load-balancing loss weighted by
    ``router_aux_loss_coef`` if ``output_router_logits``, else 0; no z-loss)."""
    fields = moe_files.backbone_fields(hf)
    return MoEConfig(
        **fields,
        d_expert=fields["d_ff"],
        n_experts=hf.get("num_local_experts", 8),
        top_k=hf.get("num_experts_per_tok", 2),
        sliding_window=hf.get("sliding_window") or 0,
    )


def config_to_hf(cfg: MoEConfig) -> dict:
    """Mixtral's ``config.json`` for `cfg`: the load-balancing weight as ``router_aux_loss_coef``,
    on (``output_router_logits``) when it is not 0. transformers knows no z-loss and only
    Mixtral's definition of the loss (``router_losses="mixtral"``)."""
    if cfg.moe_every != 1 or cfg.shared_expert or not cfg.renormalize or cfg.qk_norm:
        raise ValueError(
            f"Mixtral holds MoE blocks in every layer, no shared expert, renormalised top-k and "
            f"no query/key norms; this config has moe_every={cfg.moe_every}, shared_expert="
            f"{cfg.shared_expert}, renormalize={cfg.renormalize}, qk_norm={cfg.qk_norm}"
        )
    moe_files.require_softmax_router(cfg, "Mixtral")
    g = cfg.backbone
    out = llama.fields_to_hf(dataclasses.replace(g, d_ff=cfg.expert_dim))
    return out | dict(
        architectures=[ARCHITECTURE],
        model_type="mixtral",
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=cfg.tie_embeddings,
        num_local_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        router_aux_loss_coef=cfg.aux_loss_coef,
        output_router_logits=cfg.aux_loss_coef > 0,
        sliding_window=cfg.sliding_window or None,
        dtype="float32",
    )


def _layer_to_meshtrain(get, cfg: MoEConfig) -> dict:
    """One Mixtral layer's tensors → the MoE block's params (numpy)."""
    g = cfg.backbone
    D, H, G, K = g.d_model, g.n_heads, g.kv_heads, g.head_width
    moe = "block_sparse_moe."
    expert = [f"{moe}experts.{e}." for e in range(cfg.n_experts)]
    return {
        "norm1": {"scale": get("input_layernorm.weight")},
        "norm2": {"scale": get("post_attention_layernorm.weight")},
        "attn": {
            "q": {"kernel": get("self_attn.q_proj.weight").T.reshape(D, H, K)},
            "k": {"kernel": get("self_attn.k_proj.weight").T.reshape(D, G, K)},
            "v": {"kernel": get("self_attn.v_proj.weight").T.reshape(D, G, K)},
            "o": {"kernel": get("self_attn.o_proj.weight").T.reshape(H, K, D)},
        },
        "moe": {
            "router": get(f"{moe}gate.weight").T,
            "gate": np.stack([get(p + "w1.weight").T for p in expert]),
            "up": np.stack([get(p + "w3.weight").T for p in expert]),
            "down": np.stack([get(p + "w2.weight").T for p in expert]),
        },
    }


def _layer_to_hf(p: Mapping, cfg: MoEConfig) -> dict[str, np.ndarray]:
    """The MoE block's params (numpy, one layer) → Mixtral's tensors of that layer."""
    D = cfg.d_model
    attn, moe = p["attn"], p["moe"]
    out = {
        "input_layernorm.weight": p["norm1"]["scale"],
        "post_attention_layernorm.weight": p["norm2"]["scale"],
        "self_attn.q_proj.weight": attn["q"]["kernel"].reshape(D, -1).T,
        "self_attn.k_proj.weight": attn["k"]["kernel"].reshape(D, -1).T,
        "self_attn.v_proj.weight": attn["v"]["kernel"].reshape(D, -1).T,
        "self_attn.o_proj.weight": attn["o"]["kernel"].reshape(-1, D).T,
        "block_sparse_moe.gate.weight": moe["router"].T,
    }
    for e in range(cfg.n_experts):
        pre = f"block_sparse_moe.experts.{e}."
        out[pre + "w1.weight"] = moe["gate"][e].T
        out[pre + "w3.weight"] = moe["up"][e].T
        out[pre + "w2.weight"] = moe["down"][e].T
    return out


def load_mixtral(
    path: str | Path, *, dispatch: str = "dropless", objective: Mapping | None = None
) -> MoE:
    """A Mixtral directory (``config.json`` + safetensors) as a meshtrain `MoE`, set to train
    on ``MixtralForCausalLM``'s objective: ``router_losses="mixtral"``, the load-balancing
    loss pooled over every layer and the whole batch under every pipeline schedule (one
    unpipelined step is its reference), unless `objective` says otherwise.

    Args:
        path: the directory ``save_pretrained`` wrote.
        dispatch: the dispatch of the model (``dropless`` reproduces transformers exactly).
        objective: `MoEConfig` fields of the training objective to set instead of
            transformers' (`config_from_hf`): ``router_losses``, ``aux_loss_coef``,
            ``z_loss_coef``; e.g. ``{"router_losses": "meshtrain", "aux_loss_coef": 0.01}``.

    Returns:
        The model (unsharded, float32 parameters).
    """
    path = Path(path)
    cfg = moe_files.read_config(path, ARCHITECTURE, KEYS, config_from_hf)
    cfg = moe_files.with_objective(cfg, objective, "load_mixtral", dispatch)
    return moe_files.load(path, cfg, _no_dense, _layer_to_meshtrain)


def _no_dense(get, cfg: MoEConfig) -> dict:
    raise ValueError("Mixtral holds MoE blocks in every layer")


def save_mixtral(model: MoE, path: str | Path) -> Path:
    """Writes `model` as a Mixtral directory (``config.json`` + float32 ``model.safetensors``).

    Args:
        model: an `MoE` whose config Mixtral can hold (MoE in every layer, no shared expert).
        path: the directory to create.

    Returns:
        The directory.
    """
    hf = config_to_hf(model.cfg)
    return moe_files.save(model, Path(path), hf, _no_dense, _layer_to_hf)
