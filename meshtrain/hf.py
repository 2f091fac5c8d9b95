"""Hugging Face interchange: GPT-2 and Llama weights as ``config.json`` + ``model.safetensors``.

Reads and writes the layout ``transformers`` saves for ``GPT2LMHeadModel`` and
``LlamaForCausalLM`` with the `safetensors` numpy API (no torch). meshtrain keeps the blocks
stacked along a leading ``layers`` dimension and splits attention weights per head; the HF
files keep one tensor per layer and flat head dimensions::

    meshtrain (GPT, per layer)      GPT-2 (Conv1D, [in, out])      Llama (nn.Linear, [out, in])
    attn.q/k/v.kernel [D, H|G, K]   attn.c_attn.weight [D, 3D]     q_proj/k_proj/v_proj [H|G·K, D]
    attn.q/k/v.bias   [H|G, K]      attn.c_attn.bias   [3D]        -
    attn.o.kernel     [H, K, D]     attn.c_proj.weight [D, D]      o_proj [D, H·K]
    mlp.gate/up.kernel [D, F]       mlp.c_fc.weight    [D, F]      gate_proj/up_proj [F, D]
    mlp.down.kernel   [F, D]        mlp.c_proj.weight  [F, D]      down_proj [D, F]
    norm1 / norm2                   ln_1 / ln_2 (LayerNorm)        input_/post_attention_layernorm
    embed.embedding   [V, D]        wte [V, D]                     embed_tokens [V, D]
    pos               [T, D]        wpe [n_positions, D]           - (RoPE, rotate-half halves)
    head.kernel       [D, V]        lm_head [V, D] (usually tied)  lm_head [V, D]

The files hold the true ``vocab_size`` rows; meshtrain's embedding and head hold
``cfg.padded_vocab`` (see `GPTConfig.vocab_multiple`): import pads them with zero rows,
export drops the padding, and ``config.json`` keeps the true ``vocab_size``.

The two agree on the rest: GPT-2's ``gelu_new`` is the tanh GELU of `jax.nn.gelu`; HF Llama's
RoPE rotates (first half, second half) pairs, as `layers.apply_rope` does, so q/k need no
permutation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from meshtrain.layout import Rules, named, state_specs
from meshtrain.models.gpt import GPT, GPTConfig

ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    "GPT2Model": "gpt2",
    "LlamaForCausalLM": "llama",
    "LlamaModel": "llama",
}
SAVE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": jnp.bfloat16}
_PREFIX = {"gpt2": "transformer.", "llama": "model."}
# Buffers some older transformers versions saved beside the weights; they hold no parameters.
_BUFFERS = ("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq")


# --- config.json ---------------------------------------------------------------------------


def _style_of(hf: Mapping, where: str) -> str:
    """``"gpt2"`` or ``"llama"`` from ``architectures`` (or ``model_type``)."""
    archs = hf.get("architectures") or []
    known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if known:
        return known[0]
    if not archs and hf.get("model_type") in ("gpt2", "llama"):
        return hf["model_type"]
    got = archs or hf.get("model_type")
    raise ValueError(
        f"{where}: architecture {got!r} is not supported; meshtrain reads "
        f"{', '.join(ARCHITECTURES)} (GPT-2 and Llama layouts). Convert the model to one of "
        "them, or load it with transformers instead"
    )


def _need(hf: Mapping, key: str, where: str):
    """``hf[key]``, or a ValueError naming the missing field."""
    if hf.get(key) is None:
        raise ValueError(f"{where}: field {key!r} is missing; add it (see transformers' config)")
    return hf[key]


def _expect(hf: Mapping, key: str, want, where: str, default=None) -> None:
    """Refuses a config field whose value meshtrain's model cannot reproduce."""
    got = hf.get(key, default)
    ok = got in want if isinstance(want, tuple) else got == want
    if not ok:
        raise ValueError(
            f"{where}: {key}={got!r} is not supported; meshtrain's model needs {key}={want!r}"
        )


