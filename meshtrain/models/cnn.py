"""Convolutional classifiers (LeNet/VGG-style and ResNet-style) with logical axis names.

Images arrive as flattened rows [B, H·W·C] (`meshtrain.data.images`) and are folded back to
[B, H, W, C]. Shapes: B batch, H/W image height/width, C channels, F flattened features,
K classes. See `CNNConfig` for the architectures and how channels are named.

Batch norm computes its statistics over the whole global batch: under the `Trainer`'s jit the
batch is split over the batch axes and XLA all-reduces the per-channel sums, so every shard
is normalised with the statistics of the unsplit batch (synchronised batch norm), with no code
of its own for it. Running averages (``nnx.BatchStat``) are used after ``.eval()``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain import kernels
from meshtrain.layout import constrain
from meshtrain.models import layers
from meshtrain.models.base import DTYPES
from meshtrain.models.cnn_config import CNNConfig

_F32 = jnp.float32


def _he(names):
    """He-normal initialiser (ReLU networks) carrying logical `names`."""
    return nnx.with_partitioning(nnx.initializers.he_normal(), names, eager_sharding=False)


def batch_statistics(x_BHWC: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-channel mean and (biased) variance over batch, height and width, in float32.

    Args:
        x_BHWC: activations; under a sharded jit, a global array (the statistics are then
            the whole batch's, XLA reducing across the shards).

    Returns:
        (mean [C], variance [C]).
    """
    x = x_BHWC.astype(_F32)
    mean_C = x.mean(axis=(0, 1, 2))
    var_C = jnp.square(x - mean_C).mean(axis=(0, 1, 2))
    return mean_C, var_C


