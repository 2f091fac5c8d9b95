"""cuDNN's fused attention, as meshtrain runs it: per shard, differentiated per shard
(`_shard_vjp`), over plain rows or packed documents.

Packed documents go through cuDNN's own packed layout (each row's documents as offsets and
lengths, Hopper GPUs and later), not a dense [T, T] mask: a shard's segment ids become the
offsets and lengths of its rows' runs of equal ids. Padding (id 0) is one more document, as in
`meshtrain.models.layers.causal_attention`, so every token is covered and none is left empty.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshtrain import _compat
from meshtrain.kernels._flash_shards import KV_NAMES, Q_NAMES, SEG_NAMES, local_kv_heads
from meshtrain.kernels._shard_vjp import sharded_autodiff


def cudnn_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids, *, causal: bool, window: int | None):
    """`flash_attention`'s ``impl="cudnn"`` (arguments checked there)."""
    heads = q_BTHK.shape[2]

    def per_shard(q, k, v, *seg, axes):
        k, v = local_kv_heads(q, k, v, heads=heads, axes=axes)
        if seg:
            lengths, offsets = documents(seg[0])
            return _compat.cudnn_packed_attention(
                q, k, v, lengths, lengths, offsets, offsets, causal=causal
            )
        # (left, right) keys beside the query itself: (window − 1, 0) is (i − window, i].
        local = None if window is None else (window - 1, 0)
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, local_window_size=local, implementation="cudnn"
        )

    segs, seg_names = ((), ()) if segment_ids is None else ((segment_ids,), (SEG_NAMES,))
    args, names = (q_BTHK, k_BSGK, v_BSGK, *segs), (Q_NAMES, KV_NAMES, KV_NAMES, *seg_names)
    return sharded_autodiff(per_shard, args, names, Q_NAMES, with_axes=True)


def documents(segment_ids_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's runs of equal segment ids as cuDNN's packed layout: lengths [B, T] and
    start offsets [B, T + 1] (int32; a row of n runs fills the first n entries, -1 after)."""
    B, T = segment_ids_BT.shape
    starts_BT = jnp.concatenate(
        [jnp.ones((B, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1
    )
    run_BT = jnp.cumsum(starts_BT, axis=1, dtype=jnp.int32) - 1  # each token's run
    runs_B = run_BT[:, -1] + 1
    rows = jnp.arange(B)[:, None]
    lengths = jnp.zeros((B, T), jnp.int32).at[rows, run_BT].add(1)
    lengths = jnp.where(jnp.arange(T) < runs_B[:, None], lengths, -1)
    where = jnp.where(starts_BT, run_BT, T + 1)  # non-starts land past the end and drop
    offsets = jnp.full((B, T + 1), -1, jnp.int32)
    offsets = offsets.at[rows, where].set(jnp.arange(T, dtype=jnp.int32), mode="drop")
    return lengths, offsets
