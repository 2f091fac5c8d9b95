"""A residual MLP classifier with logical axis names: features [B, F] → class logits [B, C]."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain import validate
from meshtrain.layout import constrain
from meshtrain.models import layers
from meshtrain.models.base import DTYPES, DataSpec
from meshtrain.precision import fp8
from meshtrain.problem import Problem


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPConfig(validate.Checked):
    """Shape of the classifier.

    Args:
        num_features: input features per example.
        num_classes: output classes.
        d_model: width of the residual stream.
        d_hidden: hidden width of each residual MLP block.
        n_layers: residual MLP blocks.
        dtype: compute dtype, ``float32``, ``bfloat16`` or ``float16``. Parameters stay
            float32.
        fp8: every dense layer runs as an fp8 matmul (`meshtrain.precision.fp8`).
    """

    num_features: int = 64
    num_classes: int = 10
    d_model: int = 128
    d_hidden: int = 256
    n_layers: int = 2
    dtype: str = "float32"
    fp8: bool = False

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        problems = [
            p
            for name in ("num_features", "num_classes", "d_model", "d_hidden", "n_layers")
            for p in validate.positive(
                f"mlp.{name}", getattr(self, name), example=getattr(type(self), name)
            )
        ]
        return problems + validate.one_of("mlp.dtype", self.dtype, DTYPES, example="bfloat16")

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per example."""
        D, F = self.d_model, self.d_hidden
        return self.num_features * D + self.n_layers * 2 * D * F + D * self.num_classes

    def flops_per_token(self, seq_len: int = 1) -> float:
        """Training FLOPs per example: 6·N (2 forward, 4 backward) for N matmul parameters."""
        return 6 * self.matmul_params()

    # --- the model interface (meshtrain.models.base.ModelConfig) ---------------------------

    def build(self, *, rngs: nnx.Rngs) -> MLPClassifier:
        """The classifier, unsharded."""
        return MLPClassifier(self, rngs=rngs)

    def check(self, data: DataSpec) -> list[Problem]:
        """Classification data with this model's feature and class counts."""
        if data.kind != "classify":
            return [
                Problem(
                    "model",
                    "mlp",
                    f"the MLP classifier needs classification data (features [N, F], class ids "
                    f"[N]), but the data is {data.kind!r}; use --data.source arrays with such "
                    "an .npz, or --model gpt",
                )
            ]
        problems = []
        if data.num_features != self.num_features:
            problems.append(
                Problem(
                    "mlp.num_features",
                    self.num_features,
                    f"the data has {data.num_features} features per example; set "
                    f"--mlp.num-features {data.num_features}",
                )
            )
        if data.vocab_size > self.num_classes:
            problems.append(
                Problem(
                    "mlp.num_classes",
                    self.num_classes,
                    f"the data has {data.vocab_size} classes; set --mlp.num-classes "
                    f"{data.vocab_size} or more",
                )
            )
        return problems

    def describe(self) -> str:
        """E.g. ``mlp · 64 features → 10 classes · d_model=128 · 2 blocks``."""
        return (
            f"mlp · {self.num_features} features → {self.num_classes} classes · "
            f"d_model={self.d_model} · {self.n_layers} blocks"
        )


class MLPClassifier(nnx.Module):
    """Features [B, F] → class logits [B, C] (float32), through residual GELU blocks."""

    def __init__(self, cfg: MLPConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = DTYPES[cfg.dtype]
        zeros = nnx.initializers.zeros

        def dense(n_in, n_out, names, std=0.02):
            return nnx.Linear(
                n_in,
                n_out,
                dtype=dtype,
                dot_general=fp8.dot_general if cfg.fp8 else jax.lax.dot_general,
                rngs=rngs,
                kernel_init=layers.init(names, std),
                bias_init=layers.const_init(zeros, names[1:]),
            )

        self.inp = dense(cfg.num_features, cfg.d_model, ("features", "embed"), 0.1)
        self.ups = nnx.List(
            [dense(cfg.d_model, cfg.d_hidden, ("embed", "mlp")) for _ in range(cfg.n_layers)]
        )
        self.downs = nnx.List(
            [dense(cfg.d_hidden, cfg.d_model, ("mlp", "embed")) for _ in range(cfg.n_layers)]
        )
        self.out = dense(cfg.d_model, cfg.num_classes, ("embed", "vocab"))

    def __call__(self, x_BF: jax.Array) -> jax.Array:
        x_BD = constrain(self.inp(x_BF), ("batch", "embed"))
        for up, down in zip(self.ups, self.downs, strict=True):
            h_BH = constrain(jax.nn.gelu(up(x_BD)), ("batch", "mlp"))
            x_BD = constrain(x_BD + down(h_BH), ("batch", "embed"))
        return constrain(self.out(x_BD).astype(jnp.float32), ("batch", "vocab"))
