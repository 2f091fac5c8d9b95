"""Building blocks shared by the models: annotated initialisers, norms, RoPE, attention math.

Shape suffixes: B batch, T query positions, S key positions, D model width, H query heads,
G key/value heads, R = H // G query heads per group, K head width, F feed-forward width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain import validate
from meshtrain.kernels import reference
from meshtrain.layout import constrain
from meshtrain.problem import Problem


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


def make_norm(
    kind: str, width: int, *, eps: float, dtype, param_dtype, rngs: nnx.Rngs, axis: str = "embed"
):
    """LayerNorm (with bias) or RMSNorm over the last dimension, scale named `axis`."""
    scale = const_init(nnx.initializers.ones, (axis,))
    if kind == "layernorm":
        return nnx.LayerNorm(
            width,
            epsilon=eps,
            dtype=dtype,
            param_dtype=param_dtype,
            scale_init=scale,
            bias_init=const_init(nnx.initializers.zeros, (axis,)),
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


def rope_tables(
    n_pos: int,
    head_dim: int,
    theta: float,
    *,
    llama3: tuple[float, float, float, int] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary angles, each [n_pos, head_dim // 2] in float32.

    `llama3` = ``(factor, low_freq_factor, high_freq_factor, original_context)`` scales the
    frequencies as Llama 3.1 does (`llama3_frequencies`).
    """
    inv_freq_k = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if llama3 is not None:
        inv_freq_k = llama3_frequencies(inv_freq_k, *llama3)
    angle_TK = jnp.arange(n_pos, dtype=jnp.float32)[:, None] * inv_freq_k[None, :]
    return jnp.cos(angle_TK), jnp.sin(angle_TK)


def llama3_frequencies(
    inv_freq_k: jax.Array,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context: int,
) -> jax.Array:
    """Llama 3.1's RoPE scaling of the rotary frequencies [K/2].

    A rotation whose wavelength ``2π / freq`` is short next to the pre-training context (below
    ``original_context / high_freq_factor``) is kept; a long one (above ``original_context /
    low_freq_factor``) is slowed down `factor` times, as in position interpolation; in between
    the frequency blends the two linearly in ``original_context / wavelength``.
    """
    turns_k = original_context * inv_freq_k / (2 * jnp.pi)  # = original_context / wavelength
    # 0 at the long-wavelength boundary, 1 at the short one.
    blend_k = (turns_k - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blend_k = jnp.clip(blend_k, 0.0, 1.0)
    return (1.0 - blend_k) * inv_freq_k / factor + blend_k * inv_freq_k


# The llama3 parameters' GPTConfig names and defaults (Llama 3.1's values).
LLAMA3_DEFAULTS = {
    "rope_factor": 8.0,
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_seq_len": 8192,
}


def rope_scaling_problems(kind: str, *, style: str, prefix: str = "gpt", **params) -> list[Problem]:
    """What keeps RoPE scaling `kind` (``"none"`` or ``"llama3"``) from taking `params`
    (`LLAMA3_DEFAULTS`' names), as `Problem` lines whose fields start with `prefix`."""
    if kind == "none":
        return [
            Problem(
                f"{prefix}.{name}",
                value,
                f"has no effect with rope_scaling='none'; set --{prefix}.rope-scaling llama3 "
                f"or leave {name} at {LLAMA3_DEFAULTS[name]}",
            )
            for name, value in params.items()
            if value != LLAMA3_DEFAULTS[name]
        ]
    field = f"{prefix}.rope_scaling"
    if kind != "llama3":
        return validate.one_of(field, kind, ("none", "llama3"))
    if style != "llama":
        return [Problem(field, kind, "needs style='llama' (gpt2 has learned positions)")]
    low, high = params["rope_low_freq_factor"], params["rope_high_freq_factor"]
    problems = validate.at_least(f"{prefix}.rope_factor", params["rope_factor"], 1, integer=False)
    if not (validate.is_number(low) and validate.is_number(high) and 0 < low < high):
        problems.append(
            Problem(
                f"{prefix}.rope_low_freq_factor",
                low,
                f"and rope_high_freq_factor={high} must satisfy 0 < low < high",
            )
        )
    return problems + validate.positive(
        f"{prefix}.rope_original_max_seq_len", params["rope_original_max_seq_len"], example=8192
    )


def apply_rope(x_BTHK: jax.Array, cos_TK: jax.Array, sin_TK: jax.Array) -> jax.Array:
    """Rotates pairs (first half, second half) of each head by the position's angle; the
    tables are [T, K/2] (one position per row index) or [B, T, K/2] (per token: packing)."""
    x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
    if cos_TK.ndim == 3:
        cos, sin = cos_TK[:, :, None, :], sin_TK[:, :, None, :]
    else:
        cos, sin = cos_TK[None, :, None, :], sin_TK[None, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHK.dtype)


def causal_attention(
    q_BTHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal softmax attention with grouped key/value heads; softmax in float32. With a
    `window`, query t sees only keys (t − window, t]; with `segment_ids` ([B, T]), only keys
    of its own segment (packed documents).

    The jnp math lives once, in `meshtrain.kernels.reference.attention`, the reference the
    Pallas kernel is tested against.

    Returns:
        [B, T, H, K] in the dtype of `v_BSGK`.
    """
    return reference.attention(
        q_BTHK, k_BSGK, v_BSGK, causal=True, window=window, segment_ids=segment_ids
    )
