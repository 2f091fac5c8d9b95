"""Digests of a train state's arrays, computed where the arrays live, and of JSON items.

Each array leaf is viewed as unsigned 32-bit words ``x`` (its bits, not its values: every
dtype maps one-to-one) and summed twice, wrapping modulo 2**32, with weights of each word's
global flat index ``i``:

- ``d1 = sum(x[i] * (2*i + 1))``: the weights are odd, so changing any one word changes d1;
- ``d2 = sum(x[i] * h(i))`` with ``h(i) = mix(i) | 1``, where ``mix`` alternates xor-shifts and
  odd multiplications. A multiplication alone (``i * K``) is linear modulo 2**32, and so would
  be the changes that cancel in both sums; ``mix`` is far from linear, so changes to several
  words that cancel in d1 almost never cancel in d2.

Integer sums do not depend on the order of the additions, so the digests are the same for
any sharding, device count or process count, and one jitted call computes them all without
gathering any array on one device.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshtrain._tree import path_str

_MIX = (16, 0x7FEB352D, 15, 0x846CA68B, 16)  # shift, multiply, shift, multiply, shift
_WORDS = {64: jnp.uint32, 32: jnp.uint32, 16: jnp.uint16, 8: jnp.uint8, 4: jnp.uint4}


def words(x: jax.Array) -> jax.Array:
    """`x`'s bits as uint32 words: one per element (a trailing axis of 2 for 64-bit dtypes)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = jax.dtypes.itemsize_bits(x.dtype)
    if bits not in _WORDS:
        raise TypeError(f"cannot digest arrays of dtype {x.dtype}")
    return lax.bitcast_convert_type(x, _WORDS[bits]).astype(jnp.uint32)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """uint32 [*shape]: each element's row-major flat index, modulo 2**32 (built from iotas)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        iota = lax.broadcasted_iota(jnp.uint32, shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _add_pairs(a: tuple, b: tuple) -> tuple:
    """The reduction of `leaf_digest`: both sums at once."""
    return a[0] + b[0], a[1] + b[1]


def mix(i: jax.Array) -> jax.Array:
    """uint32: an integer mixing function of `i` (xor-shifts and odd multiplications)."""
    for k, step in enumerate(_MIX):
        i = i ^ (i >> jnp.uint32(step)) if k % 2 == 0 else i * jnp.uint32(step)
    return i


def leaf_digest(x: jax.Array) -> jax.Array:
    """uint32 [2]: the two weighted sums of `x`'s words (see the module docstring)."""
    w = words(x)
    i = _flat_index(w.shape)
    odd = i * jnp.uint32(2) + jnp.uint32(1)
    hashed = mix(i) | jnp.uint32(1)
    zero = jnp.uint32(0)
    # One reduction of two operands: one pass over `x` (two jnp.sum calls take about four
    # times as long on CPU).
    d1, d2 = lax.reduce((w * odd, w * hashed), (zero, zero), _add_pairs, tuple(range(w.ndim)))
    return jnp.stack([d1, d2])


def _all_digests(leaves: list[jax.Array]) -> jax.Array:
    """uint32 [len(leaves), 2]: every leaf's digest."""
    if not leaves:
        return jnp.zeros((0, 2), jnp.uint32)
    return jnp.stack([leaf_digest(x) for x in leaves])


@functools.cache
def _program(mesh: Mesh | None):
    """The jitted `_all_digests` whose result every device of `mesh` holds whole (so every
    process can read it); jit caches its compilations per shapes, dtypes and shardings."""
    out = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    return jax.jit(_all_digests, out_shardings=out)


def _mesh_of(leaves: list) -> Mesh | None:
    """The mesh of the first leaf laid out on one, if any."""
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return None


def _on_device(x):
    """`x` in device memory (an offloaded leaf lives in host memory, which XLA's arithmetic
    cannot mix with device arrays)."""
    sharding = getattr(x, "sharding", None)
    kind = getattr(sharding, "memory_kind", None)
    if kind is not None and kind != "device" and hasattr(sharding, "with_memory_kind"):
        return jax.device_put(x, sharding.with_memory_kind("device"))
    return x


def array_digests(tree: Any) -> dict[str, tuple[int, int]]:
    """Tree path (``params/head/kernel``) → the digest of that array leaf.

    One jitted call on the arrays where they are, one small fetch to the host. In a
    multi-process job every process must call it (a global computation); all get the same
    values.
    """
    named = jax.tree_util.tree_leaves_with_path(tree)
    leaves = [_on_device(x) for _, x in named]
    table = np.asarray(_program(_mesh_of(leaves))(leaves))  # uint32 [leaves, 2]
    return {path_str(p): (int(a), int(b)) for (p, _), (a, b) in zip(named, table, strict=True)}


def json_digest(item: Any) -> str:
    """A hash of a JSON item as it reads back (tuples as lists, keys as strings), sorted keys."""
    plain = json.loads(json.dumps(item))
    text = json.dumps(plain, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]
