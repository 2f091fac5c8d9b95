"""The model registry: every family the CLI, the run check and the docs know, by name.

Adding a family is one new file (its config implementing `ModelConfig`, and its module) plus
one `register` line in `meshtrain/models/__init__.py`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from flax import nnx


@dataclasses.dataclass(frozen=True)
class Family:
    """A registered model family.

    Attributes:
        name: the ``--model`` value, and the prefix of its config flags (``--gpt.d-model``).
        config: the config dataclass (implements `meshtrain.models.base.ModelConfig`).
        default: the config the CLI starts from.
        summary: one line for ``--help``.
        hf: the module holding the family's Hugging Face adapters (imported only when used),
            or None when the family has no Hugging Face layout.
    """

    name: str
    config: type
    default: Any
    summary: str
    hf: str | None = None

    def hf_adapters(self):
        """The family's Hugging Face adapter registry (``architecture -> model_type``)."""
        if self.hf is None:
            return {}
        return importlib.import_module(self.hf).ARCHITECTURES


_FAMILIES: dict[str, Family] = {}


def register(
    name: str, config: type, *, default=None, summary: str = "", hf: str | None = None
) -> Family:
    """Adds a model family to the registry.

    Args:
        name: its ``--model`` name (a Python identifier).
        config: its config dataclass.
        default: the config the CLI starts from; None means ``config()``.
        summary: one line for ``--help``.
        hf: the module holding its Hugging Face adapters (see `meshtrain.hf`), if any.

    Returns:
        The `Family`.
    """
    if not name.isidentifier() or name in _FAMILIES:
        raise ValueError(f"model family {name!r}: the name must be a new Python identifier")
    family = Family(name, config, config() if default is None else default, summary, hf)
    _FAMILIES[name] = family
    return family


def families() -> dict[str, Family]:
    """Every registered family, by name, in registration order."""
    return dict(_FAMILIES)


def family_of(config) -> Family | None:
    """The family whose config class `config` is an instance of, or None."""
    for family in _FAMILIES.values():
        if isinstance(config, family.config):
            return family
    return None


def build_model(config, *, seed: int = 0) -> nnx.Module:
    """Instantiates the model that `config` describes (unsharded; see `create_sharded_model`).

    Args:
        config: a model config (`GPTConfig`, `MLPConfig`, or any `ModelConfig`).
        seed: seed of the parameter initialisers.

    Returns:
        The NNX module.
    """
    if not callable(getattr(config, "build", None)):
        raise ValueError(
            f"model config {type(config).__name__}: unknown model; known: "
            f"{', '.join(_FAMILIES)} (a model config has a build method)"
        )
    return config.build(rngs=nnx.Rngs(params=seed))