class BatchNorm(nnx.Module):
    """Batch norm over [B, H, W, C] whose scale and bias carry the channels' logical name."""

    def __init__(self, width: int, name: str, *, rngs: nnx.Rngs, momentum=0.9, eps=1e-5):
        key = rngs.params()
        self.scale = nnx.Param(layers.const_init(nnx.initializers.ones, (name,))(key, (width,)))
        self.bias = nnx.Param(layers.const_init(nnx.initializers.zeros, (name,))(key, (width,)))
        self.mean = nnx.BatchStat(jnp.zeros((width,), _F32))
        self.var = nnx.BatchStat(jnp.ones((width,), _F32))
        self.momentum, self.eps, self.use_running_average = momentum, eps, False

    def __call__(self, x_BHWC: jax.Array) -> jax.Array:
        if self.use_running_average:
            mean_C, var_C = self.mean[...], self.var[...]
        else:
            mean_C, var_C = batch_statistics(x_BHWC)
            m = self.momentum
            self.mean[...] = m * self.mean[...] + (1 - m) * mean_C
            self.var[...] = m * self.var[...] + (1 - m) * var_C
        y = (x_BHWC.astype(_F32) - mean_C) * jax.lax.rsqrt(var_C + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(x_BHWC.dtype)


def _norm(cfg: CNNConfig, width: int, name: str, rngs: nnx.Rngs):
    """The configured normalisation of a [B, H, W, width] activation (None for ``none``)."""
    if cfg.norm == "batch":
        return BatchNorm(width, name, rngs=rngs)
    if cfg.norm == "group":
        return nnx.GroupNorm(
            width,
            num_groups=cfg.groups,
            scale_init=layers.const_init(nnx.initializers.ones, (name,)),
            bias_init=layers.const_init(nnx.initializers.zeros, (name,)),
            rngs=rngs,
        )
    return None


class ConvNorm(nnx.Module):
    """A k×k convolution (kernel [k, k, in, out] named ``(None, None, in, out)``), then the
    norm; the output is constrained to ``("batch", None, None, out)``."""

    def __init__(self, cfg, c_in, c_out, names, *, k=3, stride=1, rngs):
        self.out_name = names[1]
        has_norm = cfg.norm != "none"
        self.conv = nnx.Conv(
            c_in,
            c_out,
            kernel_size=(k, k),
            strides=(stride, stride),
            padding="SAME",
            use_bias=not has_norm,
            dtype=DTYPES[cfg.dtype],
            kernel_init=_he((None, None, *names)),
            bias_init=layers.const_init(nnx.initializers.zeros, (names[1],)),
            rngs=rngs,
        )
        self.norm = _norm(cfg, c_out, names[1], rngs)

    def __call__(self, x_BHWC: jax.Array) -> jax.Array:
        y = constrain(self.conv(x_BHWC), ("batch", None, None, self.out_name))
        return y if self.norm is None else self.norm(y)


class ResidualBlock(nnx.Module):
    """Two 3×3 ConvNorms, channel-parallel as a pair (``embed → mlp → embed``), plus the
    input, through a strided 1×1 projection when the shape changes."""

    def __init__(self, cfg, c_in, c_out, stride, *, rngs):
        self.cfg = cfg
        self.first = ConvNorm(cfg, c_in, c_out, ("embed", "mlp"), stride=stride, rngs=rngs)
        self.second = ConvNorm(cfg, c_out, c_out, ("mlp", "embed"), rngs=rngs)
        project = stride != 1 or c_in != c_out
        names = ("features", "embed")
        self.skip = (
            ConvNorm(cfg, c_in, c_out, names, k=1, stride=stride, rngs=rngs) if project else None
        )

    def __call__(self, x_BHWC: jax.Array) -> jax.Array:
        act = self.cfg.act_impl
        h = relu(self.first(x_BHWC), act, "mlp")
        skip = x_BHWC if self.skip is None else self.skip(x_BHWC)
        return relu(self.second(h) + skip, act, "embed")


def relu(x_BHWC: jax.Array, impl: str, channels: str) -> jax.Array:
    """ReLU through `meshtrain.kernels.relu` (jnp or the Pallas kernels), per shard."""
    return kernels.relu(x_BHWC, impl=impl, names=("batch", None, None, channels))


class CNN(nnx.Module):
    """Flattened images [B, H·W·C] → class logits [B, K] (float32)."""

    def __init__(self, cfg: CNNConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        widths, depth = cfg.stage_widths, cfg.stage_depth
        dtype = DTYPES[cfg.dtype]
        zeros = nnx.initializers.zeros
        if cfg.arch == "vgg":
            convs, c_in, name_in = [], cfg.in_channels, "features"
            for width in widths:
                for _ in range(depth):
                    name_out = "mlp" if len(convs) % 2 == 0 else "embed"
                    convs.append(ConvNorm(cfg, c_in, width, (name_in, name_out), rngs=rngs))
                    c_in, name_in = width, name_out
            self.convs = nnx.List(convs)
            dense_names = [("embed", "mlp"), ("mlp", None)]
        else:
            self.stem = ConvNorm(cfg, cfg.in_channels, widths[0], ("features", "embed"), rngs=rngs)
            blocks, c_in = [], widths[0]
            for s, width in enumerate(widths):
                for d in range(depth):
                    stride = 2 if d == 0 and s > 0 else 1
                    blocks.append(ResidualBlock(cfg, c_in, width, stride, rngs=rngs))
                    c_in = width
            self.blocks = nnx.List(blocks)
            dense_names = [("embed", None)]
        self.dense = nnx.List(
            [
                nnx.Linear(
                    n_in,
                    n_out,
                    dtype=dtype,
                    kernel_init=layers.init(names, (2.0 / n_in) ** 0.5),
                    bias_init=layers.const_init(zeros, names[1:]),
                    rngs=rngs,
                )
                for (n_in, n_out), names in zip(cfg.dense(), dense_names, strict=True)
            ]
        )

    def __call__(self, x_BF: jax.Array) -> jax.Array:
        cfg = self.cfg
        size = cfg.image_size
        x = x_BF.reshape(-1, size, size, cfg.in_channels).astype(DTYPES[cfg.dtype])
        x = constrain(x, ("batch", None, None, None))
        if cfg.arch == "vgg":
            for i, conv in enumerate(self.convs):
                x = relu(conv(x), cfg.act_impl, conv.out_name)
                if (i + 1) % cfg.stage_depth == 0:
                    x = nnx.max_pool(x, (2, 2), strides=(2, 2), padding="VALID")
            h = constrain(x.reshape(x.shape[0], -1), ("batch", None))
            h = kernels.relu(self.dense[0](h), impl=cfg.act_impl, names=("batch", "mlp"))
            logits = self.dense[1](constrain(h, ("batch", "mlp")))
        else:
            x = relu(self.stem(x), cfg.act_impl, "embed")
            for block in self.blocks:
                x = block(x)
            pooled = constrain(x.astype(_F32).mean(axis=(1, 2)), ("batch", None))
            logits = self.dense[0](pooled.astype(x.dtype))
        return constrain(logits.astype(_F32), ("batch", None))
