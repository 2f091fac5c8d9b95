"""The public entry points: `load_pretrained`, `load_model` and `save_pretrained`.

Generic over architectures: the adapter comes from ``config.json`` (import) or from the
config (export); placing parameters on a mesh and the shape checks are the same for all.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from numpy.typing import DTypeLike

from meshtrain.filevalues import read_json
from meshtrain.hf.config import FIX, config_from_hf, config_to_hf, same_architecture
from meshtrain.hf.convert import shapes, to_hf, to_meshtrain
from meshtrain.hf.files import read_tensors, write_tensors
from meshtrain.hf.registry import adapter_for, adapter_for_hf
from meshtrain.hf.tokenizer import save_checkpoint_tokenizer
from meshtrain.layout import Rules, named, state_specs
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.state import abstract_model

SAVE_DTYPES: dict[str, DTypeLike] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": jnp.bfloat16,
}


def _abstract_params(cfg: GPTConfig) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """The model's graph, its Param state and other state, as shape structs."""
    graphdef, state = abstract_model(lambda: cfg.build(rngs=nnx.Rngs(0)))
    graphdef, params, *rest = nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)
    return graphdef, params, rest[0]


def _tree_shapes(tree) -> dict:
    return jax.tree.map(lambda x: tuple(x.shape), tree)


def load_pretrained(
    path: str | Path,
    *,
    config: GPTConfig | None = None,
    mesh: Mesh | None = None,
    rules: Rules | None = None,
) -> tuple[GPTConfig, dict]:
    """Reads a Hugging Face model directory (any registered architecture) into meshtrain
    parameters.

    Args:
        path: a directory with ``config.json`` and ``model.safetensors`` (or a sharded index).
        config: meshtrain config to use (e.g. with your ``remat`` and ``dtype``); it must
            describe the same weights as ``config.json``. None derives it from ``config.json``.
        mesh: when given with `rules`, every parameter is placed on it with its `NamedSharding`.
        rules: logical-axis rules (e.g. ``rules_for("fsdp+tp", mesh)``).

    Returns:
        ``(config, params)``: params is the nested dict of float32 arrays that
        ``nnx.to_pure_dict(nnx.state(GPT(config), nnx.Param))`` has, on the default device or
        sharded over `mesh`.
    """
    path = Path(path)
    if (mesh is None) != (rules is None):
        raise ValueError("load_pretrained: pass mesh and rules together (or neither)")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json; is this a Hugging Face model directory?")
    where = str(path / "config.json")
    hf = read_json(where, FIX)
    hf_cfg = config_from_hf(hf, where=where)
    adapter = adapter_for_hf(hf)
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
    if mesh is not None and rules is not None:  # checked before any tensor is read
        shardings = named(state_specs(param_state, rules.params, mesh, warn=False), mesh)
    tensors = read_tensors(path, adapter, hf_cfg, (hf.get("architectures") or [None])[0])
    params = to_meshtrain(tensors.__getitem__, adapter, hf_cfg)
    want = _tree_shapes(nnx.to_pure_dict(param_state))
    if _tree_shapes(params) != want:
        raise AssertionError(
            f"meshtrain.hf conversion bug: built {_tree_shapes(params)}, model wants {want}"
        )
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
    architecture: str | None = None,
    tokenizer=None,
) -> Path:
    """Writes a meshtrain GPT in the Hugging Face layout (``config.json`` + ``model.safetensors``,
    and ``tokenizer.json`` when a tokenizer is given).

    The result loads with ``transformers``' ``AutoModelForCausalLM.from_pretrained``, as the
    first registered architecture that can hold the config (see `meshtrain.hf.adapter_for`),
    or as `architecture`.

    Args:
        path: output directory; created if needed, and must not already hold a model.
        params: a `GPT` module, or its nested params dict (e.g. ``TrainState.params``), sharded
            or not.
        config: the model's config; taken from the module when `params` is one.
        dtype: storage dtype, ``float32``, ``bfloat16`` or ``float16``.
        architecture: class name or ``model_type`` to write (e.g. ``"MistralForCausalLM"``);
            None chooses from the config.
        tokenizer: a `meshtrain.data.Tokenizer` to save beside the weights (as
            ``tokenizer.json``, which ``transformers.AutoTokenizer`` loads), e.g. the one
            `load_checkpoint_tokenizer` read from the checkpoint a fine-tune started from. Its
            vocabulary must fit the model's.

    Returns:
        The directory written.
    """
    if isinstance(params, nnx.Module):
        config = config or getattr(params, "cfg", None)
        params = nnx.to_pure_dict(nnx.state(params, nnx.Param))
    if config is None:
        raise ValueError("save_pretrained: pass config= (the GPTConfig of these params)")
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save_pretrained dtype={dtype!r}: choose from {', '.join(SAVE_DTYPES)}")
    adapter = adapter_for(config, architecture)  # refuses configs with no HF layout
    hf_cfg = config_to_hf(config, dtype=dtype, architecture=adapter.model_type)
    _, param_state, _ = _abstract_params(config)
    if _tree_shapes(nnx.to_pure_dict(param_state)) != _tree_shapes(dict(params)):
        raise ValueError(
            f"save_pretrained: params do not fit config ({config.style}, d_model="
            f"{config.d_model}, n_layers={config.n_layers}); pass the config they were built with"
        )
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"save_pretrained: tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens, "
            f"more than the model's vocab_size={config.vocab_size}; save the tokenizer the "
            "model was trained with"
        )
    path = Path(path)
    if (path / "model.safetensors").exists() or (path / "config.json").exists():
        raise ValueError(f"{path} already holds a model; choose a new directory or remove it")
    tensors = to_hf(jax.tree.map(_host, dict(params)), adapter, config)
    assert {k: v.shape for k, v in tensors.items()} == shapes(adapter, config), "export bug"
    store = SAVE_DTYPES[dtype]
    tensors = {adapter.key(k): np.ascontiguousarray(v.astype(store)) for k, v in tensors.items()}
    if jax.process_index() == 0:
        write_tensors(path, tensors, hf_cfg)
        if tokenizer is not None:
            save_checkpoint_tokenizer(path, tokenizer)
    return path
