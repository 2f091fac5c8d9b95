"""Sampling from any causal language model: token ids [B, T] → next-token logits [B, T, V]."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.models.base import logits_of


def sample(
    model: nnx.Module,
    prompt: jax.Array,
    n_new: int,
    *,
    key: jax.Array,
    temperature: float = 0.8,
    window: int | None = None,
    vocab_size: int | None = None,
) -> jax.Array:
    """Samples `n_new` tokens after `prompt` ([T0] int32); returns the [T0 + n_new] tokens.

    Runs the full forward over a fixed window each step (no KV cache): the window is
    right-padded, and causality makes the padding invisible to earlier positions.

    Args:
        model: a causal LM.
        prompt: [T0] token ids.
        n_new: tokens to add.
        key: the random key.
        temperature: softmax temperature (near 0: greedy).
        window: context length; default ``model.cfg.max_seq_len``.
        vocab_size: sample only ids below this (logits past it are never drawn); default:
            every logit. meshtrain's GPT masks its padded vocabulary itself.

    Returns:
        [T0 + n_new] int32 tokens.
    """
    if window is None:
        window = model.cfg.max_seq_len
    graphdef, state = nnx.split(model)

    @jax.jit
    def next_token(state, buf_T, pos, key):
        logits_TV = logits_of(nnx.merge(graphdef, state)(buf_T[None]))[0]
        logits_V = jax.lax.dynamic_index_in_dim(logits_TV, pos, keepdims=False)
        if vocab_size is not None:
            logits_V = jnp.where(jnp.arange(logits_V.shape[-1]) < vocab_size, logits_V, -jnp.inf)
        return jax.random.categorical(key, logits_V / max(temperature, 1e-6))

    tokens = [int(t) for t in jnp.asarray(prompt)]
    for i in range(n_new):
        context = tokens[-window:]
        buf = jnp.zeros((window,), jnp.int32).at[: len(context)].set(jnp.asarray(context))
        tok = next_token(state, buf, len(context) - 1, jax.random.fold_in(key, i))
        tokens.append(int(tok))
    return jnp.asarray(tokens, jnp.int32)
