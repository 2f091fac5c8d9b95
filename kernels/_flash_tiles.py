"""Inside the flash kernels: float32 tile products, a tile's mask, and the sweep over blocks.

Each grid cell fixes one block (of queries, or of keys) and visits the blocks of the other side
that it can see; `sweep` runs that loop, handing each visited tile and its mask to a step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from meshtrain.kernels import _common

NEG = -1e30  # masked score; finite so that max() of a fully masked row stays finite
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tiling:
    """What a flash kernel fixes when traced: the mask's rule, the block sizes and the true
    (unpadded) sequence lengths."""

    causal: bool
    window: int | None
    bq: int
    bk: int
    seq_q: int
    seq_k: int
    warps: int = 0  # Triton warps per program (0: 4 for head width 64, 8 above)
    stages: int = 2  # Triton software-pipelining stages

    @property
    def padded_q(self) -> int:
        """The query length padded up to whole blocks."""
        return _common.cdiv(self.seq_q, self.bq) * self.bq

    @property
    def padded_k(self) -> int:
        """The key length padded up to whole blocks."""
        return _common.cdiv(self.seq_k, self.bk) * self.bk


class MaskInputs(NamedTuple):
    """The optional inputs that shape the mask: query and key segment ids, then query and key
    positions; arrays outside the kernels, refs inside, None where absent."""

    seg_q: Any = None
    seg_k: Any = None
    pos_q: Any = None
    pos_k: Any = None


class Span(NamedTuple):
    """One block along a sequence: its indices, and its segment ids and positions (or None)."""

    ids: jax.Array
    seg: jax.Array | None
    pos: jax.Array | None


def softmax_scale(head_dim: int) -> float:
    """``1 / √head_dim``, the scale of the scores."""
    return 1.0 / math.sqrt(head_dim)


def dot_nt(a, b):
    """``a @ b.T`` in float32 (contracting the last dimension of both)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def dot_tn(a, b):
    """``a.T @ b`` in float32 (contracting the first dimension of both)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=F32)


def dot(a, b):
    """``a @ b`` in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32)


def load(ref, start=None, size=None):
    """``ref[start:start+size]`` (all of it without `start`), or None for no ref."""
    if ref is None:
        return None
    return ref[...] if start is None else ref[pl.ds(start, size)]


def span(b, size: int, seg_ref, pos_ref, *, whole: bool) -> Span:
    """Block `b` of `size` rows; its segment ids and positions come from the refs, which hold
    just this block (`whole`) or the whole sequence."""
    start = None if whole else b * size
    ids = b * size + lax.iota(jnp.int32, size)
    return Span(ids, load(seg_ref, start, size), load(pos_ref, start, size))


def mask(t: Tiling, q: Span, k: Span):
    """Valid (query, key) pairs of a tile: inside both sequences and, if causal, col ≤ row
    (and, with a window, row − col < window); with segment ids, of one segment. With
    positions (the tile's global query and key positions) the causal mask and the window
    compare those instead of the local indices."""
    ok = (q.ids[:, None] < t.seq_q) & (k.ids[None, :] < t.seq_k)
    at_q, at_k = (q.ids, k.ids) if q.pos is None else (q.pos, k.pos)
    if t.causal:
        ok = ok & (at_q[:, None] >= at_k[None, :])
    if t.window is not None:
        ok = ok & (at_q[:, None] - at_k[None, :] < t.window)
    if q.seg is not None:
        ok = ok & (q.seg[:, None] == k.seg[None, :])
    return ok


def kv_range(i, block_q, block_k, n_kv, causal, window, *, positioned=False):
    """Key blocks ``[lo, hi)`` query block `i` must visit: causal, only those at or left of the
    diagonal; with a window, none wholly left of it either. With global positions
    (`positioned`) blocks are not contiguous in position: all of them (`sees_block` skips)."""
    if not causal or positioned:
        return 0, n_kv
    # lax.div truncates, which is floor division for these non-negative operands, and lowers
    # to one instruction (jnp's // adds sign fix-ups).
    hi = jnp.minimum(n_kv, lax.div((i + 1) * block_q + block_k - 1, block_k))
    if window is None:
        return 0, hi
    return lax.div(jnp.maximum(i * block_q - window + 1, 0), block_k), hi


def q_range(j, block_q, block_k, n_q, causal, window, *, positioned=False):
    """Query blocks ``[lo, hi)`` that see some key of key block `j` (all of them with global
    positions, as in `kv_range`)."""
    if not causal or positioned:
        return 0, n_q
    lo = lax.div(j * block_k, block_q)  # earlier query blocks see none of these keys
    if window is None:
        return lo, n_q
    # The last query that sees key (j + 1)·bk − 1 is that key + window − 1.
    return lo, jnp.minimum(n_q, lax.div((j + 1) * block_k + window - 2, block_q) + 1)


def sees_block(fixed_pos, load_pos, causal, window, *, fixed_rows=True):
    """``j → whether any (query, key) pair of the tile at loop step j is visible`` from the
    global positions (the fixed block's `fixed_pos`, the visited block's ``load_pos(j)``); None
    when nothing can be skipped (no positions, or not causal). Conservative: it compares the
    blocks' position ranges only, and the mask still decides each pair."""
    if fixed_pos is None or not causal:
        return None

    def sees(j):
        other = load_pos(j)
        q_pos, k_pos = (fixed_pos, other) if fixed_rows else (other, fixed_pos)
        ok = q_pos.max() >= k_pos.min()
        if window is not None:
            ok = ok & (q_pos.min() - k_pos.max() < window)
        return ok

    return sees


def skip_unseen(body, sees):
    """A `fori_loop` body that leaves its carry alone at the steps where `sees` says no pair
    is visible (`body` itself when `sees` is None)."""
    if sees is None:
        return body

    def skipping(j, carry):
        return lax.cond(sees(j), body, lambda _, c: c, j, carry)

    return skipping


def sweep(t: Tiling, extra: MaskInputs, refs, step, init, *, over_keys: bool):
    """Loops over the blocks the grid cell's block ``program_id(2)`` sees: with `over_keys`
    the key blocks of that query block, else the query blocks of that key block.

    At each visited block, ``step(tiles, ok, carry)`` gets that block's slices of `refs` (each
    sliced along the visited side) and the tile's mask, and returns the new carry. Blocks
    outside the causal range (`kv_range`, `q_range`) are not visited, and with positions those
    that `sees_block` rules out are skipped. Returns the last carry.
    """
    me = pl.program_id(2)
    if over_keys:
        mine, theirs = (t.bq, extra.seg_q, extra.pos_q), (t.bk, extra.seg_k, extra.pos_k)
    else:
        mine, theirs = (t.bk, extra.seg_k, extra.pos_k), (t.bq, extra.seg_q, extra.pos_q)
    fixed = span(me, *mine, whole=True)
    size, pos_ref = theirs[0], theirs[2]
    n = refs[0].shape[0] // size

    def body(b, carry):
        other = span(b, *theirs, whole=False)
        ok = mask(t, fixed, other) if over_keys else mask(t, other, fixed)
        return step([load(ref, b * size, size) for ref in refs], ok, carry)

    def load_pos(b):
        return pos_ref[pl.ds(b * size, size)]

    sees = sees_block(fixed.pos, load_pos, t.causal, t.window, fixed_rows=over_keys)
    blocks = kv_range if over_keys else q_range
    lo, hi = blocks(me, t.bq, t.bk, n, t.causal, t.window, positioned=fixed.pos is not None)
    return lax.fori_loop(lo, hi, skip_unseen(body, sees), init)