def config_from_hf(hf: Mapping, *, where: str = "config.json") -> GPTConfig:
    """The `GPTConfig` a Hugging Face ``config.json`` describes.

    Args:
        hf: the parsed ``config.json``.
        where: a label for error messages (the file).

    Returns:
        The config; ``d_ff`` and ``n_kv_heads`` are 0 where they equal meshtrain's defaults.
    """
    style = _style_of(hf, where)
    if style == "gpt2":
        _expect(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), where, "gelu_new")
        _expect(hf, "scale_attn_weights", True, where, True)
        _expect(hf, "scale_attn_by_inverse_layer_idx", False, where, False)
        _expect(hf, "add_cross_attention", False, where, False)
        d_model = _need(hf, "n_embd", where)
        fields = dict(
            vocab_size=_need(hf, "vocab_size", where),
            max_seq_len=hf.get("n_positions", 1024),
            d_model=d_model,
            n_layers=_need(hf, "n_layer", where),
            n_heads=_need(hf, "n_head", where),
            d_ff=hf.get("n_inner") or 0,
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        )
    else:
        _expect(hf, "hidden_act", "silu", where, "silu")
        _expect(hf, "attention_bias", False, where, False)
        _expect(hf, "mlp_bias", False, where, False)
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"{where}: RoPE scaling {rope_type!r} is not supported; meshtrain implements the "
                "default (unscaled) RoPE only"
            )
        d_model, n_heads = _need(hf, "hidden_size", where), _need(hf, "num_attention_heads", where)
        head_dim = hf.get("head_dim") or d_model // n_heads
        if head_dim * n_heads != d_model:
            raise ValueError(
                f"{where}: head_dim={head_dim} × num_attention_heads={n_heads} ≠ "
                f"hidden_size={d_model}; meshtrain's heads are hidden_size / num_attention_heads"
            )
        kv = hf.get("num_key_value_heads") or n_heads
        fields = dict(
            vocab_size=_need(hf, "vocab_size", where),
            max_seq_len=hf.get("max_position_embeddings", 2048),
            d_model=d_model,
            n_layers=_need(hf, "num_hidden_layers", where),
            n_heads=n_heads,
            n_kv_heads=0 if kv == n_heads else kv,
            d_ff=_need(hf, "intermediate_size", where),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    try:
        cfg = GPTConfig(style=style, **fields)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if cfg.d_ff == dataclasses.replace(cfg, d_ff=0).ff_dim:
        cfg = dataclasses.replace(cfg, d_ff=0)
    return cfg


def config_to_hf(cfg: GPTConfig, *, dtype: str = "float32") -> dict:
    """The Hugging Face ``config.json`` for `cfg` (``GPT2LMHeadModel`` or ``LlamaForCausalLM``).

    Args:
        cfg: the model config.
        dtype: the dtype the weights are saved in.

    Returns:
        A JSON-serialisable dict.
    """
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings, dtype=dtype)
    common.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if cfg.style == "gpt2":
        if cfg.kv_heads != cfg.n_heads:
            raise ValueError(
                f"gpt n_kv_heads={cfg.n_kv_heads}: GPT-2 has no grouped-query attention, so "
                "this model has no GPT-2 layout; use style='llama' or n_kv_heads=0"
            )
        return dict(
            architectures=["GPT2LMHeadModel"],
            model_type="gpt2",
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
            **common,
        )
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ff_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,  # transformers < 5 reads this; 5 reads rope_parameters
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=False,
        mlp_bias=False,
        **common,
    )


def same_architecture(a: GPTConfig, b: GPTConfig) -> list[str]:
    """The fields (after defaults) in which two configs describe different weights or math."""
    fields = ["style", "vocab_size", "d_model", "n_layers", "n_heads", "kv_heads", "ff_dim"]
    fields += ["norm_eps", "tie_embeddings"]
    fields += ["max_seq_len"] if a.style == "gpt2" else ["rope_theta"]
    return [
        f"{f}: {getattr(a, f)!r} vs {getattr(b, f)!r}"
        for f in fields
        if getattr(a, f) != getattr(b, f)
    ]


# --- tensor names and shapes ----------------------------------------------------------------


