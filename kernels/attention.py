"""Flash attention: an online-softmax forward that saves logsumexp, and a two-kernel backward.

Layout is the model's own, ``[batch, seq, heads, head_dim]``: each grid cell reads a
``[block, head_dim]`` window, so nothing is transposed on the way in or out. Grouped-query
attention needs no copies either: the key/value index map sends query head h to key/value
head ``h // R``; under tensor parallelism with fewer key/value heads than shards, each shard
picks the ones its query heads use (`_local_kv_heads`). Sequences are zero-padded up to the
block and the padding is masked, so any length works. Memory is O(sequence): the forward keeps
a ``[block_q, head_dim]`` accumulator and writes the output and a ``[B, H, T]`` logsumexp; the
backward recomputes the probabilities block by block from that logsumexp.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from meshtrain.kernels import _common, reference

HEAD_DIMS = (64, 128)
DTYPES = (jnp.float32, jnp.bfloat16)
_NEG = -1e30  # masked score; finite so that max() of a fully masked row stays finite
_F32 = jnp.float32


def _dot_nt(a, b):
    """``a @ b.T`` in float32 (contracting the last dimension of both)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _dot_tn(a, b):
    """``a.T @ b`` in float32 (contracting the first dimension of both)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=_F32)


def _dot(a, b):
    """``a @ b`` in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32)


def _mask(
    rows, cols, seq_q, seq_k, causal, window, seg_rows=None, seg_cols=None, *,
    pos_rows=None, pos_cols=None,
):  # fmt: skip
    """Valid (query, key) pairs of a tile: inside both sequences and, if causal, col ≤ row
    (and, with a window, row − col < window); with segment ids, of one segment. With
    positions (`pos_rows`, `pos_cols`: the tile's global query and key positions) the causal
    mask and the window compare those instead of the local indices."""
    ok = (rows[:, None] < seq_q) & (cols[None, :] < seq_k)
    at_q, at_k = (rows, cols) if pos_rows is None else (pos_rows, pos_cols)
    if causal:
        ok = ok & (at_q[:, None] >= at_k[None, :])
    if window is not None:
        ok = ok & (at_q[:, None] - at_k[None, :] < window)
    if seg_rows is not None:
        ok = ok & (seg_rows[:, None] == seg_cols[None, :])
    return ok


def _segments_optional(kernel, n_in: int, segmented: bool):
    """`kernel`, whose refs after the first `n_in` inputs are the query and key segment ids;
    without segments the call has no such refs, and the kernel gets None for both."""
    if segmented:
        return kernel

    def run(*refs, **static):
        return kernel(*refs[:n_in], None, None, *refs[n_in:], **static)

    return run


def _load(ref, start=None, size=None):
    """``ref[start:start+size]`` (all of it without `start`), or None for no ref."""
    if ref is None:
        return None
    return ref[...] if start is None else ref[pl.ds(start, size)]


def _kv_range(i, block_q, block_k, n_kv, causal, window, *, positioned=False):
    """Key blocks ``[lo, hi)`` query block `i` must visit: causal, only those at or left of the
    diagonal; with a window, none wholly left of it either. With global positions
    (`positioned`) blocks are not contiguous in position: all of them (`_sees` skips)."""
    if not causal or positioned:
        return 0, n_kv
    # lax.div truncates, which is floor division for these non-negative operands, and lowers
    # to one instruction (jnp's // adds sign fix-ups).
    hi = jnp.minimum(n_kv, lax.div((i + 1) * block_q + block_k - 1, block_k))
    if window is None:
        return 0, hi
    return lax.div(jnp.maximum(i * block_q - window + 1, 0), block_k), hi


def _q_range(j, block_q, block_k, n_q, causal, window, *, positioned=False):
    """Query blocks ``[lo, hi)`` that see some key of key block `j` (all of them with global
    positions, as in `_kv_range`)."""
    if not causal or positioned:
        return 0, n_q
    lo = lax.div(j * block_k, block_q)  # earlier query blocks see none of these keys
    if window is None:
        return lo, n_q
    # The last query that sees key (j + 1)·bk − 1 is that key + window − 1.
    return lo, jnp.minimum(n_q, lax.div((j + 1) * block_k + window - 2, block_q) + 1)


# --- forward ----------------------------------------------------------------------------


