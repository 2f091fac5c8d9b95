"""Flash attention: an online-softmax forward that saves logsumexp, and a two-kernel backward.

Layout is the model's own, ``[batch, seq, heads, head_dim]``: each grid cell reads a
``[block, head_dim]`` window, so nothing is transposed on the way in or out. Grouped-query
attention needs no copies either: the key/value index map sends query head h to key/value
head ``h // R``; under tensor parallelism with fewer key/value heads than shards, each shard
picks the ones its query heads use (`_flash_shards.local_kv_heads`). Sequences are zero-padded
up to the block and the padding is masked, so any length works. Memory is O(sequence): the
forward keeps a ``[block_q, head_dim]`` accumulator and writes the output and a ``[B, H, T]``
logsumexp; the backward recomputes the probabilities block by block from that logsumexp.

This module holds the public wrappers and the custom VJP; the pieces live beside it:
`_flash_forward` and `_flash_backward` (the kernels), `_flash_tiles` (a tile's mask and the
sweep over blocks), `_flash_operands` (padding, BlockSpecs, the launch), `_flash_shards` (one
shard's calls and key/value heads), `_flash_checks` (argument checks, block sizes) and
`_flash_blocks` (`block_forward` and `block_backward`, re-exported here).
"""

from __future__ import annotations

import jax

from meshtrain.kernels import _common, reference
from meshtrain.kernels._cudnn_attention import cudnn_attention
from meshtrain.kernels._flash_blocks import block_backward, block_forward
from meshtrain.kernels._flash_checks import DTYPES, HEAD_DIMS, cannot_run, tiling, validate
from meshtrain.kernels._flash_shards import (
    KV_NAMES,
    LSE_NAMES,
    Q_NAMES,
    SEG_NAMES,
    backward_shard,
    forward_shard,
)
from meshtrain.kernels._flash_tiles import Tiling, kv_range, q_range, sees_block
from meshtrain.layout.per_shard import typed_like

__all__ = [
    "DTYPES",
    "HEAD_DIMS",
    "block_backward",
    "block_forward",
    "flash_attention",
    "flash_attention_lse",
]

# The block-range and position tests, under the names the tests use.
_kv_range = kv_range
_q_range = q_range
_sees_block = sees_block


def _pallas_attention(q, k, v, seg, t: Tiling):
    """Attention with the kernels, per shard. The custom VJP sits around the sharded calls
    (see `_common.sharded`): the forward rule runs the forward kernel on each shard and keeps
    its logsumexp; the backward rule runs the two backward kernels on each shard and, where a
    shard picked key/value heads (`local_kv_heads`), adds their gradients back into the
    whole key/value heads and sums them over the shards."""
    heads = q.shape[2]
    segs, seg_names = ((), ()) if seg is None else ((seg,), (SEG_NAMES,))
    shard = dict(heads=heads, interpret=_common.interpret_mode())

    def fwd_shard(q, k, v, *seg, axes):
        return forward_shard(t, q, k, v, axes=axes, segments=_self_segments(seg), **shard)

    def bwd_shard(q, k, v, o, lse, do, *seg, axes):
        dq, dk, dv = backward_shard(
            t, q, k, v, do, lse, o=o, axes=axes, segments=_self_segments(seg), **shard
        )
        return dq, dk.astype(k.dtype), dv.astype(v.dtype)

    def run(q, k, v, *seg):
        args, names = (q, k, v, *seg), (Q_NAMES, KV_NAMES, KV_NAMES, *seg_names)
        return _common.sharded(fwd_shard, args, names, (Q_NAMES, LSE_NAMES), with_axes=True)

    @jax.custom_vjp
    def attend(q, k, v, *seg):
        return run(q, k, v, *seg)[0]

    def attend_fwd(q, k, v, *seg):
        o, lse = run(q, k, v, *seg)
        return o, (q, k, v, seg, o, lse)

    def attend_bwd(res, do):
        q, k, v, seg, o, lse = res
        args = (q, k, v, o, lse, do, *seg)
        names = (Q_NAMES, KV_NAMES, KV_NAMES, Q_NAMES, LSE_NAMES, Q_NAMES, *seg_names)
        outs = (Q_NAMES, KV_NAMES, KV_NAMES)
        grads = _common.sharded(bwd_shard, args, names, outs, with_axes=True)
        # segment ids are integers: no cotangent
        return (*typed_like(grads, (q, k, v)), *(None for _ in seg))

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, k, v, *segs)


