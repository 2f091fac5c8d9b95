"""Fused softmax cross-entropy over a large vocabulary, chunked so no fp32 copy is made.

Forward: each grid cell takes ``block_rows`` rows and walks the vocabulary in
``block_vocab`` chunks with an online logsumexp, picking the target's logit on the way; it
writes two floats per row. Backward: a 2-D grid over (row block, vocabulary chunk) writes
``(softmax − onehot) · g`` straight into a gradient of the logits' own dtype, recomputing the
softmax from the saved logsumexp: no [tokens × vocab] float32 array is ever formed.

Vocabulary-parallel: when the logits arrive split over the vocabulary (tensor parallelism),
each shard reduces its own slice and the per-row partial logsumexps and picked logits are
combined with one ``pmax`` and two ``psum`` of [tokens] floats; the logits are never gathered.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from meshtrain.kernels import _args, _common, reference
from meshtrain.layout.per_shard import typed_like

DTYPES = (jnp.float32, jnp.bfloat16)
_NEG = -1e30
_F32 = jnp.float32


def _fwd_kernel(x_ref, t_ref, lse_ref, picked_ref, *, bv, vocab):
    br = x_ref.shape[0]
    t = t_ref[...]

    def body(c, carry):
        m, s, picked = carry
        cols = c * bv + lax.iota(jnp.int32, bv)
        x = x_ref[:, pl.ds(c * bv, bv)].astype(_F32)
        x = jnp.where(cols[None, :] < vocab, x, _NEG)
        m_new = jnp.maximum(m, x.max(axis=1))
        s = s * jnp.exp(m - m_new) + jnp.exp(x - m_new[:, None]).sum(axis=1)
        picked = picked + jnp.where(cols[None, :] == t[:, None], x, 0.0).sum(axis=1)
        return m_new, s, picked

    init = (jnp.full((br,), _NEG, _F32), jnp.zeros((br,), _F32), jnp.zeros((br,), _F32))
    m, s, picked = lax.fori_loop(0, x_ref.shape[1] // bv, body, init)
    lse_ref[...] = m + jnp.log(s)
    picked_ref[...] = picked


def _bwd_kernel(x_ref, t_ref, lse_ref, g_ref, dx_ref, *, bv):
    c = pl.program_id(1)
    cols = c * bv + lax.iota(jnp.int32, bv)
    x = x_ref[...].astype(_F32)
    p = jnp.exp(x - lse_ref[...][:, None])
    onehot = (cols[None, :] == t_ref[...][:, None]).astype(_F32)
    dx_ref[...] = ((p - onehot) * g_ref[...][:, None]).astype(dx_ref.dtype)


def _layout(N, V, block_rows, block_vocab):
    """Block sizes and padded sizes (rows and vocabulary padded to whole blocks)."""
    br = block_rows or min(32, max(8, _common.next_pow2(N)))
    bv = block_vocab or min(1024, max(16, _common.next_pow2(V)))
    return br, bv, _common.cdiv(N, br) * br, _common.cdiv(V, bv) * bv


def _local_stats(x, t, *, br, bv, interpret):
    """Runs the forward kernel: per-row (logsumexp, picked logit) over this shard's vocabulary."""
    N, V = x.shape
    br, bv, Np, Vp = _layout(N, V, br, bv)
    xp = _common.pad_to(_common.pad_to(x, 0, Np), 1, Vp)
    tp = _common.pad_to(t, 0, Np)
    row = pl.BlockSpec((br,), lambda i: (i,))
    lse, picked = _common.pallas_call(
        functools.partial(_fwd_kernel, bv=bv, vocab=V),
        grid=(Np // br,),
        in_specs=[pl.BlockSpec((br, Vp), lambda i: (i, 0)), row],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((Np,), _F32)] * 2,
        compiler_params=_common.triton_params(4, 2),
        interpret=interpret,
        name="cross_entropy_fwd",
    )(xp, tp)
    return lse[:N], picked[:N]


