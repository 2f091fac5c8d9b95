"""Fused RMSNorm / LayerNorm (Pallas, interpreted on CPU) against the jnp references and flax."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_helpers import TOL, assert_all_written, assert_close, fresh_key, under_fsdp_tp
from flax import nnx

from meshtrain.kernels import layer_norm, poison_outputs, reference, rms_norm

KINDS = {
    "rms": (rms_norm, lambda x, w, b, **kw: reference.rms_norm(x, w, **kw)),
    "layer": (layer_norm, lambda x, w, b, **kw: reference.layer_norm(x, w, b, **kw)),
}


def _call(kind, x, w, b, **kw):
    fn = KINDS[kind][0]
    return fn(x, w, **kw) if kind == "rms" else fn(x, w, b, **kw)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _inputs(key, shape, dtype):
    kx, kw, kb, kd = jax.random.split(key, 4)
    D = shape[-1]
    x = (2.0 * jax.random.normal(kx, shape) + 0.5).astype(dtype)
    w = 1.0 + 0.2 * jax.random.normal(kw, (D,))
    b = 0.2 * jax.random.normal(kb, (D,))
    dy = jax.random.normal(kd, shape).astype(dtype)
    return x, w, b, dy


def _value_and_grads(fn, x, w, b, dy):
    def loss(x, w, b):
        return jnp.sum(fn(x, w, b).astype(jnp.float32) * dy.astype(jnp.float32))

    return fn(x, w, b), jax.grad(loss, (0, 1, 2))(x, w, b)


def _against(key, shape, dtype, pallas, ref=None):
    """One program: fresh inputs and the value and gradients of `pallas` and of `ref`."""

    def run(key):
        inputs = _inputs(key, shape, dtype)
        return [_value_and_grads(fn, *inputs) for fn in (pallas, ref) if fn is not None]

    return jax.jit(run)(key)


# Rows not a multiple of the block, features not a power of two (padded and masked).
@pytest.mark.parametrize(
    "kind,shape,dtype",
    [
        ("rms", (3, 7, 96), jnp.float32),
        ("layer", (3, 7, 96), jnp.float32),
        ("rms", (50, 128), jnp.bfloat16),
        ("layer", (50, 128), jnp.bfloat16),
        ("layer", (1, 5, 40), jnp.float32),
    ],
    ids=[
        "rms-3x7x96-f32",
        "layer-3x7x96-f32",
        "rms-50x128-bf16",
        "layer-50x128-bf16",
        "layer-1x5x40-f32",
    ],
)
def test_matches_reference(kind, shape, dtype):
    key, seed = fresh_key()
    fwd_tol, grad_tol = TOL[dtype]

    def pallas(x, w, b):
        return _call(kind, x, w, b, eps=1e-5, impl="pallas", block_rows=16)

    def ref32(x, w, b):
        return KINDS[kind][1](x.astype(jnp.float32), w, b, eps=1e-5)

    (out, grads), (ref, ref_grads) = _against(key, shape, dtype, pallas, ref32)
    assert out.dtype == dtype and grads[0].dtype == dtype
    assert_close(out, ref, fwd_tol, "output", seed)
    names = ("dx", "dscale", "dbias") if kind == "layer" else ("dx", "dscale")
    for name, g, r in zip(names, grads, ref_grads, strict=False):
        assert_close(g, r, grad_tol, name, seed)


def test_references_are_flax_norms():
    key, _ = fresh_key()
    x, w, b, _ = _inputs(key, (2, 5, 64), jnp.float32)
    rngs = nnx.Rngs(0)
    rms = nnx.RMSNorm(64, epsilon=1e-5, rngs=rngs)
    rms.scale[...] = w
    ln = nnx.LayerNorm(64, epsilon=1e-5, rngs=rngs)
    ln.scale[...] = w
    ln.bias[...] = b
    got = jax.jit(
        lambda x: (reference.rms_norm(x, w), rms(x), reference.layer_norm(x, w, b), ln(x))
    )
    ref_rms, flax_rms, ref_ln, flax_ln = got(x)
    np.testing.assert_allclose(ref_rms, flax_rms, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ref_ln, flax_ln, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_every_output_element_is_written(kind):
    key, _ = fresh_key()

    def pallas(x, w, b):
        return _call(kind, x, w, b, impl="pallas", block_rows=8)

    with poison_outputs():  # traced (and so built) inside: the kernels poisoned
        [(out, grads)] = _against(key, (37, 80), jnp.float32, pallas)
    assert_all_written(out, *grads)


def test_sharded_over_the_batch_matches():
    """Under a data×fsdp×tensor mesh the kernel runs per shard; values and grads unchanged."""
    key, seed = fresh_key()

    @under_fsdp_tp
    def sharded(x, w, b):
        return layer_norm(x, w, b, impl="pallas")

    (out, grads), (ref, ref_grads) = _against(
        key, (8, 6, 64), jnp.float32, sharded, reference.layer_norm
    )
    assert_close(out, ref, 2e-5, "output", seed)
    for name, g, r in zip(("dx", "dscale", "dbias"), grads, ref_grads, strict=True):
        assert_close(g, r, 1e-4, name, seed)
    x, w = jax.ShapeDtypeStruct((8, 6, 64), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.float32)
    jaxpr = str(jax.make_jaxpr(sharded)(x, w, w))
    assert "shard_map" in jaxpr


def test_bad_input_errors():
    x = jnp.zeros((4, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"scale has shape \(32,\); expected \(64,\)"):
        rms_norm(x, jnp.ones((32,)), impl="pallas")
    with pytest.raises(ValueError, match=r"dtype float16 is not supported.*float32, bfloat16"):
        rms_norm(x.astype(jnp.float16), jnp.ones((64,)), impl="pallas")
    with pytest.raises(ValueError, match=r"impl='cudnn' is not one of pallas, xla, auto"):
        layer_norm(x, jnp.ones((64,)), jnp.zeros((64,)), impl="cudnn")
