"""The mean-squared-error loss, forward and gradient, as two hand-written kernels (the
surveys' proof of concept).

Forward: each grid cell reads one block of whole rows of predictions and targets and writes
one float32 per row, the mean of the squared differences. Gradient: each cell writes
``2 · (pred − target) · g / D`` for its rows, g being the incoming per-row gradient; the
target's gradient is its negation. Padding is zero in both inputs, so it adds nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from meshtrain.kernels import _common, _rowwise, reference

DTYPES = (jnp.float32, jnp.bfloat16)
_F32 = jnp.float32


def _fwd_kernel(p_ref, t_ref, loss_ref, *, width):
    diff = p_ref[...].astype(_F32) - t_ref[...].astype(_F32)
    loss_ref[...] = jnp.sum(diff * diff, axis=1) / width


def _grad_kernel(p_ref, t_ref, g_ref, dp_ref, *, width):
    diff = p_ref[...].astype(_F32) - t_ref[...].astype(_F32)
    dp_ref[...] = (diff * (2.0 / width) * g_ref[...][:, None]).astype(dp_ref.dtype)


def _forward(pred, target, block_rows, interpret):
    """Per-row losses [N] of [N, D] inputs."""
    N, D = pred.shape
    br, Np, Dp = _rowwise.layout(N, D, block_rows)
    block = pl.BlockSpec((br, Dp), lambda i: (i, 0))
    loss = _common.pallas_call(
        functools.partial(_fwd_kernel, width=D),
        grid=(Np // br,),
        in_specs=[block, block],
        out_specs=pl.BlockSpec((br,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((Np,), _F32),
        compiler_params=_common.triton_params(4, 1),
        interpret=interpret,
        name="mse_fwd",
    )(_rowwise.pad2(pred, Np, Dp), _rowwise.pad2(target, Np, Dp))
    return loss[:N]


def _gradient(pred, target, g, block_rows, interpret):
    """d loss / d pred [N, D], in pred's dtype."""
    N, D = pred.shape
    br, Np, Dp = _rowwise.layout(N, D, block_rows)
    block = pl.BlockSpec((br, Dp), lambda i: (i, 0))
    dp = _common.pallas_call(
        functools.partial(_grad_kernel, width=D),
        grid=(Np // br,),
        in_specs=[block, block, pl.BlockSpec((br,), lambda i: (i,))],
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct((Np, Dp), pred.dtype),
        compiler_params=_common.triton_params(4, 1),
        interpret=interpret,
        name="mse_grad",
    )(
        _rowwise.pad2(pred, Np, Dp),
        _rowwise.pad2(target, Np, Dp),
        _common.pad_to(g.astype(_F32), 0, Np),
    )
    return dp[:N, :D]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mse(pred, target, block_rows, interpret):
    return _forward(pred, target, block_rows, interpret)


def _mse_fwd(pred, target, block_rows, interpret):
    return _forward(pred, target, block_rows, interpret), (pred, target)


def _mse_bwd(block_rows, interpret, res, g):
    pred, target = res
    dp = _gradient(pred, target, g, block_rows, interpret)
    return dp, (-dp.astype(_F32)).astype(target.dtype)


_mse.defvjp(_mse_fwd, _mse_bwd)


def mean_squared_error(
    pred: jax.Array,
    target: jax.Array,
    *,
    impl: str = "auto",
    block_rows: int | None = None,
) -> jax.Array:
    """Per-row mean squared error ``mean((pred − target)², axis=-1)``.

    Args:
        pred: [..., D], float32 or bfloat16.
        target: [..., D], the same shape (any float dtype the kernel takes).
        impl: ``"pallas"``, ``"xla"`` (the jnp reference) or ``"auto"``.
        block_rows: rows per grid cell (a power of two; default fits 32k elements).

    Returns:
        [...] float32 losses; the gradient flows to both inputs. Under `activation_rules`
        the rows run split over the batch axes (each row whole on its shard).
    """
    impl = _common.resolve_impl(impl, kernel="mean_squared_error")
    if pred.ndim < 1 or pred.shape != target.shape:
        raise ValueError(
            f"mean_squared_error: pred {pred.shape} and target {target.shape} must have one "
            "shape of at least one dimension"
        )
    if impl == "xla":
        return reference.mean_squared_error(pred, target)
    for name, x in (("pred", pred), ("target", target)):
        if x.dtype not in DTYPES:
            raise ValueError(
                f"mean_squared_error impl='pallas': {name} dtype {x.dtype} is not supported; "
                "supported dtypes are float32, bfloat16"
            )
    if pred.shape[-1] > _rowwise.MAX_FEATURES:
        raise ValueError(
            f"mean_squared_error impl='pallas': rows of {pred.shape[-1]} exceed the "
            f"{_rowwise.MAX_FEATURES} one block holds"
        )
    _rowwise.check_block_rows("mean_squared_error", block_rows)
    interpret = _common.interpret_mode()

    def per_shard(p, t):
        flat = _mse(p.reshape(-1, p.shape[-1]), t.reshape(-1, t.shape[-1]), block_rows, interpret)
        return flat.reshape(p.shape[:-1])

    rows = _common.row_names(pred.ndim - 1)
    return _common.sharded(per_shard, (pred, target), ((*rows, None), (*rows, None)), rows)
