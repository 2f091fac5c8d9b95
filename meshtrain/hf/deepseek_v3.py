"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, ``DeepseekV3Model``) with every layer dense ↔
meshtrain's ``style="llama"`` GPT with ``attention="mla"`` (`meshtrain.models.mla`).

Only the dense form is read: a file whose ``first_k_dense_replace`` is below
``num_hidden_layers`` has mixture-of-experts layers, and their import is not implemented yet.
The norms, MLP and embeddings are Llama's (`meshtrain.hf.llama`); the attention maps as::

    meshtrain (per layer)         DeepSeek-V3 (self_attn.…)
    attn.q.kernel    [D, H, E]    q_proj.weight [H·E, D]             (q_lora_rank null)
    attn.q_a.kernel  [D, Q]       q_a_proj.weight [Q, D]             (q_lora_rank = Q)
    attn.q_norm.scale [Q]         q_a_layernorm.weight [Q]
    attn.q_b.kernel  [Q, H, E]    q_b_proj.weight [H·E, Q]
    attn.kv_a.kernel [D, C+R]     kv_a_proj_with_mqa.weight [C+R, D]
    attn.kv_norm.scale [C]        kv_a_layernorm.weight [C]
    attn.kv_b.kernel [C, H, N+V]  kv_b_proj.weight [H·(N+V), C]
    attn.o.kernel    [H, V, D]    o_proj.weight [D, H·V]

