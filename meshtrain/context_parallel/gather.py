"""The two algorithms that move whole sequences: all-gather of keys/values, and Ulysses
(all-to-all from sequence-split to head-split and back). Both run inside a region manual over
the sequence axis and are differentiated by autodiff (the transpose of an all-gather is a
reduce-scatter, of an all-to-all the reverse all-to-all).

Shape suffixes as in `blocks`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from meshtrain.context_parallel import blocks


def allgather(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, axis, causal, window, impl="xla"):
    """This device's queries against every device's keys, gathered over `axis`.

    Args: as `ring.ring`.

    Returns:
        [B, T, H, K] in the dtype of `v_BSGK`.
    """
    k_all, v_all = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (k_BSGK, v_BSGK))
    k_pos_all = lax.all_gather(k_pos_S, axis, axis=0, tiled=True)
    o, _ = blocks.attend(
        q_BTHK, k_all, v_all, q_pos_T, k_pos_all, causal=causal, window=window, impl=impl
    )
    return o.astype(v_BSGK.dtype)


def ulysses(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, axis, causal, window, impl="xla"):
    """Attention with the heads split over `axis` instead of the sequence (DeepSpeed Ulysses).

    An all-to-all turns each device's [B, T/n, H, K] into [B, T, H/n, K]; attention runs over
    the whole sequence for its heads; a second all-to-all turns the result back. Key/value
    heads that `axis` does not divide are repeated to one per query head first.

    Args: as `ring.ring`; the query heads must be divisible by the size of `axis`.

    Returns:
        [B, T, H, K] in the dtype of `v_BSGK`.
    """
    n = lax.axis_size(axis)
    H, G = q_BTHK.shape[2], k_BSGK.shape[2]
    if G % n:
        k_BSGK, v_BSGK = (jnp.repeat(x, H // G, axis=2) for x in (k_BSGK, v_BSGK))

    def to_heads(x):
        return lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    q_all, k_all, v_all = (to_heads(x) for x in (q_BTHK, k_BSGK, v_BSGK))
    q_pos_all = lax.all_gather(q_pos_T, axis, axis=0, tiled=True)
    k_pos_all = lax.all_gather(k_pos_S, axis, axis=0, tiled=True)
    o, _ = blocks.attend(
        q_all, k_all, v_all, q_pos_all, k_pos_all, causal=causal, window=window, impl=impl
    )
    o = o.astype(v_BSGK.dtype)
    return lax.all_to_all(o, axis, split_axis=1, concat_axis=2, tiled=True)