def _grad(x, t, lse, g, *, br, bv, interpret):
    """Runs the backward kernel: d logits = (softmax − onehot) · g, in the logits dtype."""
    N, V = x.shape
    br, bv, Np, Vp = _layout(N, V, br, bv)
    xp = _common.pad_to(_common.pad_to(x, 0, Np), 1, Vp)
    row = pl.BlockSpec((br,), lambda i, c: (i,))
    tile = pl.BlockSpec((br, bv), lambda i, c: (i, c))
    dx = _common.pallas_call(
        functools.partial(_bwd_kernel, bv=bv),
        grid=(Np // br, Vp // bv),
        in_specs=[tile, row, row, row],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct((Np, Vp), x.dtype),
        compiler_params=_common.triton_params(4, 1),
        interpret=interpret,
        name="cross_entropy_bwd",
    )(xp, _common.pad_to(t, 0, Np), _common.pad_to(lse, 0, Np), _common.pad_to(g, 0, Np))
    return dx[:N, :V]


def _cross_entropy(logits, targets, *, br, bv, interpret):
    """Per-token losses with the kernels, per shard; the custom VJP sits around the sharded
    calls (see `_common.sharded`), each rule running its kernel on the shard's rows and, when
    the logits are split over ``vocab``, its slice of the vocabulary."""
    rows = _common.row_names(targets.ndim)
    x_names = (*rows, "vocab")

    def local_targets(t, x, axes):
        """The targets as columns of this shard's slice of the vocabulary."""
        vocab_axes = axes.get("vocab", ())
        return t - lax.axis_index(vocab_axes) * x.shape[-1] if vocab_axes else t

    def fwd_shard(x, t, *, axes):
        x_NV, t_N = x.reshape(-1, x.shape[-1]), local_targets(t, x, axes).reshape(-1)
        lse, picked = _local_stats(x_NV, t_N, br=br, bv=bv, interpret=interpret)
        vocab_axes = axes.get("vocab", ())
        if vocab_axes:
            m = lax.pmax(lse, vocab_axes)
            lse = m + jnp.log(lax.psum(jnp.exp(lse - m), vocab_axes))
            picked = lax.psum(picked, vocab_axes)
        return (lse - picked).reshape(t.shape), lse.reshape(t.shape)

    def bwd_shard(x, t, lse, g, *, axes):
        t_N = local_targets(t, x, axes).reshape(-1)
        x_NV = x.reshape(-1, x.shape[-1])
        g_N = g.reshape(-1).astype(_F32)
        dx = _grad(x_NV, t_N, lse.reshape(-1), g_N, br=br, bv=bv, interpret=interpret)
        return dx.reshape(x.shape)

    def run(x, t):
        return _common.sharded(fwd_shard, (x, t), (x_names, rows), (rows, rows), with_axes=True)

    @jax.custom_vjp
    def ce(x, t):
        return run(x, t)[0]

    def ce_fwd(x, t):
        losses, lse = run(x, t)
        return losses, (x, t, lse)

    def ce_bwd(res, g):
        x, t, lse = res
        args, names = (x, t, lse, g), (x_names, rows, rows, rows)
        dx = _common.sharded(bwd_shard, args, names, x_names, with_axes=True)
        return (*typed_like((dx,), (x,)), None)  # targets are integers: no cotangent

    ce.defvjp(ce_fwd, ce_bwd)
    return ce(logits, targets)


def token_cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    *,
    impl: str = "auto",
    block_rows: int | None = None,
    block_vocab: int | None = None,
) -> jax.Array:
    """Per-token softmax cross-entropy ``logsumexp(logits) − logits[target]``.

    Args:
        logits: [..., V], float32 or bfloat16 (the gradient comes back in this dtype).
        targets: [...] integer class ids in ``[0, V)`` (an id outside picks nothing).
        impl: ``"pallas"``, ``"xla"`` (the jnp reference) or ``"auto"``.
        block_rows: rows per grid cell (default up to 32).
        block_vocab: vocabulary chunk (power of two; default up to 1024).

    Returns:
        [...] float32 losses. Under `activation_rules` the rows run split over the batch axes
        and, when the logits are split over ``vocab``, each shard reduces its own slice.
    """
    _args.power_of_two("token_cross_entropy", "block_rows", block_rows, example=32)
    _args.power_of_two("token_cross_entropy", "block_vocab", block_vocab, example=1024, low=16)
    impl = _common.resolve_impl(
        impl, kernel="token_cross_entropy", shape={"vocab": logits.shape[-1] if logits.ndim else 0}
    )
    if logits.ndim < 1 or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"token_cross_entropy: targets {targets.shape} must be logits {logits.shape} "
            "without the last (vocabulary) dimension"
        )
    _args.integers("token_cross_entropy", "targets", targets)
    if impl == "xla":
        return reference.token_cross_entropy(logits, targets)
    if logits.dtype not in DTYPES:
        raise ValueError(
            f"token_cross_entropy impl='pallas': dtype {logits.dtype} is not supported; supported "
            "dtypes are float32, bfloat16"
        )
    interpret = _common.interpret_mode()
    return _cross_entropy(
        logits, targets.astype(jnp.int32), br=block_rows, bv=block_vocab, interpret=interpret
    )
