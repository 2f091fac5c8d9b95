"""fp8 matmuls with current scaling: e4m3 operands forward, e5m2 gradients backward.

Each operand is scaled by a power of two so that its largest magnitude lands just below the
format's maximum (the scale is this step's amax: *current* scaling), rounded to fp8, and
multiplied back (quantise-dequantise). On Hopper, XLA's GPU compiler rewrites a dot of such
operands into an fp8 GEMM (a `gpu`-marked test counts them; not yet run on a GPU); on other
backends the same program runs, and rounds, exactly as fp8 would, in the compute dtype. The
backward quantises the incoming gradient to e5m2 (more range, less precision) and multiplies
it with the e4m3 operands saved by the forward, which are kept in fp8 (one byte each).

Why current scaling rather than delayed (an amax history): it needs no state, so it composes
with every layout, pipeline schedule and accumulation as the plain matmul does, and a spike
in a tensor cannot overflow a scale chosen from earlier steps. Its cost is one max-reduction
per operand, which XLA fuses into the producer; under a split tensor it adds one scalar
all-reduce.

Why powers of two: a power-of-two scale is exact in every dtype, so dequantising in bfloat16
adds no error of its own, and the error of each element is the format's rounding alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

E4M3 = jnp.float8_e4m3fn  # forward operands: 3 mantissa bits, max 448
E5M2 = jnp.float8_e5m2  # gradients: 2 mantissa bits, max 57344


def scale_for(amax: jax.Array, fmt) -> jax.Array:
    """The power of two s with ``amax / s`` in (max/2, max] of `fmt` (1 when amax is 0 or
    not finite), float32."""
    top = float(jnp.finfo(fmt).max)
    amax = amax.astype(jnp.float32)
    ok = jnp.isfinite(amax) & (amax > 0)
    # ratio = m · 2^e with m in [0.5, 1): the smallest power of two ≥ ratio is 2^e, or
    # 2^(e-1) when m is exactly 0.5; frexp and ldexp are exact where log2 and exp2 are not.
    mantissa, exponent = jnp.frexp(jnp.where(ok, amax, top) / top)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    return jnp.where(ok, jnp.ldexp(jnp.float32(1), exponent), 1.0)


def quantize(x: jax.Array, fmt) -> tuple[jax.Array, jax.Array]:
    """`x` as `fmt` values and the float32 scale they are multiplied by (current scaling)."""
    scale = lax.stop_gradient(scale_for(jnp.max(jnp.abs(x)), fmt))
    top = float(jnp.finfo(fmt).max)
    q = jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(fmt)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """fp8 values times their scale, in `dtype` (exact: the scale is a power of two)."""
    return q.astype(dtype) * scale.astype(dtype)


def round_trip(x: jax.Array, fmt) -> jax.Array:
    """`x` rounded through `fmt` with current scaling, back in its own dtype."""
    return dequantize(*quantize(x, fmt), x.dtype)


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
) -> jax.Array:
    """`jax.lax.dot_general` with both operands rounded to e4m3, and the output's gradient
    to e5m2 in the backward (a drop-in ``dot_general=`` for `flax.nnx.Linear`)."""
    dot = _dot(dimension_numbers, precision, preferred_element_type, out_sharding)
    return _fp8_dot(lhs, rhs, dot)


def _dot(dimension_numbers, precision, preferred_element_type, out_sharding):
    """`lax.dot_general` with every setting but the operands fixed (hashable: a static
    argument of `_fp8_dot`)."""
    return functools.partial(
        lax.dot_general,
        dimension_numbers=dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_dot(lhs: jax.Array, rhs: jax.Array, dot) -> jax.Array:
    return _fwd_rule(lhs, rhs, dot)[0]


def _fwd_rule(lhs, rhs, dot):
    lhs_q, rhs_q = quantize(lhs, E4M3), quantize(rhs, E4M3)
    out = dot(dequantize(*lhs_q, lhs.dtype), dequantize(*rhs_q, rhs.dtype))
    # The operands are saved in fp8; empty arrays carry their dtypes to the backward.
    return out, (lhs_q, rhs_q, jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))


def _bwd_rule(dot, saved, g):
    lhs_q, rhs_q, lhs_like, rhs_like = saved
    lhs, rhs = dequantize(*lhs_q, lhs_like.dtype), dequantize(*rhs_q, rhs_like.dtype)
    return jax.vjp(dot, lhs, rhs)[1](round_trip(g, E5M2))


_fp8_dot.defvjp(_fwd_rule, _bwd_rule)


@jax.custom_vjp
def gradient_to_e5m2(y: jax.Array) -> jax.Array:
    """`y` itself; its gradient is rounded to e5m2 on the way back."""
    return y


gradient_to_e5m2.defvjp(lambda y: (y, None), lambda _, g: (round_trip(g, E5M2),))


@jax.custom_vjp
def _straight_through(x: jax.Array) -> jax.Array:
    return round_trip(x, E4M3)


_straight_through.defvjp(lambda x: (round_trip(x, E4M3), None), lambda _, g: (g,))


def matmul(fn):
    """A matmul `fn(a, b, ...)` made fp8: operands rounded to e4m3 (their gradients passed
    straight through), the output's gradient rounded to e5m2. For matmuls that are not a
    plain `dot_general` (the MoE's per-expert and grouped products)."""

    def fp8_fn(a, b, *args, **kwargs):
        return gradient_to_e5m2(fn(_straight_through(a), _straight_through(b), *args, **kwargs))

    return fp8_fn
