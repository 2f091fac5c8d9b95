"""Helpers shared by several test files."""

import contextlib

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles():
    """Counts XLA backend compiles inside the block; yields a list whose length is the count."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            seen.append(kwargs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
