"""Memory kinds: the accelerator's own memory and host memory, as jax names them, and whether
an array lives in host memory."""

import jax

ACCELERATOR = "device"  # jax's name for the accelerator's own memory
HOST = "pinned_host"  # page-locked host memory: transfers run at the link's rate
HOST_KINDS = (HOST, "unpinned_host")


def on_host(x) -> bool:
    """Whether `x` (an array, a tracer or a shape) lives in host memory."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host
