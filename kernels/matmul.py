"""Tiled matmul with a fused bias + activation epilogue: ``act(x @ w + bias)``.

Each grid cell owns a ``[block_m, block_n]`` output tile, walks the contraction in
``block_k`` steps accumulating in float32, then adds the bias, applies the activation and
casts once before the single write: the pre-activation never goes to memory. The backward
recomputes the pre-activation tile by tile (same kernel, float32 out, no activation), takes
the activation's derivative elementwise, and runs the same kernel for ``dx = dz wᵀ`` and
``dw = xᵀ dz``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from meshtrain.kernels import _args, _common, reference

ACTIVATIONS = tuple(reference.ACTIVATIONS)
DTYPES = (jnp.float32, jnp.bfloat16)
_F32 = jnp.float32


def _kernel(*refs, bk, activation, has_bias):
    if has_bias:
        x_ref, w_ref, b_ref, o_ref = refs
    else:
        x_ref, w_ref, o_ref = refs
    bm, bn = o_ref.shape

    def body(c, acc):
        x = x_ref[:, pl.ds(c * bk, bk)]
        w = w_ref[pl.ds(c * bk, bk), :]
        return acc + lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=_F32)

    acc = lax.fori_loop(0, x_ref.shape[1] // bk, body, jnp.zeros((bm, bn), _F32))
    if has_bias:
        acc = acc + b_ref[...].astype(_F32)[None, :]
    o_ref[...] = reference.ACTIVATIONS[activation](acc).astype(o_ref.dtype)


def _blocks(M, N, K, block_m, block_n, block_k):
    """Tile sizes: up to 64×64 output tiles and 32-deep steps, never below 16."""
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        _args.power_of_two("matmul", name, b, example=32, low=16)
    bm = block_m or min(64, max(16, _common.next_pow2(M)))
    bn = block_n or min(64, max(16, _common.next_pow2(N)))
    bk = block_k or min(32, max(16, _common.next_pow2(K)))
    for name, b in (("block_m", bm), ("block_n", bn), ("block_k", bk)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"matmul: {name}={b} must be a power of two ≥ 16")
    return bm, bn, bk


def _call(x, w, b, *, activation, out_dtype, blocks, interpret):
    """One pallas_call on padded operands; returns the [M, N] result."""
    M, K = x.shape
    N = w.shape[1]
    bm, bn, bk = _blocks(M, N, K, *blocks)
    Mp, Np, Kp = (_common.cdiv(d, s) * s for d, s in ((M, bm), (N, bn), (K, bk)))
    xp = _common.pad_to(_common.pad_to(x, 0, Mp), 1, Kp)
    wp = _common.pad_to(_common.pad_to(w, 0, Kp), 1, Np)
    operands = [xp, wp]
    in_specs = [
        pl.BlockSpec((bm, Kp), lambda i, j: (i, 0)),
        pl.BlockSpec((Kp, bn), lambda i, j: (0, j)),
    ]
    if b is not None:
        operands.append(_common.pad_to(b, 0, Np))
        in_specs.append(pl.BlockSpec((bn,), lambda i, j: (j,)))
    out = _common.pallas_call(
        functools.partial(_kernel, bk=bk, activation=activation, has_bias=b is not None),
        grid=(Mp // bm, Np // bn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Mp, Np), out_dtype),
        compiler_params=_common.triton_params(4, 3),
        interpret=interpret,
        name=f"matmul_{activation}",
    )(*operands)
    return out[:M, :N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _mm(x, w, b, activation, blocks, interpret):
    return _call(
        x, w, b, activation=activation, out_dtype=x.dtype, blocks=blocks, interpret=interpret
    )


def _mm_fwd(x, w, b, activation, blocks, interpret):
    return _mm(x, w, b, activation, blocks, interpret), (x, w, b)


def _mm_bwd(activation, blocks, interpret, res, g):
    x, w, b = res
    run = functools.partial(_call, blocks=blocks, interpret=interpret)
    z = run(x, w, b, activation="none", out_dtype=_F32)  # pre-activation, recomputed
    _, act_vjp = jax.vjp(reference.ACTIVATIONS[activation], z)
    (dz,) = act_vjp(g.astype(_F32))
    dz_low = dz.astype(x.dtype)
    dx = run(dz_low, w.T.astype(x.dtype), None, activation="none", out_dtype=x.dtype)
    dw = run(x.T, dz_low, None, activation="none", out_dtype=_F32).astype(w.dtype)
    db = None if b is None else dz.sum(axis=0).astype(b.dtype)
    return dx, dw, db


_mm.defvjp(_mm_fwd, _mm_bwd)


def matmul(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None = None,
    *,
    activation: str = "none",
    impl: str = "auto",
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """``act(x @ w + bias)`` with the bias and activation fused into the matmul's epilogue.

    Args:
        x: [..., K], float32 or bfloat16.
        w: [K, N].
        bias: [N] or None.
        activation: one of none, relu, gelu (tanh form), silu.
        impl: ``"pallas"``, ``"xla"`` (the jnp reference) or ``"auto"``.
        block_m, block_n, block_k: tile sizes (powers of two ≥ 16; defaults 64, 64, 32).

    Returns:
        [..., N] in the dtype of `x` (accumulated in float32). Under `activation_rules` the
        rows run split over the batch (and seq) axes; `w` and `bias` are used whole.
    """
    impl = _common.resolve_impl(
        impl, kernel="matmul", shape={"n": w.shape[-1] if w.ndim else 0, "activation": activation}
    )
    if activation not in ACTIVATIONS:
        raise ValueError(f"matmul: activation={activation!r}; choose from {', '.join(ACTIVATIONS)}")
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"matmul: x {x.shape} and w {w.shape} do not chain (x [..., K], w [K, N])")
    if bias is not None and bias.shape != (w.shape[1],):
        raise ValueError(f"matmul: bias {bias.shape} must be ({w.shape[1]},) for w {w.shape}")
    if impl == "xla":
        return reference.matmul(x, w, bias, activation=activation)
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise ValueError(
            f"matmul impl='pallas': x {x.dtype} and w {w.dtype} must share one of float32, bfloat16"
        )
    blocks = (block_m, block_n, block_k)
    _blocks(1, 1, 1, *blocks)  # check explicit sizes before tracing
    interpret = _common.interpret_mode()
    operands = (x, w) if bias is None else (x, w, bias)
    x_names = (*_common.row_names(x.ndim - 1), None)
    names = [x_names, (None, None)] + ([(None,)] if bias is not None else [])

    def per_shard(x, w, b=None):
        y = _mm(x.reshape(-1, x.shape[-1]), w, b, activation, blocks, interpret)
        return y.reshape(*x.shape[:-1], w.shape[1])

    return _common.sharded(per_shard, operands, names, x_names)
