"""Reading and writing the tensors of a Hugging Face directory with the safetensors numpy API:
one ``model.safetensors`` or a sharded ``model.safetensors.index.json``; names and shapes are
checked against the config before any tensor is read."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from meshtrain.filevalues import read_json
from meshtrain.hf.adapter import HEAD, Adapter
from meshtrain.hf.convert import shapes
from meshtrain.models.gpt import GPTConfig

# Buffers some older transformers versions saved beside the weights; they hold no parameters.
_BUFFERS = ("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq")


@contextlib.contextmanager
def open_tensors(file: Path):
    """`safe_open` of one safetensors file; a truncated or corrupt file (or a tensor that
    cannot be read from it) is one ValueError line naming the file."""
    try:
        with safe_open(file, framework="np") as f:
            yield f
    except SafetensorError as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"{file}: truncated or corrupt safetensors file ({reason}); download or save the "
            "model again"
        ) from None
    except FileNotFoundError:
        raise ValueError(
            f"{file}: missing (the model's safetensors index names it); download the model "
            "again, with every shard"
        ) from None


def tensor_files(path: Path) -> dict[str, Path]:
    """Tensor key → the safetensors file holding it (one file, or a sharded index)."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.exists():
        with open_tensors(single) as f:
            return dict.fromkeys(f.keys(), single)
    if index.exists():
        fix = "download the model again, with its index"
        weight_map = read_json(index, fix).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ValueError(
                f"{index}: weight_map must be a JSON object of tensor name → file name; {fix}"
            )
        return {key: path / name for key, name in weight_map.items()}
    raise ValueError(
        f"{path}: no model.safetensors (or model.safetensors.index.json) found; save the model "
        "with save_pretrained(..., safe_serialization=True) so its weights are in safetensors"
    )


def _base_model_error(path: Path, adapter: Adapter, saved_as: str) -> ValueError:
    return ValueError(
        f"{path}: {saved_as} is a base model without a language-model head: its files have no "
        f"{HEAD!r} and config.json has tie_word_embeddings=false, while meshtrain's GPT predicts "
        f"tokens. Load the checkpoint of the model with its head ({adapter.name}) instead"
    )


def read_tensors(
    path: Path, adapter: Adapter, cfg: GPTConfig, saved_as: str | None = None
) -> dict[str, np.ndarray]:
    """Reads, checks and converts to float32 every tensor `cfg` needs (names without prefix).

    Args:
        path: the model directory.
        adapter: the architecture of its config.json.
        cfg: the config the tensors must fit.
        saved_as: the class config.json names (its first ``architectures`` entry), if any.
    """
    files = tensor_files(path)
    prefix = adapter.layout.prefix
    names = {k.removeprefix(prefix): k for k in files}
    want = shapes(adapter, cfg)
    if cfg.tie_embeddings:
        names.pop(HEAD, None)  # some versions save the tied copy too
    extra = sorted(n for n in names if n not in want and not n.endswith(_BUFFERS))
    missing = sorted(n for n in want if n not in names)
    if missing == [HEAD] and not extra and saved_as in adapter.architectures[1:]:
        raise _base_model_error(path, adapter, saved_as)
    if missing or extra:
        raise ValueError(
            f"{path}: the tensors do not match config.json "
            f"({adapter.model_type}, {cfg.n_layers} layers, tie_word_embeddings="
            f"{cfg.tie_embeddings}): missing {missing[:6]}{' ...' if len(missing) > 6 else ''}, "
            f"unexpected {extra[:6]}{' ...' if len(extra) > 6 else ''}; "
            "the weights and config.json must come from the same model"
        )
    out = {}
    with contextlib.ExitStack() as stack:
        opened = {f: stack.enter_context(open_tensors(f)) for f in set(files.values())}
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


def write_tensors(path: Path, tensors: Mapping[str, np.ndarray], hf_config: Mapping) -> None:
    """Writes ``model.safetensors`` (keys as given) and ``config.json`` into `path`."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
