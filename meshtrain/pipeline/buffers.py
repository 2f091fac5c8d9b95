"""The executors' buffers: how they start (zeros, or NaN while poisoning) and masked writes.

Every write into a buffer is a `jnp.where` on the schedule, so a slot where a stage has
nothing to do never changes what a later slot reads. `poison_buffers` fills those slots and
all unused buffer entries with NaN to prove it. A buffer in host memory takes no select: its
ring has a spare last entry that takes the discarded writes.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain.layout import varying

_POISON = contextvars.ContextVar("meshtrain_pipeline_poison", default=False)


@contextlib.contextmanager
def poison_buffers():
    """While tracing inside this block, the pipelines' idle slots and unused buffer entries
    start out NaN (testing: a value that reaches a result shows)."""
    token = _POISON.set(True)
    try:
        yield
    finally:
        _POISON.reset(token)


def poisoning() -> bool:
    """Whether the trace is inside `poison_buffers`."""
    return _POISON.get()


def fill(x: jax.Array, poison: bool) -> jax.Array:
    """Zeros (or NaN, when poisoning) shaped like `x`."""
    return (
        jnp.full_like(x, jnp.nan)
        if poison and jnp.issubdtype(x.dtype, jnp.floating)
        else (jnp.zeros_like(x))
    )


def put(buf: jax.Array, value: jax.Array, index, when) -> jax.Array:
    """``buf[index] = value`` where `when`, else unchanged; a masked ring-buffer write."""
    return lax.dynamic_update_index_in_dim(buf, jnp.where(when, value, buf[index]), index, 0)


def host_ring(shape, depth: int, axes) -> jax.Array:
    """A ring buffer of `depth` + 1 slots in host memory (the last one takes discarded
    writes), typed to vary over `axes`."""
    ring = varying(jnp.zeros((depth + 1, *shape.shape), shape.dtype), axes)
    return jax.device_put(ring, jax.memory.Space.Host)


def put_host(buf: jax.Array, value: jax.Array, index, when) -> jax.Array:
    """``buf[index] = value`` where `when`, else into the spare last slot: a masked write to a
    host ring with no select on host memory."""
    return lax.dynamic_update_index_in_dim(buf, value, jnp.where(when, index, buf.shape[0] - 1), 0)


def at(tree, i):
    """Entry `i` of every leaf's leading dimension."""
    return jax.tree.map(lambda a: a[i], tree)
