"""fp8 matmuls with current scaling: e4m3 operands forward, e5m2 gradients backward.

Each operand is scaled by a power of two so that its largest magnitude lands just below the
format's maximum (the scale is this step's amax: *current* scaling) and rounded to fp8. The
dot multiplies the fp8 arrays themselves (`lax.dot_general` with fp8 operands, the result in
the compute dtype) and multiplies the result by the two scales. On Hopper that dot is an fp8
GEMM; elsewhere XLA widens the operands, which is exact, so every backend computes the same
function. The backward quantises the incoming gradient to e5m2 (more range, less precision)
and multiplies it with the e4m3 operands saved by the forward, which are kept in fp8 (one
byte each).

Why the dot takes fp8 operands rather than dequantised ones: next to a bfloat16 dot, XLA's GPU
compiler simplifies a conversion to fp8 and straight back into one conversion to bfloat16, so
the rounding disappears and the dot runs in bfloat16 (seen in the compiled program on an H100,
jax 0.11.2). `round_trip`, for the products that are not one `dot_general`, rounds without an
fp8 array for the same reason.

Both public products are one custom VJP over a bilinear product (`_fp8_product`): round the
operands, linearize the product there, round the incoming gradient and pull it back. They
differ in how a rounded value is held, and so in how the product is linearized: `dot_general`
keeps fp8 arrays and their scales (fp8 GEMMs, one-byte residuals; its transposes are written
out, as autodiff would cast the gradients to fp8), `matmul` keeps values rounded in their own
dtype and differentiates the product by autodiff, for products such as the MoE's grouped
matmul that take no fp8 operands.

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
from jax import lax, tree_util
from jax.extend import core as jex

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
    """`x` rounded through `fmt` with current scaling, back in its own dtype.

    Bit for bit what ``quantize`` then ``dequantize`` give, computed without an fp8 array:
    XLA's GPU compiler simplifies a conversion to fp8 and straight back away (seen on an
    H100, jax 0.11.2), which would silently skip the rounding. ``reduce_precision`` keeps the
    format's mantissa bits (round to nearest even) and below the smallest normal the values
    round to multiples of the smallest subnormal, as fp8 does."""
    info = jnp.finfo(fmt)
    scale = lax.stop_gradient(scale_for(jnp.max(jnp.abs(x)), fmt))
    top = float(info.max)
    y = jnp.clip(x.astype(jnp.float32) / scale, -top, top)
    step = float(info.smallest_subnormal)
    normal = lax.reduce_precision(y, exponent_bits=8, mantissa_bits=int(info.nmant))
    r = jnp.where(jnp.abs(y) < float(info.smallest_normal), jnp.round(y / step) * step, normal)
    return (r * scale).astype(x.dtype)


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
    return _fp8_product(lhs, rhs, (), functools.partial(_linearize_dot, dot), True)


def matmul(fn):
    """A matmul `fn(a, b, ...)` made fp8: operands rounded to e4m3 (their gradients passed
    straight through), the output's gradient rounded to e5m2. For matmuls that are not a
    plain `dot_general` (the MoE's per-expert and grouped products)."""

    def fp8_fn(a, b, *args, **kwargs):
        product, consts = _explicit(functools.partial(_bind_rest, fn, args, kwargs), a, b)
        return _fp8_product(a, b, consts, functools.partial(_linearize_traced, product), False)

    return fp8_fn


# ---- the one mechanism: a custom VJP over a bilinear product ---------------------------------
#
# A product P(a, b), linear in each operand, is made fp8 by rounding both operands to e4m3 and
# linearizing P there; the backward rounds the incoming gradient to e5m2 and pulls it back
# through that linearization, which passes the gradient straight through the rounding.
# `fp8_residuals` picks how a rounded value is held: as its fp8 array and power-of-two scale
# (the product multiplies the fp8 arrays and then the scales, which linearity allows, and the
# backward keeps one byte an element), or rounded in its own dtype by `round_trip` (no scale),
# for products that take no fp8 operands.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_product(a: jax.Array, b: jax.Array, consts, linearize, fp8_residuals: bool) -> jax.Array:
    """The product at `a`, `b` rounded to e4m3 (`linearize` gives its value and pullback at
    rounded operands, given the product's other inputs `consts`, which get no gradient); the
    gradient arriving at the output is rounded to e5m2."""
    return _fp8_forward(a, b, consts, linearize, fp8_residuals)[0]


def _fp8_forward(a, b, consts, linearize, fp8_residuals):
    """The product at the rounded operands, and its pullback there (the residuals)."""
    a_rounded, b_rounded = _rounded(a, E4M3, fp8_residuals), _rounded(b, E4M3, fp8_residuals)
    return linearize(a_rounded, b_rounded, a, b, consts)


def _fp8_backward(linearize, fp8_residuals, pullback, g):
    """The e5m2-rounded gradient pulled back through the product at the rounded operands."""
    return (*pullback(_rounded(g, E5M2, fp8_residuals)), None)


_fp8_product.defvjp(_fp8_forward, _fp8_backward)


def _rounded(x: jax.Array, fmt, fp8_residuals: bool) -> tuple[jax.Array, jax.Array | None]:
    """`x` rounded to `fmt`: its fp8 array and scale, or its own dtype's values and no scale."""
    return quantize(x, fmt) if fp8_residuals else (round_trip(x, fmt), None)


def _explicit(product, a, b):
    """`product` as a function of ``(a, b, *consts)``, and those consts: every value it closes
    over (traced ones too, such as the experts' group sizes) made an argument, as what a custom
    VJP holds static must hold no tracer (`jax.closure_convert` hoists only float ones)."""
    closed = jax.make_jaxpr(product)(a, b)

    def explicit(x, y, *consts):
        (out,) = jex.jaxpr_as_fun(jex.ClosedJaxpr(closed.jaxpr, consts))(x, y)
        return out

    return explicit, tuple(closed.consts)


def _bind_rest(fn, args, kwargs, a, b):
    """`fn(a, b, *args, **kwargs)`: a matmul's operands first, its other arguments fixed."""
    return fn(a, b, *args, **kwargs)


def _linearize_traced(product, a_rounded, b_rounded, a, b, consts):
    """The product and its pullback at operands rounded in their own dtype, by autodiff."""
    del a, b  # the rounded operands keep the operands' dtypes
    (a_r, _), (b_r, _) = a_rounded, b_rounded
    out, pullback = jax.vjp(lambda x, y: product(x, y, *consts), a_r, b_r)
    return out, tree_util.Partial(_unscaled, pullback)


def _unscaled(pullback, g_rounded):
    """A pullback applied to a gradient rounded in its own dtype (no scale)."""
    g_r, _ = g_rounded
    return pullback(g_r)


# ---- the dense product: fp8 arrays into lax.dot_general ----------------------------------------


def _dot(dimension_numbers, precision, preferred_element_type, out_sharding):
    """`lax.dot_general` with every setting but the operands fixed (static: it travels in
    `_fp8_product`'s non-differentiable `linearize`)."""
    return functools.partial(
        lax.dot_general,
        dimension_numbers=dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
    )


def _linearize_dot(dot, lhs_rounded, rhs_rounded, lhs, rhs, consts):
    """The dot of fp8 operands times their scales, in the dtype of the dot of `lhs` and `rhs`,
    and its pullback, whose products take fp8 operands too (autodiff's would not: a
    transposed dot returns its operand's dtype, here fp8)."""
    del consts  # a dot has no other inputs
    (lhs_q, lhs_s), (rhs_q, rhs_s) = lhs_rounded, rhs_rounded
    dtype = jax.eval_shape(dot, lhs, rhs).dtype
    # The dot's operands ARE fp8: XLA's GPU compiler turns it into an fp8 GEMM, and no pass
    # can drop the rounding (a quantise-dequantise pair next to a bf16 dot is simplified
    # to bf16 by XLA's GPU compiler: seen on an H100, jax 0.11.2).
    out = _scaled_dot(dot, lhs_q, rhs_q, lhs_s * rhs_s, dtype)
    # The operands are saved in fp8; empty arrays carry their dtypes to the backward.
    saved = (lhs_q, lhs_s, rhs_q, rhs_s, jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    return out, tree_util.Partial(functools.partial(_dot_pullback, dot), *saved)


def _scaled_dot(dot, lhs_q, rhs_q, scale, dtype, **dims) -> jax.Array:
    """A dot of fp8 operands, its result in `dtype` multiplied by `scale` (a power of two)."""
    out = dot(lhs_q, rhs_q, preferred_element_type=dtype, **dims)
    return out * scale.astype(dtype)


def _dot_pullback(dot, lhs_q, lhs_s, rhs_q, rhs_s, lhs_like, rhs_like, g_rounded):
    """The two gradients of a dot of fp8 operands for an e5m2-rounded output gradient, each
    in its operand's dtype and axis order."""
    g_q, g_s = g_rounded
    (contract_l, contract_r), (batch_l, batch_r) = dot.keywords["dimension_numbers"]
    free_l = _free(lhs_q.ndim, contract_l, batch_l)
    free_r = _free(rhs_q.ndim, contract_r, batch_r)
    nb = len(batch_l)
    g_batch = tuple(range(nb))
    g_of_l = tuple(range(nb, nb + len(free_l)))  # g's axes that come from lhs's free axes
    g_of_r = tuple(range(nb + len(free_l), g_q.ndim))
    # dlhs = g · rhs over rhs's free axes: [batch, lhs free, rhs contracting (ascending)]
    d_lhs = _scaled_dot(
        dot, g_q, rhs_q, g_s * rhs_s, lhs_like.dtype,
        dimension_numbers=((g_of_r, free_r), (g_batch, batch_r)), out_sharding=None,
    )  # fmt: skip
    d_lhs = _to_operand_axes(d_lhs, batch_l, free_l, contract_l, contract_r)
    # drhs = g · lhs over lhs's free axes: [batch, rhs free, lhs contracting (ascending)]
    d_rhs = _scaled_dot(
        dot, g_q, lhs_q, g_s * lhs_s, rhs_like.dtype,
        dimension_numbers=((g_of_l, free_l), (g_batch, batch_l)), out_sharding=None,
    )  # fmt: skip
    d_rhs = _to_operand_axes(d_rhs, batch_r, free_r, contract_r, contract_l)
    return d_lhs, d_rhs


def _free(ndim: int, contracting, batch) -> tuple[int, ...]:
    """The axes of an operand that are neither contracted nor batched, in order."""
    return tuple(a for a in range(ndim) if a not in contracting and a not in batch)


def _to_operand_axes(grad, batch, free, contracting, other_contracting) -> jax.Array:
    """A gradient laid out [batch, free, the other operand's contracting axes ascending]
    transposed to its operand's own axis order."""
    pairs = sorted(zip(other_contracting, contracting, strict=True))
    source = (*batch, *free, *(mine for _, mine in pairs))  # operand axis of each grad axis
    return jnp.transpose(grad, tuple(source.index(a) for a in range(grad.ndim)))


@jax.custom_vjp
def gradient_to_e5m2(y: jax.Array) -> jax.Array:
    """`y` itself; its gradient is rounded to e5m2 on the way back."""
    return y


gradient_to_e5m2.defvjp(lambda y: (y, None), lambda _, g: (round_trip(g, E5M2),))
