"""Qwen3-MoE (``Qwen3MoeForCausalLM``) ↔ meshtrain's `MoEConfig` / `MoE`.

Attention and norms are Qwen3's (`meshtrain.hf.qwen3`: Llama's layout with query/key norms,
``qk_norm=True``); a sparse layer holds a router and one SwiGLU MLP per expert, a dense layer
Llama's MLP of width ``intermediate_size``::

    meshtrain (per MoE block, stacked)  Qwen3-MoE (layer i)
    moe.router  [D, E]                  mlp.gate.weight [E, D]
    moe.gate[e] [D, F]                  mlp.experts.e.gate_proj.weight [F, D]
    moe.up[e]   [D, F]                  mlp.experts.e.up_proj.weight [F, D]
    moe.down[e] [F, D]                  mlp.experts.e.down_proj.weight [D, F]

``moe_intermediate_size`` is F (``d_expert``), ``num_experts`` (``num_local_experts`` as
transformers 5 writes it) E, ``num_experts_per_tok`` the top-k, ``norm_topk_prob``
``renormalize`` (Qwen3-MoE routes as Mixtral does: softmax, top-k, then the k weights divided
by their sum only when it is true). Layer i is sparse when it is not
in ``mlp_only_layers`` and (i + 1) is a multiple of ``decoder_sparse_step``; meshtrain holds
the pattern where every n-th layer is sparse (``moe_every = n``, n dividing the layer count)
and refuses any other, naming the field. A sliding window (``use_sliding_window``) covers every
layer, as transformers applies it.

transformers' ``Qwen3MoeForCausalLM`` trains with the same load-balancing loss as Mixtral's (its
``load_balancing_loss_func`` is the same function, over the sparse layers' routers, pooled
with the real tokens): an imported model trains with ``router_losses="mixtral"``, weighted by
``router_aux_loss_coef`` when ``output_router_logits`` is true and 0 otherwise, no z-loss, as
`meshtrain.hf.mixtral` explains. `load_qwen3_moe` and `save_qwen3_moe` are the entry points.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from meshtrain.filevalues import Key
from meshtrain.hf import llama, moe_files
from meshtrain.hf.adapter import expect, need, refuse
from meshtrain.models.moe import MoE
from meshtrain.models.moe_config import MoEConfig

ARCHITECTURE = "Qwen3MoeForCausalLM"
_LLAMA = llama.KEYS.items()
# The config.json keys `config_from_hf` reads, and the MoEConfig setting each fills.
KEYS = {
    **{k: dataclasses.replace(v, field=v.field.replace("gpt.", "moe.")) for k, v in _LLAMA},
    "num_experts": Key(int, 1, field="moe.n_experts"),  # as the hub's files name it
    "num_local_experts": Key(int, 1, field="moe.n_experts"),  # as transformers 5 writes it
    "num_experts_per_tok": Key(int, 1, field="moe.top_k"),
    "moe_intermediate_size": Key(int, 1, field="moe.d_expert"),
    "norm_topk_prob": Key(bool, field="moe.renormalize"),
    "decoder_sparse_step": Key(int, 1),
    "mlp_only_layers": Key(list, null=True),
    "router_aux_loss_coef": Key(float, 0, field="moe.aux_loss_coef"),
    "output_router_logits": Key(bool),
    "use_sliding_window": Key(bool),
    "sliding_window": Key(int, 1, null=True, field="moe.sliding_window"),
}
_DEFAULTS = dict(num_experts_per_tok=8, moe_intermediate_size=768)  # Qwen3MoeConfig's


def moe_every_from_hf(hf: Mapping) -> int:
    """The `MoEConfig.moe_every` whose pattern of sparse layers is transformers' for `hf`."""
    n = need(hf, "num_hidden_layers")
    step = hf.get("decoder_sparse_step", 1)
    only = hf.get("mlp_only_layers") or []
    sparse = [i not in only and (i + 1) % step == 0 for i in range(n)]
    for every in range(1, n + 1):
        if n % every == 0 and sparse == [(i + 1) % every == 0 for i in range(n)]:
            return every
    field, got = ("mlp_only_layers", only) if only else ("decoder_sparse_step", step)
    raise refuse(
        field,
        got,
        f"its sparse layers {[i for i in range(n) if sparse[i]]} of {n} are not every n-th "
        "layer for an n dividing num_hidden_layers, the one pattern meshtrain's MoE holds",
    )