def hf_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF layout of `cfg`: name (without the model prefix) → shape."""
    D, V, F, L = cfg.d_model, cfg.vocab_size, cfg.ff_dim, cfg.n_layers
    HK, GK = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    if cfg.style == "gpt2":
        top = {"wte.weight": (V, D), "wpe.weight": (cfg.max_seq_len, D)}
        top |= {"ln_f.weight": (D,), "ln_f.bias": (D,)}
        layer = {"ln_1.weight": (D,), "ln_1.bias": (D,), "ln_2.weight": (D,), "ln_2.bias": (D,)}
        layer |= {"attn.c_attn.weight": (D, 3 * D), "attn.c_attn.bias": (3 * D,)}
        layer |= {"attn.c_proj.weight": (D, D), "attn.c_proj.bias": (D,)}
        layer |= {"mlp.c_fc.weight": (D, F), "mlp.c_fc.bias": (F,)}
        layer |= {"mlp.c_proj.weight": (F, D), "mlp.c_proj.bias": (D,)}
        block = "h"
    else:
        top = {"embed_tokens.weight": (V, D), "norm.weight": (D,)}
        layer = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,)}
        layer |= {"self_attn.q_proj.weight": (HK, D), "self_attn.o_proj.weight": (D, HK)}
        layer |= {"self_attn.k_proj.weight": (GK, D), "self_attn.v_proj.weight": (GK, D)}
        layer |= {"mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D)}
        layer |= {"mlp.down_proj.weight": (D, F)}
        block = "layers"
    shapes = dict(top)
    for i in range(L):
        shapes |= {f"{block}.{i}.{name}": shape for name, shape in layer.items()}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def _hf_key(cfg: GPTConfig, name: str) -> str:
    """The key under which `transformers` saves tensor `name` of a *ForCausalLM model."""
    return name if name == "lm_head.weight" else _PREFIX[cfg.style] + name


# --- conversion -----------------------------------------------------------------------------


def _layer_to_meshtrain(get: Callable[[str], np.ndarray], cfg: GPTConfig) -> dict:
    """One block's meshtrain params from its HF tensors (`get` takes names inside the block)."""
    D, H, G, K = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    if cfg.style == "gpt2":
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
        affine = lambda name, w: {w: get(name + ".weight"), "bias": get(name + ".bias")}
        return {
            "norm1": affine("ln_1", "scale"),
            "attn": attn,
            "norm2": affine("ln_2", "scale"),
            "mlp": {"up": affine("mlp.c_fc", "kernel"), "down": affine("mlp.c_proj", "kernel")},
        }
    proj = lambda name, n: {"kernel": get(f"self_attn.{name}_proj.weight").T.reshape(D, n, K)}
    linear = lambda name: {"kernel": get(f"mlp.{name}_proj.weight").T}
    return {
        "norm1": {"scale": get("input_layernorm.weight")},
        "attn": {
            "q": proj("q", H),
            "k": proj("k", G),
            "v": proj("v", G),
            "o": {"kernel": get("self_attn.o_proj.weight").T.reshape(H, K, D)},
        },
        "norm2": {"scale": get("post_attention_layernorm.weight")},
        "mlp": {"gate": linear("gate"), "up": linear("up"), "down": linear("down")},
    }