(E = N + R: each head's N nope dims, then its R rope dims.) With ``rope_interleave=true``
(DeepSeek-V3's default) the file stores each rope part's rotation pairs interleaved, (x0, x1),
(x2, x3), …; transformers rotates those pairs. meshtrain rotates (first half, second half)
pairs, so import reorders the rope rows of q_proj/q_b_proj and kv_a_proj_with_mqa to evens
then odds (what transformers' rotation outputs, too), and export writes them back interleaved.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from meshtrain import validate
from meshtrain.filevalues import Key
from meshtrain.hf import llama
from meshtrain.hf.adapter import Adapter, Getter, Layout, expect, need, refuse
from meshtrain.models.gpt import GPTConfig
from meshtrain.problem import Problem

# --- config.json -----------------------------------------------------------------------------

KEYS = {k: v for k, v in llama.KEYS.items() if k != "head_dim"} | {
    "q_lora_rank": Key(int, 1, null=True, field="gpt.mla_q_rank"),
    "kv_lora_rank": Key(int, 1, required=True, field="gpt.mla_kv_rank"),
    "qk_nope_head_dim": Key(int, 1, required=True, field="gpt.mla_nope_dim"),
    "qk_rope_head_dim": Key(int, 1, required=True, field="gpt.mla_rope_dim"),
    "v_head_dim": Key(int, 1, required=True, field="gpt.mla_v_dim"),
    "first_k_dense_replace": Key(int, 0, required=True),
    "rope_interleave": Key(bool, null=True),
}


def config_from_hf(hf: Mapping) -> GPTConfig:
    """The `GPTConfig` of a dense DeepSeek-V3 ``config.json``."""
    n_layers, dense = need(hf, "num_hidden_layers"), need(hf, "first_k_dense_replace")
    if dense < n_layers:
        raise refuse(
            "first_k_dense_replace",
            dense,
            f"layers {dense}..{n_layers - 1} of {n_layers} are mixture-of-experts layers "
            f"(n_routed_experts={hf.get('n_routed_experts')}); importing DeepSeek-V3's MoE is "
            "not implemented yet, only the dense form (first_k_dense_replace = num_hidden_layers)",
        )
    expect(hf, "attention_bias", False, False)
    if hf.get("rope_interleave") is False:
        raise refuse("rope_interleave", False, "meshtrain reads DeepSeek-V3's interleaved layout")
    heads = need(hf, "num_attention_heads")
    if hf.get("num_key_value_heads", heads) not in (heads, None):
        raise refuse(
            "num_key_value_heads",
            hf["num_key_value_heads"],
            f"latent attention makes keys and values for all {heads} heads; it must equal "
            "num_attention_heads",
        )
    fields = llama.fields_from_hf({k: v for k, v in hf.items() if k != "head_dim"})
    return GPTConfig(
        **fields,
        attention="mla",
        mla_q_rank=hf.get("q_lora_rank") or 0,
        mla_kv_rank=need(hf, "kv_lora_rank"),
        mla_nope_dim=need(hf, "qk_nope_head_dim"),
        mla_rope_dim=need(hf, "qk_rope_head_dim"),
        mla_v_dim=need(hf, "v_head_dim"),
    )


def config_to_hf(cfg: GPTConfig) -> dict:
    """DeepSeek-V3's own ``config.json`` fields for `cfg` (every layer dense)."""
    out = llama.fields_to_hf(cfg)
    del out["head_dim"]  # transformers derives it (the rope width)
    return out | dict(
        num_key_value_heads=cfg.n_heads,
        first_k_dense_replace=cfg.n_layers,
        q_lora_rank=cfg.mla_q_rank or None,
        kv_lora_rank=cfg.mla_kv_rank,
        qk_nope_head_dim=cfg.mla_nope_dim,
        qk_rope_head_dim=cfg.mla_rope_dim,
        v_head_dim=cfg.mla_v_dim,
        rope_interleave=True,
        attention_bias=False,
    )


def export_problems(cfg: GPTConfig) -> list[Problem]:
    """Why DeepSeek-V3 cannot hold `cfg`; empty when it can."""
    return validate.require(
        cfg.attention == "mla",
        "gpt.attention",
        cfg.attention,
        "DeepSeek-V3 holds latent attention (attention='mla') only",
    )


# --- tensors ---------------------------------------------------------------------------------


def _deinterleave(rope: int) -> np.ndarray:
    """The order that takes interleaved rotation pairs to (first half, second half)."""
    return np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])


def _rope_rows(w: np.ndarray, first: int, rope: int, order: np.ndarray) -> np.ndarray:
    """`w` (rows along axis 0, per head in blocks of ``first + rope``) with each block's last
    `rope` rows taken in `order`."""
    width = first + rope
    blocks = w.reshape(-1, width, *w.shape[1:])
    rows = np.concatenate([np.arange(first), first + order])
    return blocks[:, rows].reshape(w.shape)


def top_shapes(cfg: GPTConfig) -> dict:
    return llama.top_shapes(cfg)


def layer_shapes(cfg: GPTConfig) -> dict:
    D, F, H = cfg.d_model, cfg.ff_dim, cfg.n_heads
    N, R, V = cfg.mla_nope_dim, cfg.mla_rope_dim, cfg.mla_v_dim
    Q, C = cfg.mla_q_rank, cfg.mla_kv_rank
    if Q:
        q = {
            "self_attn.q_a_proj.weight": (Q, D),
            "self_attn.q_a_layernorm.weight": (Q,),
            "self_attn.q_b_proj.weight": (H * (N + R), Q),
        }
    else:
        q = {"self_attn.q_proj.weight": (H * (N + R), D)}
    return q | {
        "input_layernorm.weight": (D,),
        "self_attn.kv_a_proj_with_mqa.weight": (C + R, D),
        "self_attn.kv_a_layernorm.weight": (C,),
        "self_attn.kv_b_proj.weight": (H * (N + V), C),
        "self_attn.o_proj.weight": (D, H * V),
        "post_attention_layernorm.weight": (D,),
        "mlp.gate_proj.weight": (F, D),
        "mlp.up_proj.weight": (F, D),
        "mlp.down_proj.weight": (D, F),
    }


def layer_to_meshtrain(get: Getter, cfg: GPTConfig) -> dict:
    D, H = cfg.d_model, cfg.n_heads
    N, R, V = cfg.mla_nope_dim, cfg.mla_rope_dim, cfg.mla_v_dim
    C = cfg.mla_kv_rank
    order = _deinterleave(R)
    attn = {}
    if cfg.mla_q_rank:
        q_b = _rope_rows(get("self_attn.q_b_proj.weight"), N, R, order)
        attn["q_a"] = {"kernel": get("self_attn.q_a_proj.weight").T}
        attn["q_norm"] = {"scale": get("self_attn.q_a_layernorm.weight")}
        attn["q_b"] = {"kernel": q_b.T.reshape(cfg.mla_q_rank, H, N + R)}
    else:
        q = _rope_rows(get("self_attn.q_proj.weight"), N, R, order)
        attn["q"] = {"kernel": q.T.reshape(D, H, N + R)}
    kv_a = _rope_rows(get("self_attn.kv_a_proj_with_mqa.weight"), C, R, order)
    attn["kv_a"] = {"kernel": kv_a.T}
    attn["kv_norm"] = {"scale": get("self_attn.kv_a_layernorm.weight")}
    attn["kv_b"] = {"kernel": get("self_attn.kv_b_proj.weight").T.reshape(C, H, N + V)}
    attn["o"] = {"kernel": get("self_attn.o_proj.weight").T.reshape(H, V, D)}
    linear = lambda name: {"kernel": get(f"mlp.{name}_proj.weight").T}
    return {
        "norm1": {"scale": get("input_layernorm.weight")},
        "attn": attn,
        "norm2": {"scale": get("post_attention_layernorm.weight")},
        "mlp": {"gate": linear("gate"), "up": linear("up"), "down": linear("down")},
    }


def layer_to_hf(blk: Mapping, cfg: GPTConfig) -> dict:
    D, H = cfg.d_model, cfg.n_heads
    N, R, V = cfg.mla_nope_dim, cfg.mla_rope_dim, cfg.mla_v_dim
    C = cfg.mla_kv_rank
    back = np.argsort(_deinterleave(R))  # (first half, second half) → interleaved
    attn, mlp = blk["attn"], blk["mlp"]
    out = {}
    if cfg.mla_q_rank:
        q_b = attn["q_b"]["kernel"].reshape(cfg.mla_q_rank, -1).T
        out["self_attn.q_a_proj.weight"] = attn["q_a"]["kernel"].T
        out["self_attn.q_a_layernorm.weight"] = attn["q_norm"]["scale"]
        out["self_attn.q_b_proj.weight"] = _rope_rows(q_b, N, R, back)
    else:
        q = attn["q"]["kernel"].reshape(D, -1).T
        out["self_attn.q_proj.weight"] = _rope_rows(q, N, R, back)
    return out | {
        "input_layernorm.weight": blk["norm1"]["scale"],
        "self_attn.kv_a_proj_with_mqa.weight": _rope_rows(attn["kv_a"]["kernel"].T, C, R, back),
        "self_attn.kv_a_layernorm.weight": attn["kv_norm"]["scale"],
        "self_attn.kv_b_proj.weight": attn["kv_b"]["kernel"].reshape(C, H * (N + V)).T,
        "self_attn.o_proj.weight": attn["o"]["kernel"].reshape(H * V, D).T,
        "post_attention_layernorm.weight": blk["norm2"]["scale"],
        **{f"mlp.{n}_proj.weight": mlp[n]["kernel"].T for n in ("gate", "up", "down")},
    }


LAYOUT = Layout(
    style="llama",
    prefix="model.",
    block="layers",
    top_shapes=top_shapes,
    layer_shapes=layer_shapes,
    layer_to_meshtrain=layer_to_meshtrain,
    layer_to_hf=layer_to_hf,
    top_to_meshtrain=llama.top_to_meshtrain,
    top_to_hf=llama.top_to_hf,
)

ADAPTER = Adapter(
    model_type="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM", "DeepseekV3Model"),
    layout=LAYOUT,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    export_problems=export_problems,
    keys=KEYS,
)
