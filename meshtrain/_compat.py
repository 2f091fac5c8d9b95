"""Every use of another package's private or version-dependent names, in one place.

Each function here wraps one such name; `tests/test_compat.py` checks each one still exists
on the installed versions, so an upgrade that removes it fails loudly there rather than
somewhere inside a run.
"""

from __future__ import annotations

import dataclasses
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


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes `x` differs along (jax 0.12 and 0.11 spell it apart)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.12
    return frozenset(manual.varying if manual is not None else aval.vma)  # jax 0.11: .vma


def varies_over(x: jax.Array, axis: str) -> bool:
    """Whether `x` differs along the manual mesh `axis`."""
    return axis in varying_axes(x)


@dataclasses.dataclass(frozen=True)
class ParseFailure:
    """One rejected command line, in tyro-free terms (see `tyro_parse_failures`).

    Args:
        kind: "value" (a flag's value did not convert), "config" (a config's own check
            raised), "unknown" (tokens no flag takes), "missing" (required arguments left
            out), "choice" (a value outside a flag's choices), "other".
        flags: the flags (or positional names) concerned.
        message: tyro's own words for the failure (e.g. the config's ValueError).
        value: the value the user gave, when tyro knows it.
        choices: a choice flag's allowed values.
        expected: the Python type a value flag converts to (e.g. ``int``), else None.
        default: the flag's default, else None.
    """

    kind: str
    flags: tuple[str, ...] = ()
    message: str = ""
    value: str | None = None
    choices: tuple[str, ...] = ()
    expected: type | None = None
    default: object = None


def _failure(event) -> ParseFailure:
    """A tyro parse-error event as a `ParseFailure`."""
    from tyro import _errors

    def names(arg) -> tuple[str, ...]:
        return tuple(arg.lowered.name_or_flags) or (arg.display_name(),)

    if isinstance(event, _errors.InstantiationFailure):
        arg = event.argument
        if arg is None:
            return ParseFailure("config", message=event.message)
        default = arg.field.default
        return ParseFailure(
            "value",
            names(arg),
            event.message,
            expected=arg.field.type_stripped if isinstance(arg.field.type_stripped, type) else None,
            default=default if isinstance(default, (int, float, str)) else None,
        )
    if isinstance(event, _errors.UnrecognizedArgs):
        return ParseFailure("unknown", tuple(event.tokens))
    if isinstance(event, _errors.MissingArgs) and event.unrecognized_tokens:
        return ParseFailure("unknown", tuple(event.unrecognized_tokens))  # a misspelt flag
    if isinstance(event, _errors.MissingArgs):
        return ParseFailure(
            "missing", tuple(n for a in event.missing_arguments for n in names(a.arg)[:1])
        )
    if isinstance(event, _errors.InvalidChoice):
        return ParseFailure(
            "choice", names(event.argument), value=event.value, choices=tuple(event.choices)
        )
    if isinstance(event, _errors.BadValue):
        return ParseFailure("value", names(event.argument), value=event.offending_value)
    return ParseFailure("other", message=type(event).__name__)


def tyro_parse_failures(handler: Callable[[ParseFailure], None]):
    """While active, tyro calls `handler(failure)` on each parse error before printing its box;
    a `handler` that raises replaces the box.

    Uses ``tyro._errors.on_parse_error`` and its event types, tyro's private and experimental
    hook (tyro >= 1.0.14; pyproject requires it): the only way to turn tyro's error box into
    the one line meshtrain prints.
    """
    from tyro._errors import on_parse_error

    return on_parse_error(lambda event: handler(_failure(event)))


def orbax_finish_tmp_cleanup(manager) -> None:
    """Waits for an orbax `CheckpointManager`'s background removal of interrupted saves.

    Uses ``CheckpointManager._maybe_await_cleanup_tmp_directory``: orbax starts that cleanup
    in a thread and has no public way to wait for it. Older orbax (0.11.17, the lowest we
    allow) has no such method because it cleans up in the constructor: nothing to wait for.
    """
    finish = getattr(manager, "_maybe_await_cleanup_tmp_directory", None)
    if finish is not None:
        finish()


class _WholeShardArrays:
    """Orbax's global type registry, but with `array_handler` for jax.Arrays."""

    def __init__(self, array_handler):
        from orbax.checkpoint import type_handlers

        self._types = type_handlers
        self._default = type_handlers.get_type_handler(jax.Array)
        self._array = array_handler

    def get(self, ty):
        handler = self._types.get_type_handler(ty)
        return self._array if handler is self._default else handler

    def has(self, ty) -> bool:
        return self._types.has_type_handler(ty)

    def add(self, *args, **kwargs) -> None:
        raise TypeError("meshtrain's checkpoint registry is read-only; register with orbax")


def orbax_state_handler_without_replica_slices():
    """An orbax `StandardCheckpointHandler` that writes each shard whole, from one replica.

    Off GPUs, orbax splits the write of a replicated shard among its replicas by default,
    slicing the shard on the devices first: a small program compiled per array shape, on every
    save. With simulated devices every replica shares one host, and the split writes nothing
    sooner; on GPUs orbax already writes whole shards, as it now does everywhere.

    Uses ``StandardCheckpointHandler._impl`` (the handler takes no type registry) and
    ``ArrayHandler._use_replica_parallel`` (on a copy of orbax's registered handler, so its
    metadata store and other options stay orbax's).
    """
    import copy

    import orbax.checkpoint as ocp

    array = copy.copy(ocp.type_handlers.get_type_handler(jax.Array))
    array._use_replica_parallel = False
    handler = ocp.StandardCheckpointHandler()
    handler._impl = ocp.PyTreeCheckpointHandler(  # StandardCheckpointHandler's own arguments
        save_concurrent_gb=96,
        restore_concurrent_gb=96,
        use_ocdbt=True,
        type_handler_registry=_WholeShardArrays(array),
    )
    return handler


def cudnn_packed_attention(q, k, v, q_lengths, kv_lengths, q_offsets, kv_offsets, *, causal):
    """cuDNN's fused attention over packed documents ([B, T, heads, head_dim] in and out).

    Uses ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``: the public
    `jax.nn.dot_product_attention` passes no document offsets (jax 0.11 and 0.12). Each row
    holds documents ``[offsets[b, m], offsets[b, m] + lengths[b, m])``, int32 [B, M] and
    [B, M + 1], -1 past a row's last; a query sees keys of its own document only (and, with
    `causal`, none after itself).
    """
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    mask = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
    scale = 1.0 / float(q.shape[-1]) ** 0.5
    return cudnn.dot_product_attention(
        q, k, v, None, None, q_lengths, kv_lengths, q_offsets, kv_offsets,
        scale=scale, mask_type=mask, qkv_layout="BTNH",
    )  # fmt: skip
