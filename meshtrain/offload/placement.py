"""Where the offloaded state lives, how the step fetches it, and what that costs in bytes."""

from __future__ import annotations

import math

import jax
import numpy as np

from meshtrain.layout.memory import HOST_KINDS, on_host
from meshtrain.offload.config import Offload


def with_offload(offload: Offload, state, shardings):
    """`state` and its `shardings` (`TrainState`s) with the optimizer state in host memory.

    Every leaf of the optimizer state moves, its step count included, so the step's input
    and output placements agree from the first step on (no second compile). Each device keeps
    its own shard: a state split over fsdp is offloaded split.

    Args:
        offload: what to offload (`Offload`).
        state: the train state, or None (shardings only, e.g. for a restore target).
        shardings: its `TrainState` of `NamedSharding`s.

    Returns:
        ``(state, shardings)``, unchanged when nothing is offloaded.
    """
    if not offload.optimizer:
        return state, shardings
    host = jax.tree.map(lambda s: s.with_memory_kind(offload.memory_kind), shardings.opt_state)
    shardings = shardings._replace(opt_state=host)
    if state is not None:
        state = state._replace(opt_state=jax.device_put(state.opt_state, host))
    return state, shardings


def to_device(tree):
    """`tree` with every host-resident leaf fetched to the device (a no-op for the others);
    the train step's first operation, so nothing computes on host memory."""
    return jax.tree.map(
        lambda x: jax.device_put(x, jax.memory.Space.Device) if on_host(x) else x, tree
    )


def host_bytes(shapes, shardings) -> int:
    """Bytes one device keeps in host memory: the shard of every leaf whose sharding is in a
    host memory kind.

    Args:
        shapes: arrays or `ShapeDtypeStruct`s.
        shardings: their shardings, the same tree.
    """
    total = 0
    for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True):
        if getattr(s, "memory_kind", None) in HOST_KINDS:
            total += math.prod(s.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
    return total


def transfer_bytes(jaxpr, n_devices: int = 1) -> dict[str, float]:
    """Bytes per device that the transfers inside a step's jaxpr move per step,
    ``{"to_host": n, "to_device": n}``: every `device_put` to a memory space, times the length
    of each scan around it, below the step's top level (there the offloaded state comes in,
    which its placement in the compiled program counts: `host_bytes`). Arrays traced outside
    `shard_map` are global and count as split evenly over the `n_devices` (exact for
    activations split over every device, as under dp and fsdp); inside, over the axes left
    automatic."""
    totals = {"to_host": 0.0, "to_device": 0.0}
    top = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr
    for eqn in top.eqns:
        for sub in _subjaxprs(eqn):
            _walk(sub, *_inside(eqn, 1, n_devices), totals)
    return totals


_SPACES = {jax.memory.Space.Host: "to_host", jax.memory.Space.Device: "to_device"}


def _walk(jaxpr, times: int, share: float, totals: dict[str, float]) -> None:
    """Adds the memory-space transfers of `jaxpr`, run `times` times with each array split
    `share` ways, to `totals`."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            for space, out in zip(eqn.params.get("devices", ()), eqn.outvars, strict=False):
                if space in _SPACES:
                    size = math.prod(out.aval.shape) * out.aval.dtype.itemsize
                    totals[_SPACES[space]] += times * size / share
        for sub in _subjaxprs(eqn):
            _walk(sub, *_inside(eqn, times, share), totals)


def _inside(eqn, times: int, share: float) -> tuple[int, float]:
    """How often the jaxprs inside `eqn` run, and how many ways their arrays are split."""
    if eqn.primitive.name == "scan":
        return times * int(eqn.params["length"]), share
    if eqn.primitive.name == "shard_map":
        mesh = eqn.params["mesh"]
        manual = eqn.params.get("axis_names") or set(mesh.axis_names) - set(
            eqn.params.get("auto", ())
        )
        return times, max(share / math.prod(mesh.shape[a] for a in manual), 1)
    return times, share


def _subjaxprs(eqn):
    """The jaxprs nested in an equation's parameters."""
    for param in eqn.params.values():
        for item in param if isinstance(param, (tuple, list)) else (param,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                yield inner