def shape_of(q_BTHK, causal: bool) -> dict:
    """An attention call's sizes as the ``auto`` table names them (none for a query of the
    wrong rank, which `validate` then names)."""
    if q_BTHK.ndim != 4:
        return {}
    return {"seq": q_BTHK.shape[1], "head_dim": q_BTHK.shape[3], "causal": causal}


def _self_segments(seg):
    """Self-attention's segment ids as the query and the key ids; None without."""
    return (seg[0], seg[0]) if seg else None


def flash_attention_lse(
    q_BTHK,
    k_BSGK,
    v_BSGK,
    *,
    causal=True,
    window=None,
    block_q=None,
    block_k=None,
    segment_ids=None,
):
    """Forward only, unsharded: ``(out [B, T, H, K], logsumexp [B, H, T])``; for tests."""
    validate(q_BTHK, k_BSGK, v_BSGK, "pallas", causal, window, segment_ids)
    t = tiling(q_BTHK, k_BSGK, causal, window, block_q, block_k)
    segments = None if segment_ids is None else (segment_ids, segment_ids)
    return forward_shard(
        t, q_BTHK, k_BSGK, v_BSGK, heads=q_BTHK.shape[2], axes={},
        interpret=_common.interpret_mode(), segments=segments,
    )  # fmt: skip


def flash_attention(
    q_BTHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    *,
    causal: bool = True,
    window: int | None = None,
    impl: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    segment_ids: jax.Array | None = None,
    warps: int | None = None,
    stages: int | None = None,
) -> jax.Array:
    """Softmax attention ``softmax(q kᵀ / √K) v`` with grouped key/value heads.

    Args:
        q_BTHK: queries [batch, T, heads, head_dim].
        k_BSGK: keys [batch, S, kv_heads, head_dim]; kv_heads divides heads.
        v_BSGK: values, the shape of the keys.
        causal: query i sees keys 0..i (top-left aligned, as `layers.causal_attention`).
        window: with `causal`, query i sees only keys (i − window, i] (a sliding window);
            None: all of 0..i. Key blocks wholly outside the window are skipped.
        impl: ``"pallas"`` (interpreted off the GPU), ``"xla"`` (the jnp reference),
            ``"cudnn"`` (`jax.nn.dot_product_attention`, GPU only) or ``"auto"``.
        block_q: query rows per tile (power of two ≥ 16; default: the configuration tuned for
            the shape on this GPU, else 64, less for short sequences).
        block_k: key rows per inner step (same rule).
        warps, stages: the Triton launch's warps and pipelining stages (default: tuned, else
            4 or 8 by head width, and 2); the interpreter ignores them.
        segment_ids: [batch, T] integers for self-attention over packed documents: query i
            sees key j only when both carry one id (padding, id 0, is one more segment, so
            no row is left empty and nothing is NaN). With ``impl="cudnn"`` each segment must
            be one run of tokens, as packing makes documents (cuDNN's packed layout: an id in
            two runs is two documents).

    Returns:
        [batch, T, heads, head_dim] in the input dtype. Under `activation_rules` the Pallas and
        cuDNN paths run per shard (batch over data × fsdp, heads over tensor); key/value heads
        that the layout keeps whole (fewer than tensor) are picked per shard for its query
        heads.
    """
    impl = _common.resolve_impl(
        impl,
        kernel="flash_attention",
        allowed=_common.ATTENTION_IMPLS,
        shape=shape_of(q_BTHK, causal),
        exclude=cannot_run(
            q_BTHK.shape[-1], q_BTHK.dtype, packed=segment_ids is not None, window=window
        ),
    )
    validate(q_BTHK, k_BSGK, v_BSGK, impl, causal, window, segment_ids)
    if impl == "xla":
        return reference.attention(
            q_BTHK, k_BSGK, v_BSGK, causal=causal, window=window, segment_ids=segment_ids
        )
    if impl == "pallas":
        t = tiling(q_BTHK, k_BSGK, causal, window, block_q, block_k, warps, stages)
        return _pallas_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids, t)
    return cudnn_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids, causal=causal, window=window)
