"""Compiled (not interpreted) norms, cross-entropy and matmul on a GPU, bf16, at sizes that
fill several blocks, against the float32 references. Skipped without a GPU (conftest)."""

import jax
import jax.numpy as jnp
import pytest
from _kernel_helpers import assert_close, fresh_key

from meshtrain.kernels import layer_norm, matmul, reference, rms_norm, token_cross_entropy

pytestmark = pytest.mark.gpu


def _grad(fn, args, g):
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * g), range(len(args)))(*args)


def test_norms_compiled():
    key, seed = fresh_key()
    kx, kw, kb, kg = jax.random.split(key, 4)
    x = jax.random.normal(kx, (4099, 1000), jnp.bfloat16)
    w, b = 1 + 0.1 * jax.random.normal(kw, (1000,)), 0.1 * jax.random.normal(kb, (1000,))
    g = jax.random.normal(kg, x.shape)
    x32 = x.astype(jnp.float32)
    for fn, ref, args in (
        (rms_norm, reference.rms_norm, (w,)),
        (layer_norm, reference.layer_norm, (w, b)),
    ):
        pallas = jax.jit(lambda x, *a, fn=fn: fn(x, *a, impl="pallas"))
        assert_close(pallas(x, *args), ref(x32, *args), 2e-2, fn.__name__, seed)
        for i, (p, r) in enumerate(
            zip(_grad(pallas, (x, *args), g), _grad(ref, (x32, *args), g), strict=True)
        ):
            assert_close(p, r, 3e-2, f"{fn.__name__} grad {i}", seed)


def test_cross_entropy_compiled():
    key, seed = fresh_key()
    kx, kt, kg = jax.random.split(key, 3)
    x = (3 * jax.random.normal(kx, (2049, 50257))).astype(jnp.bfloat16)
    t = jax.random.randint(kt, (2049,), 0, 50257)
    g = jax.random.normal(kg, (2049,))
    pallas = jax.jit(lambda x: token_cross_entropy(x, t, impl="pallas"))
    ref = lambda x: reference.token_cross_entropy(x.astype(jnp.float32), t)  # noqa: E731
    assert_close(pallas(x), ref(x), 1e-5, "loss", seed)
    assert_close(_grad(pallas, (x,), g)[0], _grad(ref, (x,), g)[0], 3e-2, "grad", seed)


def test_matmul_compiled():
    key, seed = fresh_key()
    kx, kw, kb, kg = jax.random.split(key, 4)
    x = jax.random.normal(kx, (1000, 700), jnp.bfloat16)
    w = (jax.random.normal(kw, (700, 900)) / 26).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (900,))
    g = jax.random.normal(kg, (1000, 900))
    pallas = jax.jit(lambda x, w, b: matmul(x, w, b, activation="gelu", impl="pallas"))

    def ref(x, w, b):
        return reference.matmul(x.astype(jnp.float32), w.astype(jnp.float32), b, activation="gelu")

    assert_close(pallas(x, w, b), ref(x, w, b), 2e-2, "output", seed)
    for i, (p, r) in enumerate(
        zip(_grad(pallas, (x, w, b), g), _grad(ref, (x, w, b), g), strict=True)
    ):
        assert_close(p, r, 3e-2, f"grad {i}", seed)
