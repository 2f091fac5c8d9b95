"""Tiled matmul with fused bias + activation (Pallas, interpreted on CPU) against jnp."""

import functools

import jax
import jax.numpy as jnp
import pytest
from _kernel_helpers import TOL, assert_all_written, assert_close, fresh_key, under_fsdp_tp

from meshtrain.kernels import matmul, poison_outputs, reference

TILES = dict(block_m=16, block_n=16, block_k=16)


@functools.partial(jax.jit, static_argnums=range(1, 6))
def _inputs(key, lead, K, N, dtype, bias=True):
    kx, kw, kb, kg = jax.random.split(key, 4)
    x = jax.random.normal(kx, (*lead, K)).astype(dtype)
    w = (jax.random.normal(kw, (K, N)) / K**0.5).astype(dtype)
    b = jax.random.normal(kb, (N,)) if bias else None
    g = jax.random.normal(kg, (*lead, N)).astype(dtype)
    return x, w, b, g


def _value_and_grads(fn, x, w, b, g):
    def loss(x, w, b):
        return jnp.sum(fn(x, w, b).astype(jnp.float32) * g.astype(jnp.float32))

    if b is None:
        return fn(x, w, None), jax.grad(lambda x, w: loss(x, w, None), (0, 1))(x, w)
    return fn(x, w, b), jax.grad(loss, (0, 1, 2))(x, w, b)


def _against(key, shapes, pallas, ref):
    """One program: fresh inputs of `shapes` (lead, K, N, dtype, bias) and the value and
    gradients of `pallas` and of `ref` on them."""

    def run(key):
        inputs = _inputs(key, *shapes)
        return _value_and_grads(pallas, *inputs), _value_and_grads(ref, *inputs)

    return jax.jit(run)(key)


# M, N, K none of them whole tiles; every activation; bf16 once; no bias once.
@pytest.mark.parametrize(
    "activation,lead,K,N,dtype,bias",
    [
        ("gelu", (3, 25), 40, 70, jnp.float32, True),
        ("relu", (19,), 33, 48, jnp.float32, True),
        ("silu", (2, 9), 64, 20, jnp.bfloat16, True),
        ("none", (30,), 24, 17, jnp.float32, False),
    ],
    ids=["gelu-f32", "relu-f32", "silu-bf16", "none-nobias"],
)
def test_matches_reference(activation, lead, K, N, dtype, bias):
    key, seed = fresh_key()
    fwd_tol, grad_tol = TOL[dtype]

    def pallas(x, w, b):
        return matmul(x, w, b, activation=activation, impl="pallas", **TILES)

    def ref32(x, w, b):
        return reference.matmul(
            x.astype(jnp.float32), w.astype(jnp.float32), b, activation=activation
        )

    (out, grads), (ref, ref_grads) = _against(key, (lead, K, N, dtype, bias), pallas, ref32)
    assert out.dtype == dtype and grads[1].dtype == dtype
    assert_close(out, ref, fwd_tol, "output", seed)
    for name, gr, r in zip(("dx", "dw", "dbias"), grads, ref_grads, strict=False):
        assert_close(gr, r, grad_tol, name, seed)


def test_every_output_element_is_written():
    key, _ = fresh_key()

    def pallas(x, w, b):
        return matmul(x, w, b, activation="gelu", impl="pallas", **TILES)

    def run(key):
        return _value_and_grads(pallas, *_inputs(key, (21,), 40, 35, jnp.float32))

    with poison_outputs():  # traced (and so built) inside: the kernels poisoned
        out, grads = jax.jit(run)(key)
    assert_all_written(out, *grads)


def test_sharded_over_the_batch_matches():
    key, seed = fresh_key()

    @under_fsdp_tp
    def sharded(x, w, b):
        return matmul(x, w, b, activation="silu", impl="pallas", **TILES)

    (out, grads), (ref, ref_grads) = _against(
        key,
        ((8, 5), 32, 24, jnp.float32, True),
        sharded,
        lambda x, w, b: reference.matmul(x, w, b, activation="silu"),
    )
    assert_close(out, ref, 2e-5, "output", seed)
    for name, gr, r in zip(("dx", "dw", "dbias"), grads, ref_grads, strict=True):
        assert_close(gr, r, 1e-4, name, seed)


def test_bad_input_errors():
    x, w = jnp.zeros((4, 8)), jnp.zeros((8, 16))
    with pytest.raises(ValueError, match=r"activation='tanh'; choose from none, relu, gelu, silu"):
        matmul(x, w, activation="tanh", impl="pallas")
    with pytest.raises(ValueError, match="do not chain"):
        matmul(x, jnp.zeros((9, 16)), impl="pallas")
    with pytest.raises(ValueError, match=r"bias \(8,\) must be \(16,\)"):
        matmul(x, w, jnp.zeros((8,)), impl="pallas")
    with pytest.raises(ValueError, match="must share one of float32, bfloat16"):
        matmul(x, w.astype(jnp.bfloat16), impl="pallas")
    with pytest.raises(ValueError, match="block_k=12 must be a power of two"):
        matmul(x, w, impl="pallas", block_k=12)
