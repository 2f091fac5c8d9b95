"""Pure-jnp references for every kernel: the ``impl="xla"`` path and the tests' ground truth.

Shape suffixes: B batch, T query positions, S key positions, H query heads, G key/value heads,
R = H // G, K head width, N rows (tokens), D features, V vocabulary, M/N/K matmul dims.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

ACTIVATIONS = {
    "none": lambda z: z,
    "relu": jax.nn.relu,
    "gelu": lambda z: jax.nn.gelu(z, approximate=True),
    "silu": jax.nn.silu,
}


def attention(
    q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, *, causal: bool = True
) -> jax.Array:
    """Softmax attention with grouped key/value heads, softmax in float32.

    With ``causal=True`` this is `meshtrain.models.layers.causal_attention` (query i sees keys
    0..i, top-left aligned).

    Returns:
        [B, T, H, K] in the dtype of `v_BSGK`.
    """
    B, T, H, K = q_BTHK.shape
    S, G = k_BSGK.shape[1], k_BSGK.shape[2]
    q_BTGRK = q_BTHK.reshape(B, T, G, H // G, K)
    s_BGRTS = jnp.einsum(
        "btgrk,bsgk->bgrts", q_BTGRK, k_BSGK, preferred_element_type=jnp.float32
    ) / math.sqrt(K)
    if causal:
        causal_TS = jnp.arange(T)[:, None] >= jnp.arange(S)[None, :]
        s_BGRTS = jnp.where(causal_TS, s_BGRTS, jnp.finfo(jnp.float32).min)
    p_BGRTS = jax.nn.softmax(s_BGRTS, axis=-1).astype(v_BSGK.dtype)
    o_BTGRK = jnp.einsum("bgrts,bsgk->btgrk", p_BGRTS, v_BSGK)
    return o_BTGRK.reshape(B, T, H, K)


def attention_logsumexp(q_BTHK: jax.Array, k_BSGK: jax.Array, *, causal: bool = True) -> jax.Array:
    """The logsumexp of the scaled scores per query, [B, H, T] float32 (what flash saves)."""
    B, T, H, K = q_BTHK.shape
    S, G = k_BSGK.shape[1], k_BSGK.shape[2]
    q_BTGRK = q_BTHK.reshape(B, T, G, H // G, K)
    s_BGRTS = jnp.einsum(
        "btgrk,bsgk->bgrts", q_BTGRK, k_BSGK, preferred_element_type=jnp.float32
    ) / math.sqrt(K)
    if causal:
        causal_TS = jnp.arange(T)[:, None] >= jnp.arange(S)[None, :]
        s_BGRTS = jnp.where(causal_TS, s_BGRTS, -jnp.inf)
    return jax.nn.logsumexp(s_BGRTS, axis=-1).reshape(B, H, T)


def rms_norm(x_ND: jax.Array, scale_D: jax.Array, *, eps: float = 1e-5) -> jax.Array:
    """``x / sqrt(mean(x²) + eps) · scale`` over the last dimension, statistics in float32
    (the numerics of `flax.nnx.RMSNorm`); returns the dtype of `x_ND`."""
    x = x_ND.astype(jnp.float32)
    var = jnp.mean(x * x, axis=-1, keepdims=True)
    y = x * (jax.lax.rsqrt(var + eps) * scale_D.astype(jnp.float32))
    return y.astype(x_ND.dtype)


def layer_norm(
    x_ND: jax.Array, scale_D: jax.Array, bias_D: jax.Array, *, eps: float = 1e-5
) -> jax.Array:
    """``(x - mean) / sqrt(var + eps) · scale + bias`` over the last dimension, statistics in
    float32 (the numerics of `flax.nnx.LayerNorm`); returns the dtype of `x_ND`."""
    x = x_ND.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * (jax.lax.rsqrt(var + eps) * scale_D.astype(jnp.float32))
    return (y + bias_D.astype(jnp.float32)).astype(x_ND.dtype)


def token_cross_entropy(logits_NV: jax.Array, targets_N: jax.Array) -> jax.Array:
    """Per-row softmax cross-entropy in float32: ``logsumexp(logits) - logits[target]``, [N]."""
    logits = logits_NV.astype(jnp.float32)
    lse_N = jax.nn.logsumexp(logits, axis=-1)
    picked_N = jnp.take_along_axis(logits, targets_N[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return lse_N - picked_N


def matmul(
    x_MK: jax.Array, w_KN: jax.Array, bias_N: jax.Array | None = None, *, activation: str = "none"
) -> jax.Array:
    """``act(x @ w + bias)``, accumulated in float32; returns the dtype of `x_MK`."""
    z = jnp.dot(x_MK, w_KN, preferred_element_type=jnp.float32)
    if bias_N is not None:
        z = z + bias_N.astype(jnp.float32)
    return ACTIVATIONS[activation](z).astype(x_MK.dtype)
