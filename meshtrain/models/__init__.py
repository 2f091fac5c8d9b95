"""Models annotated with logical axis names, and a registry to build them by name."""

from __future__ import annotations

from flax import nnx

from meshtrain.models.gpt import GPT, GPTConfig, sample
from meshtrain.models.mlp import MLPClassifier, MLPConfig
from meshtrain.models.remat import POLICIES as REMAT_POLICIES

MODELS = {"gpt": (GPTConfig, GPT), "mlp": (MLPConfig, MLPClassifier)}


def build_model(config: GPTConfig | MLPConfig, *, seed: int = 0) -> nnx.Module:
    """Instantiates the model that `config` describes (unsharded; see `create_sharded_model`).

    Args:
        config: a `GPTConfig` or `MLPConfig`.
        seed: seed of the parameter initialisers.

    Returns:
        The NNX module.
    """
    for _, (config_cls, model_cls) in MODELS.items():
        if isinstance(config, config_cls):
            return model_cls(config, rngs=nnx.Rngs(params=seed))
    raise ValueError(f"model config {type(config).__name__}: unknown model; known: {list(MODELS)}")


__all__ = [
    "GPT",
    "GPTConfig",
    "MLPClassifier",
    "MLPConfig",
    "MODELS",
    "REMAT_POLICIES",
    "build_model",
    "sample",
]