def _layer_to_hf(blk: Mapping, cfg: GPTConfig) -> dict[str, np.ndarray]:
    """One block's HF tensors (names inside the block) from its meshtrain params."""
    D, HK = cfg.d_model, cfg.n_heads * cfg.head_dim
    attn, mlp = blk["attn"], blk["mlp"]
    if cfg.style == "gpt2":
        return {
            "ln_1.weight": blk["norm1"]["scale"],
            "ln_1.bias": blk["norm1"]["bias"],
            "attn.c_attn.weight": np.concatenate(
                [attn[n]["kernel"].reshape(D, D) for n in "qkv"], 1
            ),
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
    return {
        "input_layernorm.weight": blk["norm1"]["scale"],
        **{f"self_attn.{n}_proj.weight": attn[n]["kernel"].reshape(D, -1).T for n in "qkv"},
        "self_attn.o_proj.weight": attn["o"]["kernel"].reshape(HK, D).T,
        "post_attention_layernorm.weight": blk["norm2"]["scale"],
        **{f"mlp.{n}_proj.weight": mlp[n]["kernel"].T for n in ("gate", "up", "down")},
    }


def _to_meshtrain(get: Callable[[str], np.ndarray], cfg: GPTConfig) -> dict:
    """Nested meshtrain params (float32 numpy) from HF tensors fetched by unprefixed name."""
    block = "h" if cfg.style == "gpt2" else "layers"
    layers = [
        _layer_to_meshtrain(lambda name, i=i: get(f"{block}.{i}.{name}"), cfg)
        for i in range(cfg.n_layers)
    ]
    params = {"blocks": jax.tree.map(lambda *xs: np.stack(xs), *layers)}  # [layers, ...]
    if cfg.style == "gpt2":
        params["embed"] = {"embedding": get("wte.weight")}
        params["pos"] = get("wpe.weight")
        params["norm"] = {"scale": get("ln_f.weight"), "bias": get("ln_f.bias")}
    else:
        params["embed"] = {"embedding": get("embed_tokens.weight")}
        params["norm"] = {"scale": get("norm.weight")}
    if not cfg.tie_embeddings:
        params["head"] = {"kernel": get("lm_head.weight").T}
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


def _to_hf(params: Mapping, cfg: GPTConfig) -> dict[str, np.ndarray]:
    """HF tensors (unprefixed name → numpy) from nested meshtrain params (numpy)."""
    block = "h" if cfg.style == "gpt2" else "layers"
    params = _unpad_vocab(params, cfg)
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.n_layers):
        layer = jax.tree.map(lambda x, i=i: x[i], dict(params["blocks"]))
        out |= {f"{block}.{i}.{k}": v for k, v in _layer_to_hf(layer, cfg).items()}
    if cfg.style == "gpt2":
        out |= {"wte.weight": params["embed"]["embedding"], "wpe.weight": params["pos"]}
        out |= {"ln_f.weight": params["norm"]["scale"], "ln_f.bias": params["norm"]["bias"]}
    else:
        out |= {"embed_tokens.weight": params["embed"]["embedding"]}
        out |= {"norm.weight": params["norm"]["scale"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = params["head"]["kernel"].T
    return out


# --- reading and writing files --------------------------------------------------------------


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor key → the safetensors file holding it (one file, or a sharded index)."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.exists():
        with safe_open(single, framework="np") as f:
            return dict.fromkeys(f.keys(), single)
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: path / name for key, name in weight_map.items()}
    raise ValueError(
        f"{path}: no model.safetensors (or model.safetensors.index.json) found; save the model "
        "with save_pretrained(..., safe_serialization=True) so its weights are in safetensors"
    )


def _read_tensors(path: Path, cfg: GPTConfig) -> dict[str, np.ndarray]:
    """Reads, checks and converts to float32 every tensor `cfg` needs (unprefixed names)."""
    files = _tensor_files(path)
    prefix = _PREFIX[cfg.style]
    names = {(k[len(prefix) :] if k.startswith(prefix) else k): k for k in files}
    want = hf_shapes(cfg)
    if cfg.tie_embeddings:
        names.pop("lm_head.weight", None)  # some versions save the tied copy too
    extra = sorted(n for n in names if n not in want and not n.endswith(_BUFFERS))
    missing = sorted(n for n in want if n not in names)
    if missing or extra:
        raise ValueError(
            f"{path}: the tensors do not match config.json "
            f"({cfg.style}, {cfg.n_layers} layers, tie_word_embeddings={cfg.tie_embeddings}): "
            f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}, "
            f"unexpected {extra[:6]}{' ...' if len(extra) > 6 else ''}; "
            "the weights and config.json must come from the same model"
        )
    out = {}
    with contextlib.ExitStack() as stack:
        opened = {f: stack.enter_context(safe_open(f, framework="np")) for f in set(files.values())}
        for name, shape in want.items():  # every shape first, so a bad file fails fast
            key = names[name]
            got = tuple(opened[files[key]].get_slice(key).get_shape())
            if got != shape:
                raise ValueError(
                    f"{path}: tensor {key!r} has shape {got}, but config.json implies "
                    f"{shape}; the weights and config.json must come from the same model"
                )
        for name in want:
            key = names[name]
            x = opened[files[key]].get_tensor(key)
            if not np.issubdtype(x.dtype, np.floating) and x.dtype != jnp.bfloat16:
                raise ValueError(f"{path}: tensor {key!r} has dtype {x.dtype}; expected floats")
            out[name] = np.asarray(x, dtype=np.float32)
    return out


