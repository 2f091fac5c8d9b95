"""Flash attention at global positions, one block at a time: context parallelism's kernels.

A device holds its queries and visits blocks of keys and values; the mask compares the
global positions of both, so the blocks may come in any order (a ring, a zigzag). Forward
and backward are separate calls with no custom VJP: `meshtrain.context_parallel.blocks`
merges the partial results and defines the gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain.kernels import _common
from meshtrain.kernels._flash_checks import check_block, tiling
from meshtrain.kernels._flash_shards import (
    KV_NAMES,
    LSE_NAMES,
    Q_NAMES,
    SEG_NAMES,
    backward_shard,
    forward_shard,
)
from meshtrain.kernels._flash_tiles import F32, Tiling


def block_forward(
    q_BTHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    q_pos_T: jax.Array,
    k_pos_S: jax.Array,
    *,
    causal: bool,
    window: int | None,
    q_segments: jax.Array | None = None,
    k_segments: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One block of attention at global positions, forward only (context parallelism).

    Args:
        q_BTHK: this device's queries [batch, T, heads, head_dim] (head_dim 64 or 128,
            float32 or bfloat16).
        k_BSGK, v_BSGK: a block of keys and values [batch, S, kv_heads, head_dim].
        q_pos_T, k_pos_S: the global positions (int) of those queries and keys: with `causal`
            query t sees key s when ``q_pos[t] >= k_pos[s]`` (and, with `window`,
            ``q_pos[t] − k_pos[s] < window``).
        causal: mask keys at later positions; without it `window` is ignored.
        window: see `q_pos_T`; None: no window.
        q_segments, k_segments: [batch, T] and [batch, S] integer segment ids (both or
            none): a query sees only keys of its own segment.

    Returns:
        ``(out [B, T, H, K] float32, lse [B, G, R, T] float32)``, the layout of
        `meshtrain.context_parallel.blocks`: the output is float32 whatever the input dtype,
        so partial results merge without rounding. A query that sees no key of the block gets
        an output of 0 and an lse of -1e30 (merging weighs it 0). No custom VJP: call it
        inside a custom-VJP rule (`block_backward` is the backward). Runs per shard under the
        active layout (batch over data × fsdp, heads over tensor).
    """
    t = _block_tiling(
        q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, causal, window, q_segments, k_segments
    )
    B, T, H, _ = q_BTHK.shape
    G = k_BSGK.shape[2]
    interpret = _common.interpret_mode()

    def per_shard(q, k, v, q_pos, k_pos, *segs, axes):
        return forward_shard(
            t, q, k, v, heads=H, axes=axes, interpret=interpret, out_dtype=F32,
            segments=segs or None, positions=(q_pos, k_pos),
        )  # fmt: skip

    args, names = _block_args(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, q_segments, k_segments)
    o, lse_BHT = _common.sharded(per_shard, args, names, (Q_NAMES, LSE_NAMES), with_axes=True)
    return o, lse_BHT.reshape(B, G, H // G, T)


def block_backward(
    q_BTHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    q_pos_T: jax.Array,
    k_pos_S: jax.Array,
    do_BTHK: jax.Array,
    lse_BGRT: jax.Array,
    delta_BGRT: jax.Array,
    *,
    causal: bool,
    window: int | None,
    q_segments: jax.Array | None = None,
    k_segments: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block's contributions to the gradients of attention at global positions.

    Args:
        q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, causal, window, q_segments, k_segments:
            as `block_forward`.
        do_BTHK: the cotangent of the whole attention's output [batch, T, heads, head_dim].
        lse_BGRT: the whole attention's log-sum-exp [batch, kv_heads, heads / kv_heads, T]
            (every block merged), as `meshtrain.context_parallel.blocks` keeps it.
        delta_BGRT: ``rowsum(out · do)`` in the same layout (`blocks.delta`).

    Returns:
        ``(dq [B, T, H, K], dk [B, S, G, K], dv [B, S, G, K])``, float32. Runs per shard like
        `block_forward`; key/value heads a shard picked for its query heads get their
        gradients summed back over the shards that picked them.
    """
    t = _block_tiling(
        q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, causal, window, q_segments, k_segments
    )
    B, T, H, _ = q_BTHK.shape
    interpret = _common.interpret_mode()

    def per_shard(q, k, v, q_pos, k_pos, do, lse, delta, *segs, axes):
        return backward_shard(
            t, q, k, v, do, lse, delta=delta, heads=H, axes=axes, interpret=interpret,
            grad_dtype=F32, segments=segs or None, positions=(q_pos, k_pos),
        )  # fmt: skip

    args, names = _block_args(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, q_segments, k_segments)
    rows = (lse_BGRT.reshape(B, H, T), delta_BGRT.reshape(B, H, T))
    args = (*args[:5], do_BTHK.astype(q_BTHK.dtype), *rows, *args[5:])
    names = (*names[:5], Q_NAMES, LSE_NAMES, LSE_NAMES, *names[5:])
    outs = (Q_NAMES, KV_NAMES, KV_NAMES)
    return _common.sharded(per_shard, args, names, outs, with_axes=True)


def _block_tiling(q, k, v, q_pos, k_pos, causal, window, q_segments, k_segments) -> Tiling:
    """Checks a block's arguments and tiles it (a window only with `causal`)."""
    window = window if causal else None
    check_block(q, k, v, q_pos, k_pos, causal, window, q_segments, k_segments)
    return tiling(q, k, causal, window)


def _block_args(q, k, v, q_pos, k_pos, q_segments, k_segments):
    """The arguments of a block's `sharded` call and their logical names."""
    args = (q, k, v, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32))
    names = (Q_NAMES, KV_NAMES, KV_NAMES, (None,), (None,))
    if q_segments is not None:
        args += (q_segments.astype(jnp.int32), k_segments.astype(jnp.int32))
        names += (SEG_NAMES, SEG_NAMES)
    return args, names