def config_from_hf(hf: Mapping) -> MoEConfig:
    """The `MoEConfig` of a Qwen3-MoE ``config.json``: dropless dispatch, and the training
    objective of ``Qwen3MoeForCausalLM`` (as `meshtrain.hf.mixtral.config_from_hf`)."""
    expect(hf, "attention_bias", False, False)  # it biases o_proj too; not modelled
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    hf = _DEFAULTS | dict(hf)
    return MoEConfig(
        **moe_files.backbone_fields(hf),
        qk_norm=True,
        n_experts=hf.get("num_local_experts") or hf.get("num_experts") or 128,
        top_k=hf["num_experts_per_tok"],
        d_expert=hf["moe_intermediate_size"],
        renormalize=bool(hf.get("norm_topk_prob", False)),
        moe_every=moe_every_from_hf(hf),
        sliding_window=window or 0,
    )


def config_to_hf(cfg: MoEConfig) -> dict:
    """Qwen3-MoE's ``config.json`` for `cfg` (the objective written as Mixtral's is)."""
    if cfg.shared_expert or not cfg.qk_norm or cfg.router_losses != "mixtral":
        raise ValueError(
            f"Qwen3-MoE has no shared expert, always normalises queries and keys and trains "
            f"with transformers' pooled router loss; this config has shared_expert="
            f"{cfg.shared_expert}, qk_norm={cfg.qk_norm}, router_losses={cfg.router_losses!r}"
        )
    moe_files.require_softmax_router(cfg, "Qwen3-MoE")
    g = cfg.backbone
    window = cfg.sliding_window
    return llama.fields_to_hf(g) | dict(
        architectures=[ARCHITECTURE],
        model_type="qwen3_moe",
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        num_local_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        moe_intermediate_size=cfg.expert_dim,
        norm_topk_prob=cfg.renormalize,
        decoder_sparse_step=cfg.moe_every,
        mlp_only_layers=[],
        router_aux_loss_coef=cfg.aux_loss_coef,
        output_router_logits=cfg.aux_loss_coef > 0,
        use_sliding_window=bool(window),
        sliding_window=window or None,
        dtype="float32",
    )


def _dense_to_meshtrain(get, cfg: MoEConfig) -> dict:
    """A dense layer's tensors → a dense block's params (numpy)."""
    return llama.layer_to_meshtrain(get, cfg.backbone)


def _sparse_to_meshtrain(get, cfg: MoEConfig) -> dict:
    """A sparse layer's tensors → the MoE block's params (numpy)."""
    expert = [f"mlp.experts.{e}." for e in range(cfg.n_experts)]
    stack = lambda name: np.stack([get(f"{p}{name}_proj.weight").T for p in expert])
    moe = {"router": get("mlp.gate.weight").T}
    moe |= {"gate": stack("gate"), "up": stack("up"), "down": stack("down")}
    return llama.attention_to_meshtrain(get, cfg.backbone) | {"moe": moe}


def _dense_to_hf(p: Mapping, cfg: MoEConfig) -> dict[str, np.ndarray]:
    return llama.layer_to_hf(p, cfg.backbone)


def _sparse_to_hf(p: Mapping, cfg: MoEConfig) -> dict[str, np.ndarray]:
    moe = p["moe"]
    out = llama.attention_to_hf(p, cfg.backbone) | {"mlp.gate.weight": moe["router"].T}
    for e in range(cfg.n_experts):
        out |= {f"mlp.experts.{e}.{n}_proj.weight": moe[n][e].T for n in ("gate", "up", "down")}
    return out


def load_qwen3_moe(
    path: str | Path, *, dispatch: str = "dropless", objective: Mapping | None = None
) -> MoE:
    """A Qwen3-MoE directory (``config.json`` + safetensors) as a meshtrain `MoE`, set to train on
    ``Qwen3MoeForCausalLM``'s objective unless `objective` says otherwise.

    Args:
        path: the directory ``save_pretrained`` wrote.
        dispatch: the dispatch of the model (``dropless`` reproduces transformers exactly).
        objective: `MoEConfig` fields of the training objective to set instead of
            transformers' (``router_losses``, ``aux_loss_coef``, ``z_loss_coef``).

    Returns:
        The model (unsharded, float32 parameters).
    """
    path = Path(path)
    cfg = moe_files.read_config(path, ARCHITECTURE, KEYS, config_from_hf)
    cfg = moe_files.with_objective(cfg, objective, "load_qwen3_moe", dispatch)
    return moe_files.load(path, cfg, _dense_to_meshtrain, _sparse_to_meshtrain)


def save_qwen3_moe(model: MoE, path: str | Path) -> Path:
    """Writes `model` as a Qwen3-MoE directory (``config.json`` + float32 ``model.safetensors``).

    Args:
        model: an `MoE` with ``qk_norm`` and no shared expert.
        path: the directory to create.

    Returns:
        The directory.
    """
    hf = config_to_hf(model.cfg)
    return moe_files.save(model, Path(path), hf, _dense_to_hf, _sparse_to_hf)
