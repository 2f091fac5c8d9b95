"""Bounded staleness: each update applies the gradient computed `s` steps earlier.

A deterministic model of stale-synchronous and asynchronous (parameter-server) training on
synchronous hardware: with staleness s, the update at step t uses the gradient taken on the
parameters of step t - s, as if every worker's push reached the server s updates late. The
gradients in flight wait in a ring of s slots in the train state (``comm["stale"]``), so a
resumed run continues exactly. The first s steps only fill the ring; they update nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def stale_init(params, staleness: int):
    """The empty ring: `staleness` float32 zero gradients per parameter, stacked on dim 0."""
    return jax.tree.map(lambda p: jnp.zeros((staleness, *p.shape), jnp.float32), params)


def delay(grads, ring, step: jax.Array) -> tuple[dict, dict, jax.Array]:
    """Swaps this step's gradient into the ring for the one `s` steps old.

    Args:
        grads: the gradient computed at this step.
        ring: ``comm["stale"]``: s gradients, leaves (s, *shape); slot ``t % s`` holds step t's.
        step: the step count before this update.

    Returns:
        ``(applied, ring, ready)``: the gradient of step ``step - s`` (cast to each gradient's
        dtype), the ring holding this step's instead, and whether that old gradient exists
        (``step >= s``); before then the update must not be applied.
    """
    s = jax.tree.leaves(ring)[0].shape[0]
    slot = step % s
    applied = jax.tree.map(lambda q, g: q[slot].astype(g.dtype), ring, grads)
    ring = jax.tree.map(lambda q, g: q.at[slot].set(g.astype(q.dtype)), ring, grads)
    return applied, ring, step >= s
