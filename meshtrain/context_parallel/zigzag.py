"""Zig-zag (head-tail) load balancing of causal attention over ``seq`` devices.

Cut the sequence into ``2n`` equal chunks; device i holds chunks ``i`` and ``2n − 1 − i``.
Under a causal mask the query chunk c sees key chunks 0..c, so device i's queries see
``(i + 1) + (2n − i) = 2n + 1`` chunk pairs whatever i is, where the plain split (chunks
``2i, 2i + 1``) gives ``4i + 3``: an imbalance of ``4(n − 1)`` chunk pairs between the first and
the last device.
"""

from __future__ import annotations

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
