"""Building blocks shared by the models: annotated initialisers, norms, RoPE, attention math.

Shape suffixes: B batch, T query positions, S key positions, D model width, H query heads,
G key/value heads, R = H // G query heads per group, K head width, F feed-forward width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.kernels import reference


def init(names: tuple[str | None, ...], std: float = 0.02):
    """A normal(std) initialiser whose variable carries logical axis `names`."""
    return nnx.with_partitioning(nnx.initializers.normal(std), names, eager_sharding=False)


def init_rows(names: tuple[str | None, ...], valid: int, *, axis: int, std: float = 0.02):
    """`init`, but zero past the first `valid` entries along `axis`: a padded vocabulary's
    unused rows (exactly `init` when nothing is padded)."""
    base = nnx.initializers.normal(std)

    def fn(key, shape, dtype=jnp.float32):
        w = base(key, shape, dtype)
        if shape[axis] == valid:
            return w
        keep = jnp.arange(shape[axis]) < valid
        return jnp.where(jnp.expand_dims(keep, [d for d in range(len(shape)) if d != axis]), w, 0)

    return nnx.with_partitioning(fn, names, eager_sharding=False)


# The logit of a padded vocabulary id: exp() of it minus any real logit is exactly 0 in float32,
# and, unlike -inf, it keeps sums and products over the logits finite.
PADDED_LOGIT = -1e9


def mask_padded_vocab(logits_BTV: jax.Array, vocab_size: int) -> jax.Array:
    """Logits of ids ``vocab_size`` and up set to `PADDED_LOGIT`: a softmax gives them
    probability 0, and no gradient flows back through them."""
    ids_V = jnp.arange(logits_BTV.shape[-1])
    return jnp.where(ids_V < vocab_size, logits_BTV, jnp.asarray(PADDED_LOGIT, logits_BTV.dtype))


def const_init(fn, names: tuple[str | None, ...]):
    """Wraps a constant initialiser (zeros / ones) with logical axis `names`."""
    return nnx.with_partitioning(fn, names, eager_sharding=False)


def make_norm(kind: str, width: int, *, eps: float, dtype, param_dtype, rngs: nnx.Rngs):
    """LayerNorm (with bias) or RMSNorm over the last dimension, scale named ``embed``."""
    scale = const_init(nnx.initializers.ones, ("embed",))
    if kind == "layernorm":
        return nnx.LayerNorm(
            width,
            epsilon=eps,
            dtype=dtype,
            param_dtype=param_dtype,
            scale_init=scale,
            bias_init=const_init(nnx.initializers.zeros, ("embed",)),
            rngs=rngs,
        )
    return nnx.RMSNorm(
        width, epsilon=eps, dtype=dtype, param_dtype=param_dtype, scale_init=scale, rngs=rngs
    )


def apply_norm(norm: nnx.Module, x: jax.Array, impl: str = "xla") -> jax.Array:
    """Runs a `make_norm` module: itself for ``impl="xla"``, else the fused kernel on its
    parameters (so the parameter tree is the same whichever kernel runs)."""
    if impl == "xla":
        return norm(x)
    from meshtrain import kernels

    if isinstance(norm, nnx.LayerNorm):
        return kernels.layer_norm(x, norm.scale[...], norm.bias[...], eps=norm.epsilon, impl=impl)
    return kernels.rms_norm(x, norm.scale[...], eps=norm.epsilon, impl=impl)


def rope_tables(n_pos: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary angles, each [n_pos, head_dim // 2] in float32."""
    inv_freq_k = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angle_TK = jnp.arange(n_pos, dtype=jnp.float32)[:, None] * inv_freq_k[None, :]
    return jnp.cos(angle_TK), jnp.sin(angle_TK)


def apply_rope(x_BTHK: jax.Array, cos_TK: jax.Array, sin_TK: jax.Array) -> jax.Array:
    """Rotates pairs (first half, second half) of each head by the position's angle."""
    x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos_TK[None, :, None, :], sin_TK[None, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHK.dtype)


def causal_attention(q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array) -> jax.Array:
    """Causal softmax attention with grouped key/value heads; softmax in float32.

    The jnp math lives once, in `meshtrain.kernels.reference.attention`, the reference the
    Pallas kernel is tested against.

    Returns:
        [B, T, H, K] in the dtype of `v_BSGK`.
    """
    return reference.attention(q_BTHK, k_BSGK, v_BSGK, causal=True)
