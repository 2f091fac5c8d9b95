"""What the MoE adapters (`meshtrain.hf.mixtral`, `meshtrain.hf.qwen3_moe`) share: reading a
directory's ``config.json`` into an `MoEConfig`, the training-objective override, filling an
`MoE` from per-layer tensors (dense blocks and MoE blocks grouped as `MoEConfig.moe_every`
says), and writing the tensors and ``config.json`` back."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from meshtrain import filevalues
from meshtrain.filevalues import Key, read_json
from meshtrain.hf import llama
from meshtrain.hf.adapter import refuse
from meshtrain.hf.config import FIX
from meshtrain.hf.files import open_tensors, tensor_files
from meshtrain.models.moe import MoE
from meshtrain.models.moe_config import MoEConfig
from meshtrain.models.moe_routing import MIXTRAL
from meshtrain.problem import RunCheckError

# The MoEConfig fields that set the training objective, which a loader lets a caller change.
OBJECTIVE = ("router_losses", "aux_loss_coef", "z_loss_coef")
LayerFn = Callable[[Callable[[str], np.ndarray], MoEConfig], dict]


def read_config(
    path: Path, architecture: str, keys: Mapping[str, Key], from_hf: Callable
) -> MoEConfig:
    """The `MoEConfig` of ``path/config.json`` (an `architecture` file), its values checked."""
    where = str(path / "config.json")
    hf = read_json(where, FIX)
    if architecture not in (hf.get("architectures") or [architecture]):
        raise ValueError(f"{path}: architectures={hf.get('architectures')}; not {architecture}")
    values = filevalues.checked(hf, keys, where, FIX)
    try:
        return from_hf(values)
    except RunCheckError as e:
        raise filevalues.relabel(e, values, keys, where, FIX, whole=True) from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def backbone_fields(hf: Mapping) -> dict:
    """The `MoEConfig` fields a Llama-layout MoE ``config.json`` gives as a dense Llama's (sizes,
    heads, norms, default RoPE), and transformers' training objective: the pooled router loss
    weighted ``router_aux_loss_coef`` when ``output_router_logits`` (else 0), no z-loss, with
    dropless dispatch."""
    fields = llama.fields_from_hf(hf)
    if fields.get("rope_scaling", "none") != "none":
        raise refuse("rope_parameters", fields["rope_scaling"], "MoEConfig has default RoPE only")
    aux = float(hf.get("router_aux_loss_coef", 0.001)) if hf.get("output_router_logits") else 0.0
    names = ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "n_kv_heads")
    names += ("head_dim", "d_ff", "rope_theta", "norm_eps", "tie_embeddings")
    return {k: fields[k] for k in names} | dict(
        router_losses="mixtral", aux_loss_coef=aux, z_loss_coef=0.0, dispatch="dropless"
    )


def require_softmax_router(cfg: MoEConfig, architecture: str) -> None:
    """Raises unless `cfg` routes as `architecture` (Mixtral, Qwen3-MoE) does: a softmax over
    every expert, unscaled, without a balancing bias."""
    if cfg.choice != MIXTRAL or cfg.bias_update_rate:
        raise ValueError(
            f"{architecture}'s router is a softmax over every expert, unscaled and without a "
            f"balancing bias; this config has router_scores={cfg.router_scores!r}, "
            f"expert_groups={cfg.expert_groups}, routed_scale={cfg.routed_scale}, "
            f"bias_update_rate={cfg.bias_update_rate}"
        )


def with_objective(cfg: MoEConfig, objective: Mapping | None, loader: str, dispatch: str):
    """`cfg` with `dispatch` and the caller's training-objective fields (`OBJECTIVE`)."""
    objective = dict(objective or {})
    unknown = sorted(set(objective) - set(OBJECTIVE))
    if unknown:
        raise ValueError(
            f"{loader} objective={objective!r}: {', '.join(unknown)} is not a field of the "
            f"training objective; set {', '.join(OBJECTIVE)}"
        )
    return dataclasses.replace(cfg, dispatch=dispatch, **objective)


def load(path: Path, cfg: MoEConfig, dense_layer: LayerFn, moe_layer: LayerFn) -> MoE:
    """An `MoE` of `cfg` filled from the tensors in `path`: layer i by `moe_layer` when it is an
    MoE block (every ``moe_every``-th), else by `dense_layer` (each given a getter of the
    layer's tensors by name)."""
    files = tensor_files(path)

    def get(name: str) -> np.ndarray:
        key = name if name == "lm_head.weight" else "model." + name
        if key not in files:
            raise ValueError(f"{path}: tensor {key!r} is missing")
        with open_tensors(files[key]) as f:
            return np.asarray(f.get_tensor(key), np.float32)

    def layer(i: int) -> dict:
        fn = moe_layer if (i + 1) % cfg.moe_every == 0 else dense_layer
        return fn(lambda n: get(f"layers.{i}.{n}"), cfg)

    m, stack = cfg.moe_every, lambda *xs: np.stack(xs)
    groups = {"moe_block": jax.tree.map(stack, *[layer(i) for i in range(m - 1, cfg.n_layers, m)])}
    if m > 1:
        groups["dense"] = {
            j: jax.tree.map(stack, *[layer(i) for i in range(j, cfg.n_layers, m)])
            for j in range(m - 1)
        }
    extra = cfg.backbone.padded_vocab - cfg.vocab_size
    params = {
        "embed": {"embedding": np.pad(get("embed_tokens.weight"), ((0, extra), (0, 0)))},
        "groups": groups,
        "norm": {"scale": get("norm.weight")},
    }
    if not cfg.tie_embeddings:
        params["head"] = {"kernel": np.pad(get("lm_head.weight").T, ((0, 0), (0, extra)))}
    model = nnx.eval_shape(lambda: cfg.build(rngs=nnx.Rngs(params=0)))
    state = nnx.state(model, nnx.Param)
    want = jax.tree.map(np.shape, nnx.to_pure_dict(state))
    got = jax.tree.map(np.shape, params)
    if want != got:
        raise ValueError(f"{path}: tensor shapes do not match the config: {got} vs {want}")
    nnx.replace_by_pure_dict(state, jax.tree.map(jax.numpy.asarray, params))
    nnx.update(model, state)
    if jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param))):
        raise ValueError(f"{path}: the model has state besides its parameters")
    return model


def save(model: MoE, path: Path, hf: Mapping, dense_layer, moe_layer) -> Path:
    """Writes `model` to `path` as ``config.json`` (`hf`) and float32 ``model.safetensors``, layer
    i's tensors by ``moe_layer(params, cfg)`` or ``dense_layer(params, cfg)`` (one layer's)."""
    cfg = model.cfg
    params = jax.tree.map(
        lambda x: np.asarray(jax.device_get(x), np.float32),
        nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    )
    V, m, groups = cfg.vocab_size, cfg.moe_every, params["groups"]
    tensors = {
        "model.embed_tokens.weight": params["embed"]["embedding"][:V],
        "model.norm.weight": params["norm"]["scale"],
    }
    for i in range(cfg.n_layers):
        g, j = divmod(i, m)
        if j == m - 1:
            layer = moe_layer(jax.tree.map(lambda x, g=g: x[g], groups["moe_block"]), cfg)
        else:
            layer = dense_layer(jax.tree.map(lambda x, g=g: x[g], groups["dense"][j]), cfg)
        tensors |= {f"model.layers.{i}.{name}": t for name, t in layer.items()}
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = params["head"]["kernel"][:, :V].T
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()},
        path / "model.safetensors",
        metadata={"format": "pt"},
    )
    return path
