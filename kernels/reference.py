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


def visible(T: int, S: int, *, causal: bool, window: int | None = None) -> jax.Array | None:
    """The [T, S] mask of keys each query sees: all (None), causal (query i sees keys 0..i,
    top-left aligned) or a causal sliding window (keys i − window + 1 .. i)."""
    if window is not None and not causal:
        raise ValueError("attention window: a sliding window needs causal=True")
    if window is not None and window < 1:
        raise ValueError(f"attention window={window}: must be ≥ 1 (None for no window)")
    if not causal:
        return None
    gap_TS = jnp.arange(T)[:, None] - jnp.arange(S)[None, :]  # query position − key position
    ok_TS = gap_TS >= 0
    return ok_TS if window is None else ok_TS & (gap_TS < window)


def same_segment(segment_ids_BT: jax.Array, ok_TS: jax.Array | None) -> jax.Array:
    """`ok_TS` (None: all pairs) restricted to pairs of one segment: [B, 1, 1, T, S], to
    broadcast over the [B, G, R, T, S] scores."""
    ok_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    if ok_TS is not None:
        ok_BTS = ok_BTS & ok_TS
    return ok_BTS[:, None, None]


def _masked_scores(q_BTHK, k_BSGK, fill, causal, window, segment_ids):
    """The scaled scores [B, G, R, T, S] in float32, `fill` where a query does not see a key."""
    B, T, H, K = q_BTHK.shape
    S, G = k_BSGK.shape[1], k_BSGK.shape[2]
    q_BTGRK = q_BTHK.reshape(B, T, G, H // G, K)
    s_BGRTS = jnp.einsum(
        "btgrk,bsgk->bgrts", q_BTGRK, k_BSGK, preferred_element_type=jnp.float32
    ) / math.sqrt(K)
    ok_TS = visible(T, S, causal=causal, window=window)
    if segment_ids is not None:
        ok_TS = same_segment(segment_ids, ok_TS)
    if ok_TS is not None:
        s_BGRTS = jnp.where(ok_TS, s_BGRTS, fill)
    return s_BGRTS


def attention(
    q_BTHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    *,
    causal: bool = True,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Softmax attention with grouped key/value heads, softmax in float32.

    With ``causal=True`` this is `meshtrain.models.layers.causal_attention` (query i sees keys
    0..i, top-left aligned); a `window` (causal only) limits it to keys (i − window, i].
    With `segment_ids` ([B, T] integers, self-attention: S = T) a query sees only keys of its
    own segment (packed documents; padding is one more segment, so no row is empty). The values
    may be narrower or wider than the queries and keys (latent attention: width V).

    Returns:
        [B, T, H, V] in the dtype of `v_BSGK` (V = K for ordinary attention).
    """
    B, T, H, _ = q_BTHK.shape
    s_BGRTS = _masked_scores(
        q_BTHK, k_BSGK, jnp.finfo(jnp.float32).min, causal, window, segment_ids
    )
    p_BGRTS = jax.nn.softmax(s_BGRTS, axis=-1).astype(v_BSGK.dtype)
    o_BTGRV = jnp.einsum("bgrts,bsgv->btgrv", p_BGRTS, v_BSGK)
    return o_BTGRV.reshape(B, T, H, v_BSGK.shape[-1])


def attention_logsumexp(
    q_BTHK: jax.Array,
    k_BSGK: jax.Array,
    *,
    causal: bool = True,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """The logsumexp of the scaled scores per query, [B, H, T] float32 (what flash saves)."""
    B, T, H, _ = q_BTHK.shape
    s_BGRTS = _masked_scores(q_BTHK, k_BSGK, -jnp.inf, causal, window, segment_ids)
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


def relu(x: jax.Array) -> jax.Array:
    """``max(x, 0)`` elementwise; its gradient is ``dy`` where x > 0, else 0."""
    return jax.nn.relu(x)


def mean_squared_error(pred_ND: jax.Array, target_ND: jax.Array) -> jax.Array:
    """Per-row mean squared error ``mean((pred − target)², axis=-1)`` in float32."""
    diff = pred_ND.astype(jnp.float32) - target_ND.astype(jnp.float32)
    return jnp.mean(diff * diff, axis=-1)
