"""Every use of another package's private or version-dependent names, in one place.

Each function here wraps one such name; `tests/test_compat.py` checks each one still exists
on the installed versions, so an upgrade that removes it fails loudly there rather than
somewhere inside a run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax


def jax_backends_started() -> bool:
    """True once jax has created its backends (after which the device count is fixed).

    Uses ``jax._src.xla_bridge._backends``: jax has no public query that does not itself
    start the backends.
    """
    import sys

    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)


def jax_distributed_client():
    """The coordination-service client of `jax.distributed` (None before initialisation).

    Uses ``jax._src.distributed.global_state.client``: its key-value store is how processes
    agree on facts before any collective can run.
    """
    from jax._src import distributed

    return distributed.global_state.client


def varies_over(x: jax.Array, axis: str) -> bool:
    """Whether `x` differs along the manual mesh `axis` (jax 0.12 and 0.11 spell it apart)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.12
    return axis in (manual.varying if manual is not None else aval.vma)  # jax 0.11: .vma


def tyro_config_errors(handler: Callable) -> contextlib.AbstractContextManager:
    """While active, tyro calls `handler(event)` on each parse error before printing it.

    Uses ``tyro._errors.on_parse_error``, tyro's private and experimental hook (the only way
    to see a config's own ``ValueError`` instead of tyro's box). tyro < 1.0 has no such hook:
    there this does nothing, and a rejected config value shows tyro's box.
    """
    try:
        from tyro._errors import on_parse_error
    except ImportError:
        return contextlib.nullcontext()
    return on_parse_error(handler)


def tyro_instantiation_failure() -> type | tuple:
    """tyro's private event type for a config class whose constructor raised (``()``, which
    nothing is an instance of, on a tyro without it)."""
    try:
        from tyro import _errors
    except ImportError:
        return ()
    return getattr(_errors, "InstantiationFailure", ())


def orbax_finish_tmp_cleanup(manager) -> None:
    """Waits for an orbax `CheckpointManager`'s background removal of interrupted saves.

    Uses ``CheckpointManager._maybe_await_cleanup_tmp_directory``: orbax starts that cleanup
    in a thread and has no public way to wait for it. Older orbax (0.11.17, the lowest we
    allow) has no such method because it cleans up in the constructor: nothing to wait for.
    """
    finish = getattr(manager, "_maybe_await_cleanup_tmp_directory", None)
    if finish is not None:
        finish()
