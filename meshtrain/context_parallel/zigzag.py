"""Zig-zag (head-tail) load balancing of causal attention over ``seq`` devices.

Cut the sequence into ``2n`` equal chunks; device i holds chunks ``i`` and ``2n − 1 − i``.
Under a causal mask the query chunk c sees key chunks 0..c, so device i's queries see
``(i + 1) + (2n − i) = 2n + 1`` chunk pairs whatever i is, where the plain split (chunks
``2i, 2i + 1``) gives ``4i + 3``: an imbalance of ``4(n − 1)`` chunk pairs between the first and
the last device.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np


def order(seq_len: int, n: int) -> np.ndarray:
    """The permutation ``idx`` [seq_len]: position j of the balanced layout holds token
    ``idx[j]``; its n equal slices are the devices' blocks. The identity for ``n = 1``."""
    if n == 1:
        return np.arange(seq_len)
    if seq_len % (2 * n):
        raise ValueError(
            f"context parallelism: sequence length {seq_len} is not divisible by 2 × seq = "
            f"{2 * n} (zig-zag balancing cuts it into 2·seq chunks); use a multiple of {2 * n}"
        )
    c = seq_len // (2 * n)
    chunks = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def inverse(idx: np.ndarray) -> np.ndarray:
    """The permutation that undoes `order`'s ``idx``."""
    inv = np.empty_like(idx)
    inv[idx] = np.arange(len(idx))
    return inv


def causal_chunk_pairs(positions: np.ndarray, n: int, chunks: int) -> list[int]:
    """Per device, the (query chunk, key chunk) pairs with at least one key visible under the
    causal mask, for tokens laid out at global `positions` (device i holds the i-th of n equal
    slices) and the sequence cut into `chunks` equal chunks: the blocks a block-skipping
    attention computes."""
    T = len(positions)
    c = T // chunks
    ok_TS = positions[:, None] >= np.arange(T)[None, :]  # query at positions[t], key s
    # chunk of each (query row, key column), then any visible key per chunk pair
    seen = np.zeros((T, chunks), bool)
    for k in range(chunks):
        seen[:, k] = ok_TS[:, k * c : (k + 1) * c].any(axis=1)
    counts = []
    for i in range(n):
        rows = slice(i * T // n, (i + 1) * T // n)
        q_chunks, rows_seen = positions[rows] // c, seen[rows]
        pairs = {
            (int(q), int(k))
            for q, row in zip(q_chunks, rows_seen, strict=True)
            for k in np.flatnonzero(row)
        }
        counts.append(len(pairs))
    return counts


def naive_counts(n: int) -> list[int]:
    """The closed form of `causal_chunk_pairs` for the plain split into 2n chunks: 4i + 3."""
    return [4 * i + 3 for i in range(n)]


# --- the half-work ring: which (query rows, key rows) pieces causal attention needs ---------
#
# Device i holds chunks i and 2n − 1 − i (c tokens each: local rows [0, c) and [c, 2c)). When
# the block of device j ≠ i is in hand, causal attention needs exactly half of the pairs:
#   j < i: key chunk j is below both query chunks (all visible) and key chunk 2n − 1 − j above
#          both (none): every query row against the first c key rows;
#   j > i: query chunk i is below both key chunks (none), query chunk 2n − 1 − i above both
#          (all): the last c query rows against every key row.
# Both are two c × c pieces, (h, 0) and (c, h) with h = 0 if j < i else c, so one static shape
# serves every step. The own block (j = i) needs the second chunk against the first in full
# and two causal diagonals; each diagonal is halved recursively (its lower-left quarter in full,
# its two half-size diagonals again) while the halves keep at least `leaf` rows.


class Piece(NamedTuple):
    """Local query rows [q, q + nq) against local key rows [k, k + nk) of one device's block
    (a start may be a traced index)."""

    q: Any
    k: Any
    nq: int
    nk: int


def is_balanced(positions, n: int) -> bool:
    """Whether `positions` is concretely ``order(T, n)`` with T a multiple of 2n (the layout
    the half-work ring needs); False for a traced array."""
    if isinstance(positions, jax.core.Tracer):
        return False
    positions = np.asarray(positions)
    T = positions.shape[0] if positions.ndim == 1 else 0
    if T == 0 or T % (2 * n):
        return False
    return bool(np.array_equal(positions, order(T, n)))


def diagonal_depth(c: int, leaf: int) -> int:
    """How many times a causal diagonal of c rows is halved: while the halves keep ≥ `leaf`
    rows (and c stays even)."""
    depth = 0
    while c % 2 == 0 and c // 2 >= max(leaf, 1):
        c, depth = c // 2, depth + 1
    return depth


def own_groups(c: int, leaf: int) -> list[tuple[Piece, ...]]:
    """The pieces of a device's own block (chunks of c rows), in groups: the pieces of a group
    share their shape and the shift between query and key positions, so one call computes
    them stacked on the batch axis with the first piece's positions."""
    # the second chunk against the first: all visible
    groups: list[tuple[Piece, ...]] = [(Piece(c, 0, c, c),)]
    starts, size = [0, c], c  # diagonals: rows [s, s + size) against keys [s, s + size)
    for _ in range(diagonal_depth(c, leaf)):
        half = size // 2
        groups.append(tuple(Piece(s + half, s, half, half) for s in starts))
        starts, size = [t for s in starts for t in (s, s + half)], half
    groups.append(tuple(Piece(s, s, size, size) for s in starts))
    return groups


def step_groups(i, j, c: int) -> list[tuple[Piece, ...]]:
    """The two c × c pieces device `i` computes against device `j`'s block (j ≠ i); `i`, `j`
    may be traced indices."""
    h = (j > i) * c  # 0: all queries × first key chunk; c: last query chunk × all keys
    return [(Piece(h, 0, c, c),), (Piece(c, h, c, c),)]


def half_pairs(n: int, c: int, leaf: int) -> int:
    """Closed form of the (query, key) pairs each device computes under the half-work ring
    (forward, and again in the backward): ``2n·c² + c·s`` with ``s = c / 2^depth`` the leaf
    diagonal's rows; the own block gives ``2c² + c·s`` and each of the n − 1 hops ``2c²``.
    The whole-block ring computes ``4n·c²``; the causal pairs are ``2n·c² + c``."""
    s = c >> diagonal_depth(c, leaf)
    return 2 * n * c * c + c * s
