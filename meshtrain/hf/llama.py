"""Llama (``LlamaForCausalLM``, ``LlamaModel``) ↔ meshtrain's ``style="llama"`` GPT.

Llama stores ``nn.Linear`` weights ``[out, in]`` with flat head dimensions::

    meshtrain (per layer)           Llama
    attn.q/k/v.kernel [D, H|G, K]   self_attn.q_proj/k_proj/v_proj.weight [H|G·K, D]
    attn.q/k/v.bias   [H|G, K]      self_attn.q_proj/k_proj/v_proj.bias [H|G·K] (qkv_bias only)
    attn.o.kernel     [H, K, D]     self_attn.o_proj.weight [D, H·K]
    attn.q/k_norm.scale [K]         self_attn.q_norm/k_norm.weight [K] (qk_norm only: Qwen3)
    mlp.gate/up.kernel [D, F]       mlp.gate_proj/up_proj.weight [F, D]
    mlp.down.kernel   [F, D]        mlp.down_proj.weight [D, F]
    norm1 / norm2                   input_layernorm / post_attention_layernorm (RMSNorm)
    embed.embedding   [V, D]        embed_tokens [V, D]

The head width K is ``head_dim`` when the file sets it (H·K may differ from D), else D / H.
HF Llama's RoPE rotates (first half, second half) pairs, as `layers.apply_rope` does, so q and
k need no permutation. The layout and the config helpers here (`fields_from_hf`,
`fields_to_hf`) are for the architectures that store their weights as Llama does: they
import this module rather than copy it.
"""

from __future__ import annotations

from collections.abc import Mapping

from meshtrain import validate
from meshtrain.filevalues import Key
from meshtrain.hf.adapter import Adapter, Getter, Layout, expect, need, refuse
from meshtrain.models.gpt import GPTConfig
from meshtrain.problem import Problem

# --- config.json -----------------------------------------------------------------------------

# The keys `fields_from_hf` reads, and the GPTConfig setting each fills.
KEYS = {
    "vocab_size": Key(int, 1, required=True, field="gpt.vocab_size"),
    "hidden_size": Key(int, 1, required=True, field="gpt.d_model"),
    "num_hidden_layers": Key(int, 1, required=True, field="gpt.n_layers"),
    "num_attention_heads": Key(int, 1, required=True, field="gpt.n_heads"),
    "num_key_value_heads": Key(int, 1, null=True, field="gpt.n_kv_heads"),
    "intermediate_size": Key(int, 1, required=True, field="gpt.d_ff"),
    "head_dim": Key(int, 1, null=True, field="gpt.head_dim"),
    "max_position_embeddings": Key(int, 1, field="gpt.max_seq_len"),
    "rms_norm_eps": Key(float, 0, strict=True, field="gpt.norm_eps"),
    "rope_theta": Key(float, 0, strict=True, field="gpt.rope_theta"),
    "tie_word_embeddings": Key(bool, field="gpt.tie_embeddings"),
    "original_max_position_embeddings": Key(int, 1, null=True),
    "partial_rotary_factor": Key(float, 0, strict=True),
    "attention_bias": Key(bool),
    "mlp_bias": Key(bool),
}