def _abstract_params(cfg: GPTConfig) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """The model's graph, its Param state and other state, as shape structs."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param, ...)


def load_pretrained(
    path: str | Path,
    *,
    config: GPTConfig | None = None,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
) -> tuple[GPTConfig, dict]:
    """Reads a Hugging Face GPT-2 or Llama directory into meshtrain parameters.

    Args:
        path: a directory with ``config.json`` and ``model.safetensors`` (or a sharded index).
        config: meshtrain config to use (e.g. with your ``remat`` and ``dtype``); it must
            describe the same weights as ``config.json``. None derives it from ``config.json``.
        mesh: when given with `rules`, every parameter is placed on it with its `NamedSharding`.
        rules: logical-axis rules (e.g. ``rules_for("fsdp+tp", mesh)``).

    Returns:
        ``(config, params)``: params is the nested dict of float32 arrays that
        ``nnx.to_pure_dict(nnx.state(GPT(config), nnx.Param))`` has, on the default device or
        sharded over `mesh`; the embedding and head have zero rows for the padded vocabulary
        (``config.padded_vocab``).
    """
    path = Path(path)
    if (mesh is None) != (rules is None):
        raise ValueError("load_pretrained: pass mesh and rules together (or neither)")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json; is this a Hugging Face model directory?")
    hf_cfg = config_from_hf(json.loads((path / "config.json").read_text()), where=f"{path}")
    if config is not None:
        differ = same_architecture(config, hf_cfg)
        if differ:
            raise ValueError(
                f"{path}: config= does not match config.json ({'; '.join(differ)}); "
                "pass config=None to use the file's, or fix the fields named"
            )
        hf_cfg = config
    _, param_state, _ = _abstract_params(hf_cfg)
    shardings = None
    if mesh is not None:  # checked before any tensor is read
        shardings = named(state_specs(param_state, rules.params, mesh, warn=False), mesh)
    params = _to_meshtrain(_read_tensors(path, hf_cfg).__getitem__, hf_cfg)
    _check_tree(params, param_state)
    if shardings is None:
        return hf_cfg, jax.tree.map(jnp.asarray, params)
    place = lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
    return hf_cfg, jax.tree.map(place, params, shardings)


def load_model(
    path: str | Path,
    *,
    config: GPTConfig | None = None,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
) -> GPT:
    """`load_pretrained`, then the `GPT` module holding those parameters.

    Args:
        path, config, mesh, rules: as for `load_pretrained`.

    Returns:
        The model (``model.cfg`` is its config).
    """
    cfg, params = load_pretrained(path, config=config, mesh=mesh, rules=rules)
    graphdef, _, rest = _abstract_params(cfg)
    return nnx.merge(graphdef, params, rest)


def _check_tree(params: dict, param_state: nnx.State) -> None:
    """Asserts the converted tree has exactly the model's parameter paths and shapes."""
    want = jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(param_state))
    got = jax.tree.map(lambda x: tuple(x.shape), params)
    if want != got:
        raise AssertionError(f"meshtrain.hf conversion bug: built {got}, model wants {want}")


def _host(x) -> np.ndarray:
    """A parameter as a float32 numpy array on this host (gathered if split across hosts)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x, dtype=np.float32)


def save_pretrained(
    path: str | Path,
    params: nnx.Module | Mapping,
    config: GPTConfig | None = None,
    *,
    dtype: str = "float32",
) -> Path:
    """Writes a meshtrain GPT in the Hugging Face layout (``config.json`` + ``model.safetensors``).

    The result loads with ``transformers``' ``AutoModelForCausalLM.from_pretrained`` as a
    ``GPT2LMHeadModel`` (style ``gpt2``) or ``LlamaForCausalLM`` (style ``llama``), with the
    true ``vocab_size``: the rows of the padded vocabulary (`GPTConfig.vocab_multiple`) are
    not written.

    Args:
        path: output directory; created if needed, and must not already hold a model.
        params: a `GPT` module, or its nested params dict (e.g. ``TrainState.params``), sharded
            or not.
        config: the model's config; taken from the module when `params` is one.
        dtype: storage dtype, ``float32``, ``bfloat16`` or ``float16``.

    Returns:
        The directory written.
    """
    if isinstance(params, nnx.Module):
        config = config or params.cfg
        params = nnx.to_pure_dict(nnx.state(params, nnx.Param))
    if config is None:
        raise ValueError("save_pretrained: pass config= (the GPTConfig of these params)")
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save_pretrained dtype={dtype!r}: choose from {', '.join(SAVE_DTYPES)}")
    hf_cfg = config_to_hf(config, dtype=dtype)  # refuses configs with no HF layout
    _, param_state, _ = _abstract_params(config)
    want = jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(param_state))
    got = jax.tree.map(lambda x: tuple(x.shape), dict(params))
    if want != got:
        raise ValueError(
            f"save_pretrained: params do not fit config ({config.style}, d_model="
            f"{config.d_model}, n_layers={config.n_layers}); pass the config they were built with"
        )
    path = Path(path)
    if (path / "model.safetensors").exists() or (path / "config.json").exists():
        raise ValueError(f"{path} already holds a model; choose a new directory or remove it")
    tensors = _to_hf(jax.tree.map(_host, dict(params)), config)
    shapes = hf_shapes(config)
    assert {k: v.shape for k, v in tensors.items()} == shapes, "meshtrain.hf export bug"
    store = SAVE_DTYPES[dtype]
    tensors = {
        _hf_key(config, k): np.ascontiguousarray(v.astype(store)) for k, v in tensors.items()
    }
    if jax.process_index() == 0:
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    return path


__all__ = [
    "ARCHITECTURES",
    "config_from_hf",
    "config_to_hf",
    "hf_shapes",
    "load_model",
    "load_pretrained",
    "same_architecture",
    "save_pretrained",
]