def _fwd_kernel(
    q_ref,
    k_ref,
    v_ref,
    sq_ref,
    sk_ref,
    pq_ref,
    pk_ref,
    o_ref,
    lse_ref,
    *,
    scale,
    causal,
    window,
    bq,
    bk,
    seq_q,
    seq_k,
):
    i = pl.program_id(2)
    q = q_ref[...]
    rows = i * bq + lax.iota(jnp.int32, bq)
    seg_rows = _load(sq_ref)
    pos_rows = _load(pq_ref)
    n_kv = k_ref.shape[0] // bk

    def body(j, carry):
        acc, m, denom = carry
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        cols = j * bk + lax.iota(jnp.int32, bk)
        seg_cols = _load(sk_ref, j * bk, bk)
        pos_cols = _load(pk_ref, j * bk, bk)
        ok = _mask(
            rows, cols, seq_q, seq_k, causal, window, seg_rows, seg_cols,
            pos_rows=pos_rows, pos_cols=pos_cols,
        )  # fmt: skip
        s = jnp.where(ok, _dot_nt(q, k) * scale, _NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        denom = denom * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, denom

    head_dim = q_ref.shape[-1]
    init = (
        jnp.zeros((bq, head_dim), _F32),
        jnp.full((bq,), _NEG, _F32),
        jnp.zeros((bq,), _F32),
    )
    sees = _sees_block(pos_rows, lambda j: pk_ref[pl.ds(j * bk, bk)], causal, window)
    lo, hi = _kv_range(i, bq, bk, n_kv, causal, window, positioned=pq_ref is not None)
    acc, m, denom = lax.fori_loop(lo, hi, _skip_unseen(body, sees), init)
    # Rows with no visible key (padding, or a block wholly masked by positions) get an output
    # of 0 and a logsumexp of _NEG, which a merge of partial results weighs 0.
    denom = jnp.where(denom == 0.0, 1.0, denom)
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(denom)


def _specs(B, H, G, Tp, Sp, K, bq, bk):
    """BlockSpecs shared by the kernels: query tiles, whole key/value rows of one head, etc."""
    R = H // G
    return dict(
        q_tile=pl.BlockSpec((None, bq, None, K), lambda b, h, i: (b, i, h, 0)),
        q_all=pl.BlockSpec((None, Tp, None, K), lambda b, h, j: (b, 0, h, 0)),
        kv_all=pl.BlockSpec((None, Sp, None, K), lambda b, h, i: (b, 0, h // R, 0)),
        kv_tile=pl.BlockSpec((None, bk, None, K), lambda b, h, j: (b, j, h // R, 0)),
        kvh_tile=pl.BlockSpec((None, bk, None, K), lambda b, h, j: (b, j, h, 0)),
        row_tile=pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
        row_all=pl.BlockSpec((None, None, Tp), lambda b, h, j: (b, h, 0)),
        seg_q_tile=pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),
        seg_q_all=pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0)),
        seg_k_all=pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0)),
        seg_k_tile=pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
        pos_q_tile=pl.BlockSpec((bq,), lambda b, h, i: (i,)),
        pos_q_all=pl.BlockSpec((Tp,), lambda b, h, j: (0,)),
        pos_k_all=pl.BlockSpec((Sp,), lambda b, h, i: (0,)),
        pos_k_tile=pl.BlockSpec((bk,), lambda b, h, j: (j,)),
    )


def _pad_inputs(q, k, v, bq, bk):
    """Pads the query and key sequences up to whole blocks."""
    Tp = _common.cdiv(q.shape[1], bq) * bq
    Sp = _common.cdiv(k.shape[1], bk) * bk
    return _common.pad_to(q, 1, Tp), _common.pad_to(k, 1, Sp), _common.pad_to(v, 1, Sp)


def _pad_segments(seg, bq, bk):
    """The query and key segment ids [B, Tp] and [B, Sp], padded (with 0) to whole blocks;
    (None, None) without segments."""
    if seg is None:
        return None, None
    seg = seg.astype(jnp.int32)
    T = seg.shape[1]
    return (
        _common.pad_to(seg, 1, _common.cdiv(T, bq) * bq),
        _common.pad_to(seg, 1, _common.cdiv(T, bk) * bk),
    )


