"""The adapter type: what `meshtrain.hf` must know about one Hugging Face architecture.

An architecture is two things:

- a `Layout`: the names and shapes of its tensors and how one layer (and the top-level tensors)
  convert to and from meshtrain's parameter tree. Architectures that store their weights the
  same way share one layout (several use Llama's).
- an `Adapter`: the layout plus its ``config.json``: the class names and ``model_type`` it is
  read under, the conversion of ``config.json`` to and from a `GPTConfig`, and which configs it
  can hold on export.

The generic code (`meshtrain.hf.convert`, `meshtrain.hf.pretrained`) stacks the layers, adds
the ``lm_head`` of an untied head, and reads and writes the files; it never asks which
architecture it has. The helpers at the end (`need`, `expect`, `refuse`) are for writing an
adapter's ``config_from_hf``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from meshtrain.filevalues import Key
from meshtrain.models.gpt import GPTConfig
from meshtrain.problem import Problem

Shape = tuple[int, ...]
# A tensor by its name inside the scope being converted (one layer, or the top level).
Getter = Callable[[str], np.ndarray]
HEAD = "lm_head.weight"  # the untied output head of every *ForCausalLM: [vocab, d_model]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """Tensor names, shapes and conversions of one family of checkpoints.

    Names are those inside the base model (``embed_tokens.weight``, ``self_attn.q_proj.weight``
    inside a layer); the generic code adds ``prefix`` and ``{block}.{i}.``. meshtrain's side is
    the nested dict of ``nnx.to_pure_dict(nnx.state(GPT(cfg), nnx.Param))`` with numpy leaves,
    one layer at a time (no leading ``layers`` dimension).

    Attributes:
        style: the `GPTConfig.style` whose modules these tensors fill.
        prefix: key prefix of the base model's tensors in ``*ForCausalLM`` files (``"model."``).
        block: name of the list of layers (``"layers"`` → ``layers.3.mlp.up_proj.weight``).
        top_shapes: ``cfg →`` {name: shape} of the tensors outside the layers, head excluded.
        layer_shapes: ``cfg →`` {name: shape} of one layer's tensors.
        layer_to_meshtrain: ``(get, cfg) →`` one layer's meshtrain params.
        layer_to_hf: ``(params of one layer, cfg) →`` {name: tensor}.
        top_to_meshtrain: ``(get, cfg) →`` the top-level meshtrain params but ``blocks``/``head``.
        top_to_hf: ``(params, cfg) →`` {name: tensor} of the top-level tensors, head excluded.
    """

    style: str
    prefix: str
    block: str
    top_shapes: Callable[[GPTConfig], dict[str, Shape]]
    layer_shapes: Callable[[GPTConfig], dict[str, Shape]]
    layer_to_meshtrain: Callable[[Getter, GPTConfig], dict]
    layer_to_hf: Callable[[Mapping, GPTConfig], dict[str, np.ndarray]]
    top_to_meshtrain: Callable[[Getter, GPTConfig], dict]
    top_to_hf: Callable[[Mapping, GPTConfig], dict[str, np.ndarray]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adapter:
    """One Hugging Face architecture: its names, its ``config.json`` and its `Layout`.

    Attributes:
        model_type: ``config.json``'s ``model_type`` (``"mistral"``); also the registry key.
        architectures: class names read as this architecture. The first, written on export,
            is the model with its language-model head; the others are base models without one
            (``("MistralForCausalLM", "MistralModel")``).
        layout: how the tensors are named and converted.
        config_from_hf: ``config.json`` dict → `GPTConfig`; raises ValueError naming the field
            it cannot reproduce (the caller adds the file name).
        config_to_hf: `GPTConfig` → this architecture's own ``config.json`` fields. The generic
            code adds ``architectures``, ``model_type``, ``vocab_size``, ``tie_word_embeddings``,
            ``dtype`` and the token ids.
        export_problems: `GPTConfig` (of the layout's style) → why this architecture cannot
            hold the config, as `Problem` lines naming the field; empty when it can.
        keys: the ``config.json`` keys `config_from_hf` reads → what each must hold (a
            `meshtrain.filevalues.Key`, whose ``field`` is the `GPTConfig` setting it fills);
            checked before `config_from_hf` runs, so a wrong value names the file and key.
    """

    model_type: str
    architectures: tuple[str, ...]
    layout: Layout
    config_from_hf: Callable[[Mapping], GPTConfig]
    config_to_hf: Callable[[GPTConfig], dict]
    export_problems: Callable[[GPTConfig], list[Problem]]
    keys: Mapping[str, Key] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        """The class name written on export (``"MistralForCausalLM"``)."""
        return self.architectures[0]

    def key(self, name: str) -> str:
        """The key under which ``transformers`` saves tensor `name` of the ``*ForCausalLM``."""
        return name if name == HEAD else self.layout.prefix + name


# --- helpers for config_from_hf --------------------------------------------------------------


def need(hf: Mapping, key: str):
    """``hf[key]``, or a ValueError naming the missing field."""
    if hf.get(key) is None:
        raise ValueError(f"field {key!r} is missing; add it (see transformers' config)")
    return hf[key]


def expect(hf: Mapping, key: str, want, default=None) -> None:
    """Refuses a field whose value meshtrain's model cannot reproduce (`want`: a value or a
    tuple of accepted values; `default`: the value transformers assumes when it is absent)."""
    got = hf.get(key, default)
    ok = got in want if isinstance(want, tuple) else got == want
    if not ok:
        raise ValueError(f"{key}={got!r} is not supported; meshtrain's model needs {key}={want!r}")


def refuse(key: str, got, why: str) -> ValueError:
    """The error for a field meshtrain does not implement: ``key=value is not supported: why``."""
    return ValueError(f"{key}={got!r} is not supported: {why}")
