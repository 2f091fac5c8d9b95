"""The two ends a token model's blocks sit between, shared by the GPT and the MoE: the
embedding table, the output head and the logits they produce.

Both read a `GPTConfig` (the MoE's ``backbone``). Creating the table and the head at the
same points of a model's ``__init__`` keeps its parameter paths (``embed``, ``head``) and its
random initial values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.layout import constrain
from meshtrain.models import layers
from meshtrain.models.gpt_config import GPTConfig


def token_embedding(cfg: GPTConfig, rngs: nnx.Rngs) -> layers.Embed:
    """The ``[padded_vocab, d_model]`` table (padded rows zero), named ``("vocab", "embed")``."""
    return layers.Embed(
        cfg.padded_vocab,
        cfg.d_model,
        dtype=cfg.compute_dtype,
        embedding_init=layers.init_rows(("vocab", "embed"), cfg.vocab_size, axis=0),
        rngs=rngs,
    )


def output_head(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.Linear | None:
    """The ``[d_model, padded_vocab]`` output matrix; None when the embedding is tied."""
    if cfg.tie_embeddings:
        return None
    return nnx.Linear(
        cfg.d_model,
        cfg.padded_vocab,
        use_bias=False,
        dtype=cfg.compute_dtype,
        kernel_init=layers.init_rows(("embed", "vocab"), cfg.vocab_size, axis=1),
        rngs=rngs,
    )


def check_length(seq_len: int, cfg: GPTConfig) -> None:
    """Refuses sequences longer than the model's ``max_seq_len``."""
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={cfg.max_seq_len}")


def logits(
    x_BTD: jax.Array, embed: layers.Embed, head: nnx.Linear | None, cfg: GPTConfig
) -> jax.Array:
    """Normed activations [B, T, D] → float32 logits [B, T, padded_vocab], through `head` (or
    the tied `embed`), the padded ids' set to `layers.PADDED_LOGIT`."""
    logits_BTV = embed.attend(x_BTD) if head is None else head(x_BTD)
    logits_BTV = logits_BTV.astype(jnp.float32)
    if cfg.padded_vocab > cfg.vocab_size:
        # In the model, not the loss: every loss (xla, pallas, a user's), evaluation and
        # sampling then see padded ids at zero probability, with no gradient into them.
        logits_BTV = layers.mask_padded_vocab(logits_BTV, cfg.vocab_size)
    return constrain(logits_BTV, ("batch", "seq", "vocab"))