def fields_from_hf(hf: Mapping, default_head_dim: int | None = None) -> dict:
    """The `GPTConfig` fields every Llama-layout ``config.json`` holds (sizes, norms, RoPE);
    `default_head_dim` is the head width the architecture assumes when ``head_dim`` is absent
    (None: hidden_size / num_attention_heads)."""
    expect(hf, "hidden_act", "silu", "silu")
    expect(hf, "mlp_bias", False, False)
    d_model, n_heads = need(hf, "hidden_size"), need(hf, "num_attention_heads")
    head_dim = hf.get("head_dim") or default_head_dim
    if head_dim is not None and head_dim * n_heads == d_model:
        head_dim = None  # meshtrain's default: the heads split d_model
    kv = hf.get("num_key_value_heads") or n_heads
    return dict(
        style="llama",
        vocab_size=need(hf, "vocab_size"),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        d_model=d_model,
        n_layers=need(hf, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=0 if kv == n_heads else kv,
        d_ff=need(hf, "intermediate_size"),
        head_dim=head_dim or 0,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **rope_from_hf(hf),
    )


def rope_from_hf(hf: Mapping) -> dict:
    """The RoPE fields of `GPTConfig` from ``rope_scaling`` (transformers 4 files, Llama 3.1)
    or ``rope_parameters`` (transformers 5), with transformers' precedence: ``rope_scaling``
    first, and ``rope_theta`` inside the dict before the top-level one."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if any(isinstance(v, Mapping) for v in rope.values()):
        raise refuse("rope_parameters", rope, "RoPE per layer type is not implemented")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise refuse("partial_rotary_factor", partial, "meshtrain rotates the whole head")
    fields = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return fields
    if kind != "llama3":
        raise ValueError(
            f"RoPE scaling {kind!r} is not supported; meshtrain implements the default RoPE "
            "and 'llama3'"
        )
    # transformers takes a top-level original_max_position_embeddings first, then the dict's,
    # then max_position_embeddings.
    original = hf.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings"
    )
    return fields | dict(
        rope_scaling="llama3",
        rope_factor=float(_need_rope(rope, "factor")),
        rope_low_freq_factor=float(_need_rope(rope, "low_freq_factor")),
        rope_high_freq_factor=float(_need_rope(rope, "high_freq_factor")),
        rope_original_max_seq_len=int(original or need(hf, "max_position_embeddings")),
    )


def _need_rope(rope: Mapping, key: str):
    if rope.get(key) is None:
        raise ValueError(f"RoPE scaling 'llama3' needs field {key!r} in rope_parameters; add it")
    return rope[key]


def fields_to_hf(cfg: GPTConfig) -> dict:
    """The ``config.json`` fields every Llama-layout architecture writes for `cfg`."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = {}
    if cfg.rope_scaling == "llama3":
        scaling = dict(
            rope_type="llama3",
            factor=cfg.rope_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_seq_len,
        )
        rope |= scaling
    out = dict(
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ff_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_width,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,  # transformers < 5 reads this and rope_scaling
        rope_parameters=rope,  # transformers 5 reads this (rope_scaling first when present)
    )
    if scaling:
        out["rope_scaling"] = scaling  # as Llama 3.1 files write it
    return out


def config_from_hf(hf: Mapping) -> GPTConfig:
    """The `GPTConfig` of a Llama ``config.json``."""
    expect(hf, "attention_bias", False, False)  # Llama's bias covers o_proj too; not modelled
    return GPTConfig(**fields_from_hf(hf))


def config_to_hf(cfg: GPTConfig) -> dict:
    """Llama's own ``config.json`` fields for `cfg`."""
    return fields_to_hf(cfg) | dict(attention_bias=False, mlp_bias=False)


def no_qk_norm(cfg: GPTConfig, name: str) -> list[Problem]:
    """The line for architecture `name`, which has no query/key norms, and a `cfg` that has."""
    return validate.require(
        not cfg.qk_norm, "gpt.qk_norm", cfg.qk_norm, f"{name} has no query/key norms (Qwen3 has)"
    )


def mha_problems(cfg: GPTConfig) -> list[Problem]:
    """Latent attention, which no Llama-layout architecture holds (DeepSeek-V3 does)."""
    return validate.require(
        cfg.attention == "mha",
        "gpt.attention",
        cfg.attention,
        "Llama's layout holds mha attention only; latent attention exports as DeepSeek-V3",
    )


def export_problems(cfg: GPTConfig) -> list[Problem]:
    """Why Llama cannot hold `cfg`; empty when it can."""
    problems = mha_problems(cfg) + no_qk_norm(cfg, "Llama")
    problems += validate.require(
        not cfg.qkv_bias,
        "gpt.qkv_bias",
        cfg.qkv_bias,
        "Llama's attention_bias also biases o_proj (Qwen2 holds q/k/v biases)",
    )
    return problems + validate.require(
        not cfg.sliding_window,
        "gpt.sliding_window",
        cfg.sliding_window,
        "Llama has no sliding-window attention",
    )


# --- tensors ---------------------------------------------------------------------------------


def top_shapes(cfg: GPTConfig) -> dict:
    return {"embed_tokens.weight": (cfg.vocab_size, cfg.d_model), "norm.weight": (cfg.d_model,)}


def layer_shapes(cfg: GPTConfig) -> dict:
    D, F = cfg.d_model, cfg.ff_dim
    HK, GK = cfg.n_heads * cfg.head_width, cfg.kv_heads * cfg.head_width
    shapes = {
        "input_layernorm.weight": (D,),
        "self_attn.q_proj.weight": (HK, D),
        "self_attn.k_proj.weight": (GK, D),
        "self_attn.v_proj.weight": (GK, D),
        "self_attn.o_proj.weight": (D, HK),
        "post_attention_layernorm.weight": (D,),
        "mlp.gate_proj.weight": (F, D),
        "mlp.up_proj.weight": (F, D),
        "mlp.down_proj.weight": (D, F),
    }
    if cfg.qkv_bias:
        shapes |= {"self_attn.q_proj.bias": (HK,)}
        shapes |= {f"self_attn.{n}_proj.bias": (GK,) for n in "kv"}
    if cfg.qk_norm:
        shapes |= {f"self_attn.{n}_norm.weight": (cfg.head_width,) for n in "qk"}
    return shapes


def attention_to_meshtrain(get: Getter, cfg: GPTConfig) -> dict:
    """One layer's norms and attention (all but its MLP) as meshtrain params."""
    D, K = cfg.d_model, cfg.head_width
    heads = {"q": cfg.n_heads, "k": cfg.kv_heads, "v": cfg.kv_heads}
    attn = {}
    for n, count in heads.items():
        attn[n] = {"kernel": get(f"self_attn.{n}_proj.weight").T.reshape(D, count, K)}
        if cfg.qkv_bias:
            attn[n]["bias"] = get(f"self_attn.{n}_proj.bias").reshape(count, K)
    attn["o"] = {"kernel": get("self_attn.o_proj.weight").T.reshape(cfg.n_heads, K, D)}
    if cfg.qk_norm:
        attn |= {f"{n}_norm": {"scale": get(f"self_attn.{n}_norm.weight")} for n in "qk"}
    return {
        "norm1": {"scale": get("input_layernorm.weight")},
        "attn": attn,
        "norm2": {"scale": get("post_attention_layernorm.weight")},
    }


def layer_to_meshtrain(get: Getter, cfg: GPTConfig) -> dict:
    linear = lambda name: {"kernel": get(f"mlp.{name}_proj.weight").T}
    mlp = {"gate": linear("gate"), "up": linear("up"), "down": linear("down")}
    return attention_to_meshtrain(get, cfg) | {"mlp": mlp}


def attention_to_hf(blk: Mapping, cfg: GPTConfig) -> dict:
    """One layer's norms and attention (meshtrain params) as HF tensors."""
    D, HK = cfg.d_model, cfg.n_heads * cfg.head_width
    attn = blk["attn"]
    out = {
        "input_layernorm.weight": blk["norm1"]["scale"],
        **{f"self_attn.{n}_proj.weight": attn[n]["kernel"].reshape(D, -1).T for n in "qkv"},
        "self_attn.o_proj.weight": attn["o"]["kernel"].reshape(HK, D).T,
        "post_attention_layernorm.weight": blk["norm2"]["scale"],
    }
    if cfg.qkv_bias:
        out |= {f"self_attn.{n}_proj.bias": attn[n]["bias"].reshape(-1) for n in "qkv"}
    if cfg.qk_norm:
        out |= {f"self_attn.{n}_norm.weight": attn[f"{n}_norm"]["scale"] for n in "qk"}
    return out


def layer_to_hf(blk: Mapping, cfg: GPTConfig) -> dict:
    mlp = blk["mlp"]
    out = attention_to_hf(blk, cfg)
    return out | {f"mlp.{n}_proj.weight": mlp[n]["kernel"].T for n in ("gate", "up", "down")}


def top_to_meshtrain(get: Getter, cfg: GPTConfig) -> dict:
    return {
        "embed": {"embedding": get("embed_tokens.weight")},
        "norm": {"scale": get("norm.weight")},
    }


def top_to_hf(params: Mapping, cfg: GPTConfig) -> dict:
    return {
        "embed_tokens.weight": params["embed"]["embedding"],
        "norm.weight": params["norm"]["scale"],
    }


LAYOUT = Layout(
    style="llama",
    prefix="model.",
    block="layers",
    top_shapes=top_shapes,
    layer_shapes=layer_shapes,
    layer_to_meshtrain=layer_to_meshtrain,
    layer_to_hf=layer_to_hf,
    top_to_meshtrain=top_to_meshtrain,
    top_to_hf=top_to_hf,
)

ADAPTER = Adapter(
    model_type="llama",
    architectures=("LlamaForCausalLM", "LlamaModel"),
    layout=LAYOUT,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    export_problems=export_problems,
    keys=KEYS,
)