def _fwd_call(
    q, k, v, sq, sk, *, causal, window, bq, bk, seq_q, seq_k, interpret,
    q_pos=None, k_pos=None, out_dtype=None,
):  # fmt: skip
    """Runs the forward kernel on padded q, k, v (and padded segment ids, or None); with
    `q_pos`, `k_pos` (padded int32 [Tp], [Sp]) the mask follows those global positions.
    The output is in `out_dtype` (default: the input dtype)."""
    B, Tp, H, K = q.shape
    Sp, G = k.shape[1], k.shape[2]
    sp = _specs(B, H, G, Tp, Sp, K, bq, bk)
    segmented, positioned = sq is not None, q_pos is not None
    kernel = functools.partial(
        _optional_refs(_fwd_kernel, 3, (segmented, positioned)),
        scale=1.0 / math.sqrt(K),
        causal=causal,
        window=window,
        bq=bq,
        bk=bk,
        seq_q=seq_q,
        seq_k=seq_k,
    )
    return _common.pallas_call(
        kernel,
        grid=(B, H, Tp // bq),
        in_specs=[sp["q_tile"], sp["kv_all"], sp["kv_all"]]
        + ([sp["seg_q_tile"], sp["seg_k_all"]] if segmented else [])
        + ([sp["pos_q_tile"], sp["pos_k_all"]] if positioned else []),
        out_specs=[sp["q_tile"], sp["row_tile"]],
        out_shape=[
            jax.ShapeDtypeStruct((B, Tp, H, K), out_dtype or q.dtype),
            jax.ShapeDtypeStruct((B, H, Tp), _F32),
        ],
        compiler_params=_common.triton_params(4 if K <= 64 else 8, 2),
        interpret=interpret,
        name="flash_attention_fwd",
    )(q, k, v, *((sq, sk) if segmented else ()), *((q_pos, k_pos) if positioned else ()))


# --- backward ---------------------------------------------------------------------------


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    sq_ref,
    sk_ref,
    pq_ref,
    pk_ref,
    dq_ref,
    *,
    scale,
    causal,
    window,
    bq,
    bk,
    seq_q,
    seq_k,
):
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    rows = i * bq + lax.iota(jnp.int32, bq)
    seg_rows = _load(sq_ref)
    pos_rows = _load(pq_ref)
    n_kv = k_ref.shape[0] // bk

    def body(j, dq):
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        cols = j * bk + lax.iota(jnp.int32, bk)
        seg_cols = _load(sk_ref, j * bk, bk)
        pos_cols = _load(pk_ref, j * bk, bk)
        ok = _mask(
            rows, cols, seq_q, seq_k, causal, window, seg_rows, seg_cols,
            pos_rows=pos_rows, pos_cols=pos_cols,
        )  # fmt: skip
        p = jnp.where(ok, jnp.exp(_dot_nt(q, k) * scale - lse[:, None]), 0.0)
        ds = p * (_dot_nt(do, v) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = jnp.zeros(q.shape, _F32)
    sees = _sees_block(pos_rows, lambda j: pk_ref[pl.ds(j * bk, bk)], causal, window)
    lo, hi = _kv_range(i, bq, bk, n_kv, causal, window, positioned=pq_ref is not None)
    dq = lax.fori_loop(lo, hi, _skip_unseen(body, sees), dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    sq_ref,
    sk_ref,
    pq_ref,
    pk_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    causal,
    window,
    bq,
    bk,
    seq_q,
    seq_k,
):
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    cols = j * bk + lax.iota(jnp.int32, bk)
    seg_cols = _load(sk_ref)
    pos_cols = _load(pk_ref)
    n_q = q_ref.shape[0] // bq

    def body(i, carry):
        dk, dv = carry
        q = q_ref[pl.ds(i * bq, bq), :]
        do = do_ref[pl.ds(i * bq, bq), :]
        lse = lse_ref[pl.ds(i * bq, bq)]
        delta = delta_ref[pl.ds(i * bq, bq)]
        rows = i * bq + lax.iota(jnp.int32, bq)
        seg_rows = _load(sq_ref, i * bq, bq)
        pos_rows = _load(pq_ref, i * bq, bq)
        ok = _mask(
            rows, cols, seq_q, seq_k, causal, window, seg_rows, seg_cols,
            pos_rows=pos_rows, pos_cols=pos_cols,
        )  # fmt: skip
        p = jnp.where(ok, jnp.exp(_dot_nt(q, k) * scale - lse[:, None]), 0.0)
        dv = dv + _dot_tn(p.astype(do.dtype), do)
        ds = p * (_dot_nt(do, v) - delta[:, None])
        dk = dk + _dot_tn(ds.astype(q.dtype), q)
        return dk, dv

    zeros = jnp.zeros(k.shape, _F32)
    sees = None
    if pos_cols is not None:
        sees = _sees_block(
            pos_cols, lambda i: pq_ref[pl.ds(i * bq, bq)], causal, window, fixed_rows=False
        )
    lo, hi = _q_range(j, bq, bk, n_q, causal, window, positioned=pk_ref is not None)
    dk, dv = lax.fori_loop(lo, hi, _skip_unseen(body, sees), (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _bwd_calls(
    q, k, v, do, lse, delta, sq, sk, *, causal, window, bq, bk, seq_q, seq_k, interpret,
    q_pos=None, k_pos=None, grad_dtype=None,
):  # fmt: skip
    """Runs the dq kernel and the dk/dv kernel on padded arrays; dk, dv per query head. With
    `q_pos`, `k_pos` (padded int32) the mask follows those global positions. The gradients
    are in `grad_dtype` (default: their inputs' dtypes)."""
    B, Tp, H, K = q.shape
    Sp, G = k.shape[1], k.shape[2]
    sp = _specs(B, H, G, Tp, Sp, K, bq, bk)
    static = dict(
        scale=1.0 / math.sqrt(K),
        causal=causal,
        window=window,
        bq=bq,
        bk=bk,
        seq_q=seq_q,
        seq_k=seq_k,
    )
    params = _common.triton_params(4 if K <= 64 else 8, 2)
    segmented, positioned = sq is not None, q_pos is not None
    extra = ((sq, sk) if segmented else ()) + ((q_pos, k_pos) if positioned else ())
    present = (segmented, positioned)
    dq = _common.pallas_call(
        functools.partial(_optional_refs(_dq_kernel, 6, present), **static),
        grid=(B, H, Tp // bq),
        in_specs=[
            sp["q_tile"],
            sp["kv_all"],
            sp["kv_all"],
            sp["q_tile"],
            sp["row_tile"],
            sp["row_tile"],
        ]
        + ([sp["seg_q_tile"], sp["seg_k_all"]] if segmented else [])
        + ([sp["pos_q_tile"], sp["pos_k_all"]] if positioned else []),
        out_specs=sp["q_tile"],
        out_shape=jax.ShapeDtypeStruct(q.shape, grad_dtype or q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta, *extra)
    # dk and dv come out per query head in float32 and are summed over each group outside.
    dkh, dvh = _common.pallas_call(
        functools.partial(_optional_refs(_dkv_kernel, 6, present), **static),
        grid=(B, H, Sp // bk),
        in_specs=[
            sp["q_all"],
            sp["kv_tile"],
            sp["kv_tile"],
            sp["q_all"],
            sp["row_all"],
            sp["row_all"],
        ]
        + ([sp["seg_q_all"], sp["seg_k_tile"]] if segmented else [])
        + ([sp["pos_q_all"], sp["pos_k_tile"]] if positioned else []),
        out_specs=[sp["kvh_tile"], sp["kvh_tile"]],
        out_shape=[jax.ShapeDtypeStruct((B, Sp, H, K), _F32)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="flash_attention_dkv",
    )(q, k, v, do, lse, delta, *extra)
    R = H // G
    dk = dkh.reshape(B, Sp, G, R, K).sum(axis=3).astype(grad_dtype or k.dtype)
    dv = dvh.reshape(B, Sp, G, R, K).sum(axis=3).astype(grad_dtype or v.dtype)
    return dq, dk, dv


# --- custom_vjp -------------------------------------------------------------------------


_Q_NAMES = ("batch", None, "heads", None)
_KV_NAMES = ("batch", None, "kv_heads", None)
_LSE_NAMES = ("batch", "heads", None)
_SEG_NAMES = ("batch", None)


def _pallas_attention(q, k, v, seg, *, causal, window, bq, bk, interpret):
    """Attention with the kernels, per shard. The custom VJP sits around the sharded calls
    (see `_common.sharded`): the forward rule runs the forward kernel on each shard and keeps
    its logsumexp; the backward rule runs the two backward kernels on each shard and, where a
    shard picked key/value heads (`_local_kv_heads`), adds their gradients back into the
    whole key/value heads and sums them over the shards."""
    heads = q.shape[2]
    segs, seg_names = ((), ()) if seg is None else ((seg,), (_SEG_NAMES,))
    static = dict(causal=causal, window=window, bq=bq, bk=bk, interpret=interpret)

    def fwd_shard(q, k, v, *seg, axes):
        k, v = _local_kv_heads(q, k, v, heads=heads, axes=axes)
        T, S = q.shape[1], k.shape[1]
        qp, kp, vp = _pad_inputs(q, k, v, bq, bk)
        sq, sk = _pad_segments(seg[0] if seg else None, bq, bk)
        o, lse = _fwd_call(qp, kp, vp, sq, sk, seq_q=T, seq_k=S, **static)
        return o[:, :T], lse[:, :, :T]

    def bwd_shard(q, k, v, o, lse, do, *seg, axes):
        kl, vl = _local_kv_heads(q, k, v, heads=heads, axes=axes)
        T, S = q.shape[1], k.shape[1]
        qp, kp, vp = _pad_inputs(q, kl, vl, bq, bk)
        Tp = qp.shape[1]
        op, dop = (_common.pad_to(x, 1, Tp) for x in (o, do))
        lsep = _common.pad_to(lse, 2, Tp)  # padded rows have do = 0: they add nothing
        delta = jnp.einsum("bthk,bthk->bht", op.astype(_F32), dop.astype(_F32))
        sq, sk = _pad_segments(seg[0] if seg else None, bq, bk)
        dq, dk, dv = _bwd_calls(qp, kp, vp, dop, lsep, delta, sq, sk, seq_q=T, seq_k=S, **static)
        back = functools.partial(_kv_heads_back, q, k, heads=heads, axes=axes)
        return dq[:, :T], back(dk[:, :S]).astype(k.dtype), back(dv[:, :S]).astype(v.dtype)

    def run(q, k, v, *seg):
        args, names = (q, k, v, *seg), (_Q_NAMES, _KV_NAMES, _KV_NAMES, *seg_names)
        return _common.sharded(fwd_shard, args, names, (_Q_NAMES, _LSE_NAMES), with_axes=True)

    @jax.custom_vjp
    def attend(q, k, v, *seg):
        return run(q, k, v, *seg)[0]

    def attend_fwd(q, k, v, *seg):
        o, lse = run(q, k, v, *seg)
        return o, (q, k, v, seg, o, lse)

    def attend_bwd(res, do):
        q, k, v, seg, o, lse = res
        args = (q, k, v, o, lse, do, *seg)
        names = (_Q_NAMES, _KV_NAMES, _KV_NAMES, _Q_NAMES, _LSE_NAMES, _Q_NAMES, *seg_names)
        outs = (_Q_NAMES, _KV_NAMES, _KV_NAMES)
        grads = _common.sharded(bwd_shard, args, names, outs, with_axes=True)
        # segment ids are integers: no cotangent
        return (*_common.typed_like(grads, (q, k, v)), *(None for _ in seg))

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, k, v, *segs)


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
    _validate(q_BTHK, k_BSGK, v_BSGK, "pallas", causal, window, segment_ids)
    bq, bk = _blocks(q_BTHK.shape[1], k_BSGK.shape[1], block_q, block_k)
    T, S = q_BTHK.shape[1], k_BSGK.shape[1]
    qp, kp, vp = _pad_inputs(q_BTHK, k_BSGK, v_BSGK, bq, bk)
    sq, sk = _pad_segments(segment_ids, bq, bk)
    o, lse = _fwd_call(
        qp,
        kp,
        vp,
        sq,
        sk,
        causal=causal,
        window=window,
        bq=bq,
        bk=bk,
        seq_q=T,
        seq_k=S,
        interpret=_common.interpret_mode(),
    )
    return o[:, :T], lse[:, :, :T]


# --- public -----------------------------------------------------------------------------


def _validate(q, k, v, impl, causal, window, segment_ids=None):
    """Clear errors for shapes, head widths, dtypes, windows and segment ids the kernels do
    not take."""
    if window is not None and (not causal or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"flash_attention: window={window!r} (causal={causal}) is not supported; a sliding "
            "window is an integer ≥ 1 and needs causal=True"
        )
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"flash_attention: q, k, v must be [batch, seq, heads, head_dim]; got ranks "
            f"{q.ndim}, {k.ndim}, {v.ndim}"
        )
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k {k.shape} and v {v.shape} must have one shape")
    B, T, H, K = q.shape
    if k.shape[0] != B or k.shape[3] != K:
        raise ValueError(
            f"flash_attention: q {q.shape} and k {k.shape} disagree on batch or head_dim"
        )
    if H % k.shape[2]:
        raise ValueError(
            f"flash_attention: {k.shape[2]} key/value heads do not divide {H} query heads"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"flash_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); "
            "cast them to one dtype"
        )
    if segment_ids is not None:
        if segment_ids.shape != (B, T) or k.shape[1] != T:
            raise ValueError(
                f"flash_attention: segment_ids {segment_ids.shape} must be [batch, seq] = "
                f"{(B, T)} of a self-attention (keys {k.shape[1]}, queries {T})"
            )
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(
                f"flash_attention: segment_ids must be integers, got {segment_ids.dtype}"
            )
        if impl == "cudnn":
            raise ValueError(
                "flash_attention impl='cudnn' does not take segment_ids (packed documents); "
                "use impl='pallas' or 'xla'"
            )
    if impl in ("pallas", "cudnn"):
        if K not in HEAD_DIMS:
            raise ValueError(
                f"flash_attention impl={impl!r}: head_dim={K} is not supported; supported head "
                f"dims are {', '.join(map(str, HEAD_DIMS))} (use impl='xla' for others)"
            )
        if q.dtype not in DTYPES:
            raise ValueError(
                f"flash_attention impl={impl!r}: dtype {q.dtype} is not supported; supported "
                "dtypes are float32, bfloat16"
            )


def _blocks(T, S, block_q, block_k):
    """Block sizes: 64 by default, shrunk (to a power of two ≥ 16) for short sequences."""
    bq = block_q or min(64, max(16, _common.next_pow2(T)))
    bk = block_k or min(64, max(16, _common.next_pow2(S)))
    for name, b in (("block_q", bq), ("block_k", bk)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"flash_attention: {name}={b} must be a power of two ≥ 16")
    return bq, bk


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
        block_q: query rows per tile (power of two ≥ 16; default 64, less for short sequences).
        block_k: key rows per inner step (same rule).
        segment_ids: [batch, T] integers for self-attention over packed documents: query i
            sees key j only when both carry one id (padding, id 0, is one more segment, so
            no row is left empty and nothing is NaN). Not with ``impl="cudnn"``.

    Returns:
        [batch, T, heads, head_dim] in the input dtype. Under `activation_rules` the Pallas and
        cuDNN paths run per shard (batch over data × fsdp, heads over tensor); key/value heads
        that the layout keeps whole (fewer than tensor) are picked per shard for its query
        heads.
    """
    impl = _common.resolve_impl(impl, kernel="flash_attention", allowed=_common.ATTENTION_IMPLS)
    _validate(q_BTHK, k_BSGK, v_BSGK, impl, causal, window, segment_ids)
    if impl == "xla":
        return reference.attention(
            q_BTHK, k_BSGK, v_BSGK, causal=causal, window=window, segment_ids=segment_ids
        )
    if impl == "pallas":
        bq, bk = _blocks(q_BTHK.shape[1], k_BSGK.shape[1], block_q, block_k)
        return _pallas_attention(
            q_BTHK, k_BSGK, v_BSGK, segment_ids, causal=causal, window=window, bq=bq, bk=bk,
            interpret=_common.interpret_mode(),
        )  # fmt: skip
    # cuDNN: jax differentiates its fused attention; run it per shard.
    # (left, right) keys beside the query itself: (window − 1, 0) is (i − window, i].
    local = None if window is None else (window - 1, 0)
    H = q_BTHK.shape[2]

    def per_shard(q, k, v, *, axes):
        k, v = _local_kv_heads(q, k, v, heads=H, axes=axes)
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, local_window_size=local, implementation="cudnn"
        )

    args, names = (q_BTHK, k_BSGK, v_BSGK), (_Q_NAMES, _KV_NAMES, _KV_NAMES)
    return _common.sharded(per_shard, args, names, _Q_NAMES, with_axes=True)


def _local_kv_heads(q_BTHK, k_BSGK, v_BSGK, *, heads: int, axes):
    """This shard's key/value heads, arranged for its query heads (inside a manual region).

    Query head h uses key/value head ``h // R`` (R = H / G). Split over the same axes, each
    shard holds whole groups and its own k/v: nothing to do. When the query heads are split
    and k/v are whole on every shard (the layout replicates ``kv_heads`` that ``tensor`` does
    not divide), shard i holds query heads ``[i·Hl, (i+1)·Hl)`` and picks what they use:

    - the one group's k/v head when the shard's heads all fall in one group (R a multiple of
      Hl: G divides the split, e.g. 8 query and 2 k/v heads on tensor=4): no copy, and the
      kernel runs GQA with all local heads in one group;
    - otherwise (the shard's heads straddle groups unevenly) one k/v head per local query head.

    Picking beats repeating k/v to every query head up front: the kernels read only the k/v
    heads a shard uses. The Pallas backwards pick them again and `_kv_heads_back` adds their
    gradients back into the whole heads; cuDNN's reach them through the region's transpose.
    """
    idx = _kv_index(q_BTHK, k_BSGK, heads=heads, axes=axes)
    if idx is None:
        return k_BSGK, v_BSGK
    if idx.shape[0] == 1:
        pick = lambda x: lax.dynamic_slice_in_dim(x, idx[0], 1, axis=2)
    else:
        pick = lambda x: jnp.take(x, idx, axis=2)
    return pick(k_BSGK), pick(v_BSGK)


def _kv_index(q_BTHK, k_BSGK, *, heads: int, axes):
    """The key/value heads this shard's query heads use (see `_local_kv_heads`): None when
    the shard holds its own, else their indices [1] (one group) or [Hl] (one per head)."""
    q_axes, kv_axes = axes.get("heads", ()), axes.get("kv_heads", ())
    if kv_axes == q_axes:
        return None
    if kv_axes:
        raise ValueError(
            f"flash_attention: key/value heads split over {kv_axes} but query heads over "
            f"{q_axes or 'nothing'}; split kv_heads over the axes heads use, or not at all"
        )
    G, Hl = k_BSGK.shape[2], q_BTHK.shape[2]
    R = heads // G
    first = lax.axis_index(q_axes) * Hl  # this shard's first query head
    if R % Hl == 0:
        return (first // R)[None]
    return (first + jnp.arange(Hl)) // R


# --- global positions: the per-device blocks of context parallelism ------------------------


def _optional_refs(kernel, n_in: int, present: tuple[bool, ...]):
    """`kernel`, whose refs after the first `n_in` inputs are pairs of optional refs (the
    query and key segment ids, then the query and key positions); the call passes only the
    pairs that are `present`, and the kernel gets None for the others."""
    if all(present):
        return kernel

    def run(*refs, **static):
        out, at = list(refs[:n_in]), n_in
        for here in present:
            out += refs[at : at + 2] if here else [None, None]
            at += 2 if here else 0
        return kernel(*out, *refs[at:], **static)

    return run


def _sees_block(fixed_pos, load_pos, causal, window, *, fixed_rows=True):
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


def _skip_unseen(body, sees):
    """A `fori_loop` body that leaves its carry alone at the steps where `sees` says no pair
    is visible (`body` itself when `sees` is None)."""
    if sees is None:
        return body

    def skipping(j, carry):
        return lax.cond(sees(j), body, lambda _, c: c, j, carry)

    return skipping


def _pad_positions(pos, size):
    """Positions padded to `size` with copies of the last one (the padding is masked by
    index; repeating the edge keeps each block's position range that of its real entries)."""
    pos = pos.astype(jnp.int32)
    return jnp.pad(pos, (0, size - pos.shape[0]), mode="edge")


def _check_block(q, k, v, q_pos, k_pos, causal, window, q_segments, k_segments):
    """Clear errors for what `block_forward` does not take (beyond `_validate`'s)."""
    _validate(q, k, v, "pallas", causal, window if causal else None)
    T, S = q.shape[1], k.shape[1]
    if q_pos.shape != (T,) or k_pos.shape != (S,):
        raise ValueError(
            f"flash attention block: positions {q_pos.shape}, {k_pos.shape} must be [{T}] and "
            f"[{S}] (one per query and per key)"
        )
    for name, x in (("q_pos", q_pos), ("k_pos", k_pos)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"flash attention block: {name} must be integers, got {x.dtype}")
    if (q_segments is None) != (k_segments is None):
        raise ValueError("flash attention block: give both q_segments and k_segments, or none")
    if q_segments is not None and (
        q_segments.shape != (q.shape[0], T) or k_segments.shape != (q.shape[0], S)
    ):
        raise ValueError(
            f"flash attention block: segment ids {q_segments.shape}, {k_segments.shape} must "
            f"be [batch, {T}] and [batch, {S}]"
        )


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
    window = window if causal else None
    _check_block(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, causal, window, q_segments, k_segments)
    B, T, H, K = q_BTHK.shape
    S, G = k_BSGK.shape[1], k_BSGK.shape[2]
    bq, bk = _blocks(T, S, None, None)
    interpret = _common.interpret_mode()

    def per_shard(q, k, v, q_pos, k_pos, *segs, axes):
        k, v = _local_kv_heads(q, k, v, heads=H, axes=axes)
        qp, kp, vp = _pad_inputs(q, k, v, bq, bk)
        Tp, Sp = qp.shape[1], kp.shape[1]
        sq, sk = _pad_block_segments(segs, Tp, Sp)
        o, lse = _fwd_call(
            qp, kp, vp, sq, sk, causal=causal, window=window, bq=bq, bk=bk, seq_q=T,
            seq_k=S, interpret=interpret, q_pos=_pad_positions(q_pos, Tp),
            k_pos=_pad_positions(k_pos, Sp), out_dtype=_F32,
        )  # fmt: skip
        return o[:, :T], lse[:, :, :T]

    args, names = _block_args(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, q_segments, k_segments)
    o, lse_BHT = _common.sharded(per_shard, args, names, (_Q_NAMES, _LSE_NAMES), with_axes=True)
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
    window = window if causal else None
    _check_block(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, causal, window, q_segments, k_segments)
    B, T, H, K = q_BTHK.shape
    S = k_BSGK.shape[1]
    bq, bk = _blocks(T, S, None, None)
    interpret = _common.interpret_mode()

    def per_shard(q, k, v, q_pos, k_pos, do, lse, delta, *segs, axes):
        kl, vl = _local_kv_heads(q, k, v, heads=H, axes=axes)
        qp, kp, vp = _pad_inputs(q, kl, vl, bq, bk)
        Tp, Sp = qp.shape[1], kp.shape[1]
        sq, sk = _pad_block_segments(segs, Tp, Sp)
        dq, dk, dv = _bwd_calls(
            qp, kp, vp, _common.pad_to(do, 1, Tp), _common.pad_to(lse, 2, Tp),
            _common.pad_to(delta, 2, Tp), sq, sk, causal=causal, window=window, bq=bq,
            bk=bk, seq_q=T, seq_k=S, interpret=interpret, q_pos=_pad_positions(q_pos, Tp),
            k_pos=_pad_positions(k_pos, Sp), grad_dtype=_F32,
        )  # fmt: skip
        back = functools.partial(_kv_heads_back, q, k, heads=H, axes=axes)
        return dq[:, :T], back(dk[:, :S]), back(dv[:, :S])

    args, names = _block_args(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, q_segments, k_segments)
    rows = (lse_BGRT.reshape(B, H, T), delta_BGRT.reshape(B, H, T))
    args = (*args[:5], do_BTHK.astype(q_BTHK.dtype), *rows, *args[5:])
    names = (*names[:5], _Q_NAMES, _LSE_NAMES, _LSE_NAMES, *names[5:])
    outs = (_Q_NAMES, _KV_NAMES, _KV_NAMES)
    return _common.sharded(per_shard, args, names, outs, with_axes=True)


def _block_args(q, k, v, q_pos, k_pos, q_segments, k_segments):
    """The arguments of a block's `sharded` call and their logical names."""
    args = (q, k, v, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32))
    names = (_Q_NAMES, _KV_NAMES, _KV_NAMES, (None,), (None,))
    if q_segments is not None:
        args += (q_segments.astype(jnp.int32), k_segments.astype(jnp.int32))
        names += (("batch", None), ("batch", None))
    return args, names


def _pad_block_segments(segs, Tp, Sp):
    """The query and key segment ids padded (with 0) to Tp and Sp; (None, None) without."""
    if not segs:
        return None, None
    return _common.pad_to(segs[0], 1, Tp), _common.pad_to(segs[1], 1, Sp)


def _kv_heads_back(q_BTHK, k_BSGK, d_BSGK, *, heads: int, axes):
    """The transpose of `_local_kv_heads` (inside the kernels' manual region): the gradients
    `d_BSGK` of the key/value heads this shard picked, put back among all of `k_BSGK`'s heads
    in float32 and summed over the query heads' axes (every shard holds the whole k/v)."""
    idx = _kv_index(q_BTHK, k_BSGK, heads=heads, axes=axes)
    if idx is None:
        return d_BSGK
    full = jnp.zeros(k_BSGK.shape, _F32).at[:, :, idx].add(d_BSGK.astype(_F32))
    return lax.psum(full, axes["heads"])
