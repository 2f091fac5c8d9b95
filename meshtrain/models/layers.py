"""Building blocks shared by the models: annotated initialisers, norms, RoPE, attention math.

Shape suffixes: B batch, T query positions, S key positions, D model width, H query heads,
G key/value heads, R = H // G query heads per group, K head width, F feed-forward width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.kernels import reference
from meshtrain.sharding import constrain


def init(names: tuple[str | None, ...], std: float = 0.02):
    """A normal(std) initialiser whose variable carries logical axis `names`."""
    return nnx.with_partitioning(nnx.initializers.normal(std), names, eager_sharding=False)


def const_init(fn, names: tuple[str | None, ...]):
    """Wraps a constant initialiser (zeros / ones) with logical axis `names`."""
    return nnx.with_partitioning(fn, names, eager_sharding=False)


class Embed(nnx.Embed):
    """`nnx.Embed` for sharded training: its table is named ``("vocab", "embed")`` and its
    lookup partitions under every strategy.

    Under fsdp and zero1 the table is stored split over the batch axes (the ``embed`` rule).
    A plain ``jnp.take`` into it leaves each row split where the batch is, and with
    ``tensor > 1`` XLA can only fix that by replicating the whole result ("Involuntary full
    rematerialization"). This lookup casts the table to the compute dtype and constrains it
    to its activation layout first, as FSDP gathers any weight at use. Outside a meshtrain
    step the constraint does nothing, so the module computes exactly what `nnx.Embed` does.

    Args:
        num_embeddings: rows of the table (the vocabulary size).
        features: width of a row.
        dtype: dtype of the looked-up rows; None: the parameter dtype.
        param_dtype: dtype of the table.
        embedding_init: initialiser of the table; None: flax's default. A plain initialiser
            gets the names ``("vocab", "embed")``; one wrapped by `nnx.with_partitioning`
            keeps its own, and the lookup uses those.
        rngs: random streams; ``params`` initialises the table.
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        embedding_init=None,
        rngs: nnx.Rngs,
    ):
        init = {} if embedding_init is None else {"embedding_init": embedding_init}
        names = {"out_sharding": ("vocab", "embed"), "eager_sharding": False}
        super().__init__(
            num_embeddings,
            features,
            dtype=dtype,
            param_dtype=param_dtype,
            embedding_metadata=names,
            rngs=rngs,
            **init,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Integer ids [...] → rows [..., features] in `dtype`."""
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"Embed: token ids must be integers, got {tokens.dtype}")
        names = self.embedding.get_metadata().get("out_sharding") or (None, None)
        table_VD = constrain(self.embedding[...].astype(self.dtype), tuple(names))
        return jnp.take(table_VD, tokens, axis=0)


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
