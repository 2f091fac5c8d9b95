"""Packed microbatches' shares of their batch: each weighed by the real tokens it holds.

A packed batch's loss is the mean over the real tokens of the whole batch, but its
microbatches hold different numbers of them; accumulating their gradients with these shares
as weights gives the whole batch's mean. Inside a region manual over batch axes (the
replicas' own step) each device holds its rows only, and the batch's count is every device's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.layout.manual import manual_batch_axes


def token_shares(mask: jax.Array | None, accum_steps: int) -> jax.Array | None:
    """Each microbatch's share of the batch's real tokens, times `accum_steps`.

    Args:
        mask: which tokens the loss counts, ``[accum_steps, ...]`` (a packed batch's
            ``segment_ids > 0``), or None for a plain batch.
        accum_steps: the number of microbatches.

    Returns:
        ``accum_steps × real tokens of each microbatch / of the batch``, float32
        ``[accum_steps]``; None for plain microbatches (every one weighs the same).
    """
    if mask is None:
        return None
    counts = mask.reshape(accum_steps, -1).sum(1).astype(jnp.float32)
    total, devices = counts.sum(), 1
    rows = manual_batch_axes()
    if rows:  # each device holds its rows only: the batch's count is every device's
        total, devices = jax.lax.psum(total, rows), jax.lax.psum(1, rows)
    return accum_steps * devices * counts / jnp.maximum(total, 1.0)
