"""Batches on the mesh: their layout, the rows each process reads, and microbatch splits.

A batch is a dict of arrays whose dimension 0 is the logical ``batch`` dimension, split over
the mesh axes ``rules.activations["batch"]`` names (data × fsdp for the presets).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.layout.context import constrain
from meshtrain.layout.resolve import resolve
from meshtrain.layout.rules import Rules, axes_of


def batch_spec(ndim: int, rules: Rules, mesh: Mesh, *, shape=None) -> P:
    """Layout of a batch array: dimension 0 is ``batch``; the others are not split."""
    names = ("batch", *([None] * (ndim - 1)))
    return resolve(names, rules.activations, mesh, shape=shape, where="batch")


def batch_shardings(batch_shapes: Mapping, mesh: Mesh, rules: Rules) -> dict[str, NamedSharding]:
    """The `NamedSharding` of each entry of a global batch.

    Args:
        batch_shapes: the global batch's arrays, or anything with ``.shape`` per entry
            (e.g. `jax.ShapeDtypeStruct`s).
        mesh: the device mesh.
        rules: logical-axis rules; ``batch`` decides the layout.

    Returns:
        One sharding per entry, for `jit_train_step`'s ``batch_sharding``.
    """
    return {
        key: NamedSharding(mesh, batch_spec(len(x.shape), rules, mesh, shape=tuple(x.shape)))
        for key, x in batch_shapes.items()
    }


def _batch_blocks(mesh: Mesh, rules: Rules) -> tuple[int, list[int]]:
    """(blocks the batch splits into, the sorted blocks this process's devices hold)."""
    axes = axes_of(batch_spec(1, rules, mesh)[0])
    positions = [mesh.axis_names.index(a) for a in axes]
    shape = [mesh.devices.shape[i] for i in positions]
    me = jax.process_index()
    mine = {
        int(np.ravel_multi_index(tuple(idx[i] for i in positions), shape)) if axes else 0
        for idx, d in np.ndenumerate(mesh.devices)
        if d.process_index == me
    }
    return math.prod(shape), sorted(mine)


def process_rows(mesh: Mesh, rules: Rules, batch_size: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of a global batch that this process's devices hold.

    With the batch axes (data, fsdp) across processes each process holds its own slice; with
    ``pipe`` across processes several processes hold the same rows.

    Args:
        mesh: the device mesh.
        rules: logical-axis rules (``batch`` decides the layout).
        batch_size: the global batch size.

    Returns:
        ``(lo, hi)``: the process-local rows.
    """
    n_blocks, mine = _batch_blocks(mesh, rules)
    if batch_size % n_blocks:
        raise ValueError(
            f"batch_size={batch_size} does not split over the {n_blocks} data-parallel devices "
            f"(data × fsdp); use a multiple of {n_blocks}"
        )
    if mine != list(range(mine[0], mine[-1] + 1)):
        raise ValueError(
            f"mesh: process {jax.process_index()} holds batch blocks {mine}, not a contiguous "
            "run; build the mesh with meshtrain.make_mesh so each process gets adjacent rows"
        )
    rows = batch_size // n_blocks
    return mine[0] * rows, (mine[-1] + 1) * rows


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh, rules: Rules) -> dict[str, jax.Array]:
    """Lays a batch out on the mesh's batch axes.

    Args:
        batch: this process's rows of the global batch (see `process_rows`), as numpy arrays.
        mesh: the device mesh.
        rules: logical-axis rules; ``batch`` decides the layout.

    Returns:
        Global `jax.Array`s, split over the batch axes.
    """
    out = {}
    n_blocks, mine = _batch_blocks(mesh, rules)
    for key, local in batch.items():
        local = np.asarray(local)
        # This process holds len(mine) of the n_blocks equal blocks of the global batch.
        global_shape = (local.shape[0] * n_blocks // len(mine), *local.shape[1:])
        try:
            spec = batch_spec(local.ndim, rules, mesh, shape=global_shape)
            if local.shape[0] % len(mine):
                raise ValueError(f"{local.shape[0]} process-local rows")
        except ValueError as e:
            raise ValueError(
                f"batch[{key!r}] with global shape {global_shape}: {e}; the global batch size "
                "must be a multiple of the data-parallel devices (data × fsdp)"
            ) from None
        sharding = NamedSharding(mesh, spec)
        out[key] = jax.make_array_from_process_local_data(sharding, local, global_shape)
    return out


def split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] → [m, B/m, ...]; microbatch i takes rows i, i+m, ... so that every device keeps
    its own rows in every microbatch (nothing moves between devices)."""
    x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
    return constrain(x, (None, "batch", *([None] * (x.ndim - 2))))


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`: [m, B/m, ...] → [B, ...]."""
    x = x.swapaxes(0, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
