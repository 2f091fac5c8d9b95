"""Fused RMSNorm and LayerNorm: one pass forward, one pass backward, rows in blocks.

Each grid cell normalises ``block_rows`` whole rows (the feature dimension lives in one
block, padded to a power of two and masked). The forward writes the output and the per-row
reciprocal standard deviation (and mean, for LayerNorm); the backward reads x, dy and those
statistics once and writes dx plus one partial row of dscale (and dbias) per block, which are
summed outside the kernel. Statistics are float32 whatever the input dtype.
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
MAX_FEATURES = 16_384  # one row must fit a block
_F32 = jnp.float32


def _col_mask(width, true_width):
    """[1, width] boolean: the columns that are real features (not padding)."""
    return (lax.iota(jnp.int32, width) < true_width)[None, :]


def _fwd_kernel(*refs, eps, width, centred):
    if centred:
        x_ref, w_ref, b_ref, y_ref, mean_ref, rstd_ref = refs
    else:
        x_ref, w_ref, y_ref, rstd_ref = refs
    x = x_ref[...].astype(_F32)
    cols = _col_mask(x.shape[1], width)
    if centred:
        mean = jnp.sum(x, axis=1) / width
        x = jnp.where(cols, x - mean[:, None], 0.0)
        mean_ref[...] = mean
    rstd = lax.rsqrt(jnp.sum(x * x, axis=1) / width + eps)
    y = x * rstd[:, None] * w_ref[...].astype(_F32)[None, :]
    if centred:
        y = y + b_ref[...].astype(_F32)[None, :]
    y_ref[...] = y.astype(y_ref.dtype)
    rstd_ref[...] = rstd


def _bwd_kernel(*refs, width, centred):
    if centred:
        x_ref, w_ref, dy_ref, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref = refs
    else:
        x_ref, w_ref, dy_ref, rstd_ref, dx_ref, dw_ref = refs
    x = x_ref[...].astype(_F32)
    dy = dy_ref[...].astype(_F32)
    rstd = rstd_ref[...][:, None]
    cols = _col_mask(x.shape[1], width)
    if centred:
        x = x - mean_ref[...][:, None]
    xhat = jnp.where(cols, x * rstd, 0.0)
    dxhat = dy * w_ref[...].astype(_F32)[None, :]
    proj = jnp.sum(dxhat * xhat, axis=1, keepdims=True) / width
    if centred:
        dxhat = dxhat - jnp.sum(dxhat, axis=1, keepdims=True) / width
    dx = jnp.where(cols, rstd * (dxhat - xhat * proj), 0.0)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dw_ref[...] = jnp.sum(dy * xhat, axis=0)
    if centred:
        db_ref[...] = jnp.sum(jnp.where(cols, dy, 0.0), axis=0)


def _layout(n_rows, width, block_rows):
    """Padded sizes: rows to whole blocks, features to a power of two."""
    br = block_rows or min(64, max(8, _common.next_pow2(n_rows)))
    return br, _common.cdiv(n_rows, br) * br, _common.next_pow2(width)


def _forward(x_ND, w_D, b_D, *, eps, block_rows, interpret):
    """Padded forward on [N, D]; returns (y, stats...) with y sliced back to [N, D]."""
    N, D = x_ND.shape
    centred = b_D is not None
    br, Np, Dp = _layout(N, D, block_rows)
    x = _common.pad_to(_common.pad_to(x_ND, 0, Np), 1, Dp)
    params = [_common.pad_to(w_D, 0, Dp)] + ([_common.pad_to(b_D, 0, Dp)] if centred else [])
    row_block = pl.BlockSpec((br, Dp), lambda i: (i, 0))
    vec = pl.BlockSpec((Dp,), lambda i: (0,))
    stat = pl.BlockSpec((br,), lambda i: (i,))
    stat_shape = jax.ShapeDtypeStruct((Np,), _F32)
    n_stats = 2 if centred else 1
    outs = _common.pallas_call(
        functools.partial(_fwd_kernel, eps=eps, width=D, centred=centred),
        grid=(Np // br,),
        in_specs=[row_block] + [vec] * len(params),
        out_specs=[row_block] + [stat] * n_stats,
        out_shape=[jax.ShapeDtypeStruct((Np, Dp), x_ND.dtype)] + [stat_shape] * n_stats,
        compiler_params=_common.triton_params(_warps(Dp), 1),
        interpret=interpret,
        name="layer_norm_fwd" if centred else "rms_norm_fwd",
    )(x, *params)
    return outs[0][:N, :D], outs[1:]


def _warps(width):
    """More warps for wider rows (Triton)."""
    return min(16, max(1, width // 256))


def _backward(x_ND, w_D, centred, stats, dy_ND, *, block_rows, interpret):
    """Padded backward; returns dx [N, D], dw [D] (and db [D])."""
    N, D = x_ND.shape
    br, Np, Dp = _layout(N, D, block_rows)
    x = _common.pad_to(_common.pad_to(x_ND, 0, Np), 1, Dp)
    dy = _common.pad_to(_common.pad_to(dy_ND, 0, Np), 1, Dp)
    w = _common.pad_to(w_D, 0, Dp)
    row_block = pl.BlockSpec((br, Dp), lambda i: (i, 0))
    vec = pl.BlockSpec((Dp,), lambda i: (0,))
    stat = pl.BlockSpec((br,), lambda i: (i,))
    partial_row = pl.BlockSpec((None, Dp), lambda i: (i, 0))
    n_blocks = Np // br
    n_partials = 2 if centred else 1
    outs = _common.pallas_call(
        functools.partial(_bwd_kernel, width=D, centred=centred),
        grid=(n_blocks,),
        in_specs=[row_block, vec, row_block] + [stat] * len(stats),
        out_specs=[row_block] + [partial_row] * n_partials,
        out_shape=[jax.ShapeDtypeStruct((Np, Dp), x_ND.dtype)]
        + [jax.ShapeDtypeStruct((n_blocks, Dp), _F32)] * n_partials,
        compiler_params=_common.triton_params(_warps(Dp), 1),
        interpret=interpret,
        name="layer_norm_bwd" if centred else "rms_norm_bwd",
    )(x, w, dy, *stats)
    dx = outs[0][:N, :D]
    sums = [p.sum(axis=0)[:D] for p in outs[1:]]
    return dx, sums


def _norm(x, params, *, eps, block_rows, interpret):
    """RMSNorm (params: scale) or LayerNorm (scale, bias) with the kernels, per shard.

    The custom VJP sits around the sharded calls (rows split over the batch axes under a
    layout), not inside them: each rule runs its kernel per shard, and the backward sums the
    per-shard dscale (and dbias) over the axes the rows are split over.
    """
    centred = len(params) == 2
    rows = _common.row_names(x.ndim - 1)
    x_names, p_names = (*rows, None), [(None,)] * len(params)
    stat_names = [rows] * (2 if centred else 1)

    def fwd_shard(x, *params):
        y, stats = _forward(
            x.reshape(-1, x.shape[-1]), params[0], params[1] if centred else None,
            eps=eps, block_rows=block_rows, interpret=interpret,
        )  # fmt: skip
        n = y.shape[0]
        return (y.reshape(x.shape), *(s[:n].reshape(x.shape[:-1]) for s in stats))

    n_params = len(params)

    def bwd_shard(x, *rest, axes):
        ws, stats, dy = rest[:n_params], rest[n_params:-1], rest[-1]
        N, D = x.size // x.shape[-1], x.shape[-1]
        _, Np, _ = _layout(N, D, block_rows)
        dx, sums = _backward(
            x.reshape(N, D), ws[0], centred,
            [_common.pad_to(s.reshape(N), 0, Np) for s in stats], dy.reshape(N, D),
            block_rows=block_rows, interpret=interpret,
        )  # fmt: skip
        split = tuple(a for name in rows if name is not None for a in axes.get(name, ()))
        sums = [lax.psum(s, split) if split else s for s in sums]
        sums = [s.astype(w.dtype) for s, w in zip(sums, ws, strict=True)]
        return (dx.reshape(x.shape), *sums)

    def run(x, *params):
        return _common.sharded(fwd_shard, (x, *params), [x_names, *p_names], (x_names, *stat_names))

    @jax.custom_vjp
    def norm(x, *params):
        return run(x, *params)[0]

    def norm_fwd(x, *params):
        y, *stats = run(x, *params)
        return y, (x, params, stats)

    def norm_bwd(res, dy):
        x, params, stats = res
        grads = _common.sharded(
            bwd_shard,
            (x, *params, *stats, dy),
            [x_names, *p_names, *stat_names, x_names],
            (x_names, *p_names),
            with_axes=True,
        )
        return typed_like(grads, (x, *params))

    norm.defvjp(norm_fwd, norm_bwd)
    return norm(x, *params)


def _validate(kernel, x, params, impl):
    """Clear errors for shapes and dtypes the kernels do not take."""
    D = x.shape[-1] if x.ndim else 0
    if x.ndim < 1:
        raise ValueError(f"{kernel}: x must have a feature dimension; got a scalar")
    for name, p in params.items():
        if p.shape != (D,):
            raise ValueError(
                f"{kernel}: {name} has shape {p.shape}; expected ({D},) for x {x.shape}"
            )
    if impl == "pallas":
        if x.dtype not in DTYPES:
            raise ValueError(
                f"{kernel} impl='pallas': dtype {x.dtype} is not supported; supported dtypes "
                "are float32, bfloat16"
            )
        if D > MAX_FEATURES:
            raise ValueError(
                f"{kernel} impl='pallas': {D} features exceed the {MAX_FEATURES} one block holds"
            )


def _dispatch(kernel, ref, x, params, eps, impl, block_rows):
    """Resolves `impl`, checks the arguments and runs the reference `ref` or the kernel."""
    _args.finite(kernel, "eps", eps, example=1e-5)
    _args.power_of_two(kernel, "block_rows", block_rows, example=64)
    impl = _common.resolve_impl(
        impl, kernel=kernel, shape={"features": x.shape[-1] if x.ndim else 0}
    )
    _validate(kernel, x, params, impl)
    if impl == "xla":
        return ref(x, *params.values(), eps=eps)
    interpret = _common.interpret_mode()
    return _norm(x, tuple(params.values()), eps=eps, block_rows=block_rows, interpret=interpret)


def rms_norm(
    x: jax.Array,
    scale: jax.Array,
    *,
    eps: float = 1e-5,
    impl: str = "auto",
    block_rows: int | None = None,
) -> jax.Array:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x²) + eps) · scale``.

    Args:
        x: [..., D], float32 or bfloat16.
        scale: [D].
        eps: added to the mean square.
        impl: ``"pallas"``, ``"xla"`` (the jnp reference) or ``"auto"``.
        block_rows: rows per grid cell (default up to 64).

    Returns:
        The normalised x, in its dtype (statistics in float32).
    """
    params = {"scale": scale}
    return _dispatch("rms_norm", reference.rms_norm, x, params, eps, impl, block_rows)


def layer_norm(
    x: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    *,
    eps: float = 1e-5,
    impl: str = "auto",
    block_rows: int | None = None,
) -> jax.Array:
    """LayerNorm over the last dimension: ``(x − mean) / sqrt(var + eps) · scale + bias``.

    Args:
        x: [..., D], float32 or bfloat16.
        scale: [D].
        bias: [D].
        eps: added to the variance.
        impl: ``"pallas"``, ``"xla"`` (the jnp reference) or ``"auto"``.
        block_rows: rows per grid cell (default up to 64).

    Returns:
        The normalised x, in its dtype (statistics in float32).
    """
    params = {"scale": scale, "bias": bias}
    return _dispatch("layer_norm", reference.layer_norm, x, params, eps, impl, block_rows)
