"""Multi-head latent attention (DeepSeek-V2/V3's MLA), the cache-free training form.

Keys and values come from one low-rank latent per token instead of per-head projections::

    queries  x → q [D, H·(N+R)]                            (mla_q_rank = 0)
             x → q_a [D, Q] → RMSNorm → q_b [Q, H·(N+R)]    (mla_q_rank = Q > 0)
    latent   x → kv_a [D, C+R] = c [C] ‖ k_rope [R]         (one rotary key for all heads)
    keys     c → RMSNorm → kv_b [C, H·(N+V)] = k_nope [H, N] ‖ v [H, V]
             k = k_nope ‖ k_rope (broadcast over heads),  q = q_nope ‖ q_rope

RoPE turns only the R rotary dims (first half, second half pairs, as `layers.apply_rope`);
the softmax scale is (N+R)^-½; the output projection o is [H·V, D]. The value width V may
differ from the query/key width N+R; the xla path takes that as it is, and context
parallelism, whose blocks take one width, gets the narrower side zero-padded
(`attend_context`). Shape suffixes as `meshtrain.models.layers`, plus
N nope width, R rope width, E = N+R query/key width, V value width, C key/value latent rank,
Q query latent rank. The latent dims carry the logical name ``latent`` (replicated by the
presets); heads are ``heads``, so tensor parallelism splits them as it splits `Attention`'s.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshtrain import context_parallel
from meshtrain.layout import constrain
from meshtrain.models import layers
from meshtrain.models.gpt_config import GPTConfig
from meshtrain.models.remat import ATTN_OUT
from meshtrain.models.token_order import token_order

# DeepSeek's latent norms (q_a_layernorm, kv_a_layernorm) keep their own epsilon, not the
# config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def _latent_norm(width: int, cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    """RMSNorm over a latent of `width`, its scale named ``latent``."""
    return nnx.RMSNorm(
        width,
        epsilon=LATENT_NORM_EPS,
        dtype=cfg.compute_dtype,
        param_dtype=jnp.float32,
        scale_init=layers.const_init(nnx.initializers.ones, ("latent",)),
        rngs=rngs,
    )


def rotate_rope_part(x_BTHE: jax.Array, nope: int, cos, sin) -> jax.Array:
    """RoPE on the dims past the first `nope` of each head; the nope dims pass unchanged."""
    rotated = layers.apply_rope(x_BTHE[..., nope:], cos, sin)
    return jnp.concatenate([x_BTHE[..., :nope], rotated], axis=-1)


def attend(q_BTHE, k_BTHE, v_BTHV, *, segment_ids=None) -> jax.Array:
    """Causal attention at scale E^-½ (E the query/key width), values of their own width V."""
    return layers.causal_attention(q_BTHE, k_BTHE, v_BTHV, segment_ids=segment_ids)


def attend_context(q_BTHE, k_BTHE, v_BTHV, order, *, segment_ids=None) -> jax.Array:
    """`attend` under the active context parallelism, whose blocks take one width for q, k
    and v: the narrower side is zero-padded to the wider one (zero value columns give zero
    outputs, dropped after; zero query/key columns add nothing to q·k, and q is rescaled so
    the scale stays E^-½)."""
    E, V = q_BTHE.shape[-1], v_BTHV.shape[-1]
    if V < E:
        v_BTHV = jnp.pad(v_BTHV, ((0, 0), (0, 0), (0, 0), (0, E - V)))
    elif E < V:
        pad = ((0, 0), (0, 0), (0, 0), (0, V - E))
        q_BTHE = jnp.pad(q_BTHE * jnp.asarray(math.sqrt(V / E), q_BTHE.dtype), pad)
        k_BTHE = jnp.pad(k_BTHE, pad)
    o_BTHW = context_parallel.attend_active(
        q_BTHE, k_BTHE, v_BTHV, order, impl="xla", segment_ids=segment_ids
    )
    return o_BTHW[..., :V]


class LatentAttention(nnx.Module):
    """Multi-head latent attention with the heads split like `Attention`'s (``heads``)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        D, H = cfg.d_model, cfg.n_heads
        N, R, V = cfg.mla_nope_dim, cfg.mla_rope_dim, cfg.mla_v_dim
        Q, C = cfg.mla_q_rank, cfg.mla_kv_rank
        dense = functools.partial(
            nnx.LinearGeneral,
            use_bias=False,
            dtype=cfg.compute_dtype,
            dot_general=cfg.dot_general,
            rngs=rngs,
        )
        # Queries through a latent (q_a, q_norm, q_b) when Q > 0, else one projection (q).
        self.q_a = dense(D, Q, kernel_init=layers.init(("embed", "latent"))) if Q else None
        self.q_norm = _latent_norm(Q, cfg, rngs) if Q else None
        q_b_init = layers.init(("latent", "heads", "kv"))
        self.q_b = dense(Q, (H, N + R), kernel_init=q_b_init) if Q else None
        q_init = layers.init(("embed", "heads", "kv"))
        self.q = None if Q else dense(D, (H, N + R), kernel_init=q_init)
        self.kv_a = dense(D, C + R, kernel_init=layers.init(("embed", "latent")))
        self.kv_norm = _latent_norm(C, cfg, rngs)
        self.kv_b = dense(C, (H, N + V), kernel_init=layers.init(("latent", "heads", "kv")))
        self.o = dense(
            (H, V),
            D,
            axis=(-2, -1),
            kernel_init=layers.init(("heads", "kv", "embed"), 0.02 / math.sqrt(2 * cfg.n_layers)),
        )
        self.nope, self.rope_dim, self.rank = N, R, C
        self.rope_theta = cfg.rope_theta

    def __call__(
        self,
        x_BTD: jax.Array,
        segment_ids_BT: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
    ) -> jax.Array:
        """Self-attention over [B, T, D], with `Attention`'s packed-batch arguments; under
        context parallelism the tokens come in its balanced order, as `Attention`'s do."""
        N, C = self.nope, self.rank
        B, T, _ = x_BTD.shape
        if self.q_a is not None and self.q_norm is not None and self.q_b is not None:
            q_BTHE = self.q_b(self.q_norm(self.q_a(x_BTD)))
        else:
            assert self.q is not None
            q_BTHE = self.q(x_BTD)
        q_BTHE = constrain(q_BTHE, ("batch", "seq", "heads", "kv"))
        latent_BTL = self.kv_a(x_BTD)  # L = C + R
        c_BTC, k_rope_BT1R = latent_BTL[..., :C], latent_BTL[..., None, C:]
        kv_BTHF = constrain(self.kv_b(self.kv_norm(c_BTC)), ("batch", "seq", "heads", "kv"))
        k_nope_BTHN, v_BTHV = kv_BTHF[..., :N], kv_BTHF[..., N:]
        cp, order, segment_ids_BT, cos, sin = token_order(
            T, segment_ids_BT, positions_BT, self.rope_dim, self.rope_theta
        )
        q_BTHE = rotate_rope_part(q_BTHE, N, cos, sin)
        k_rope_BT1R = layers.apply_rope(k_rope_BT1R, cos, sin)
        H = q_BTHE.shape[2]
        k_rope_BTHR = jnp.broadcast_to(k_rope_BT1R, (B, T, H, self.rope_dim))
        k_BTHE = constrain(
            jnp.concatenate([k_nope_BTHN, k_rope_BTHR.astype(k_nope_BTHN.dtype)], axis=-1),
            ("batch", "seq", "heads", "kv"),
        )
        q_BTHE, k_BTHE, v_BTHV = (checkpoint_name(a, "qkv") for a in (q_BTHE, k_BTHE, v_BTHV))
        if cp is not None:
            o_BTHV = attend_context(q_BTHE, k_BTHE, v_BTHV, order, segment_ids=segment_ids_BT)
        else:
            o_BTHV = attend(q_BTHE, k_BTHE, v_BTHV, segment_ids=segment_ids_BT)
        o_BTHV = checkpoint_name(o_BTHV, ATTN_OUT)
        o_BTHV = constrain(o_BTHV, ("batch", "seq", "heads", "kv"))
        return self.o(o_BTHV)
