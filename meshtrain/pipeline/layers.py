"""The model's stacked layers as the stages hold them, and back.

Stage s runs the model's chunks s, s+p, s+2p, ... (just chunk s unless the schedule is
chunked: circular, interleaved-1f1b). With v chunks per stage the layers are reordered so
that each stage's chunks are one contiguous slice of the ``layers`` dimension (which the rules
put on ``pipe``), and inside the region that slice is cut into its v chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _circular_order(n_layers: int, p: int, v: int) -> jax.Array:
    """Layer order that gives stage s the chunks s, s+p, ... as one contiguous slice."""
    lc = n_layers // (p * v)
    order = [(r * p + s) * lc + j for s in range(p) for r in range(v) for j in range(lc)]
    return jnp.asarray(order, jnp.int32)


def stage_order(blocks: dict, n_layers: int, p: int, v: int) -> dict:
    """The stacked blocks [L, ...] reordered so that each stage's chunks are contiguous."""
    if v == 1:
        return blocks
    order = _circular_order(n_layers, p, v)
    return jax.tree.map(lambda w: jnp.take(w, order, axis=0), blocks)


def model_order(grads: dict, n_layers: int, p: int, v: int) -> dict:
    """Gradients [L, ...] in `stage_order` put back in the model's layer order."""
    if v == 1:
        return grads
    inverse = jnp.argsort(_circular_order(n_layers, p, v))
    return jax.tree.map(lambda g: jnp.take(g, inverse, axis=0), grads)


def as_chunks(blocks: dict, v: int) -> dict:
    """One stage's blocks [v·Lc, ...] as its chunks [v, Lc, ...] (local chunk r is the model's
    chunk r·p + stage)."""
    return jax.tree.map(lambda w: w.reshape(v, w.shape[0] // v, *w.shape[1:]), blocks)


def from_chunks(chunks: dict) -> dict:
    """Per-chunk arrays [v, Lc, ...] as one stage's [v·Lc, ...]."""
    return jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), chunks)
