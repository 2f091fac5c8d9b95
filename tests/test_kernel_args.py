"""The kernels' public wrappers check their arguments like flags: a wrong one is a ValueError of
one line naming the kernel, the argument and a fix, never a raw error from inside jax; and the
grouped matmul's group sizes follow their documented contract, known or traced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain import kernels as K
from meshtrain.kernels.grouped_matmul import grouped_matmul

RNG = np.random.default_rng()


def _normal(*shape) -> jax.Array:
    return jnp.asarray(RNG.normal(size=shape), jnp.float32)


X, W, Q = _normal(8, 4), _normal(2, 4, 3), _normal(1, 16, 2, 64)
LOGITS, TARGETS = _normal(6, 5), jnp.asarray(RNG.integers(0, 5, size=6))
SIZES = jnp.asarray([4, 4])

CASES = {
    "gmm-tile-float": (lambda: grouped_matmul(X, W, SIZES, tile=2.5), "tile=2.5 must be ≥ 1"),
    "gmm-tile-str": (lambda: grouped_matmul(X, W, SIZES, tile="8"), "tile='8' must be ≥ 1"),
    "gmm-tile-bool": (lambda: grouped_matmul(X, W, SIZES, tile=True), "tile=True must be"),
    "gmm-too-many-rows": (
        lambda: grouped_matmul(X, W, jnp.asarray([6, 6])),
        "sizes=[6, 6] claim 12 rows but x has 8; give sizes summing to at most 8",
    ),
    "gmm-negative": (lambda: grouped_matmul(X, W, jnp.asarray([-2, 6])), "a negative size"),
    "gmm-float-sizes": (lambda: grouped_matmul(X, W, SIZES * 1.0), "sizes must be integers"),
    "gmm-sizes-per-group": (lambda: grouped_matmul(X, W, jnp.asarray([4, 2, 2])), "do not chain"),
    "gmm-width": (lambda: grouped_matmul(X[:, :3], W, SIZES), "give w [L, 3, F]"),
    "gmm-rank": (lambda: grouped_matmul(X[None], W, SIZES), "must be [M, D], [L, D, F] and [L]"),
    "flash-block": (
        lambda: K.flash_attention(Q, Q, Q, impl="pallas", block_q=64.5),
        "flash_attention: block_q=64.5 must be a power of two ≥ 16; e.g. block_q=64",
    ),
    "flash-warps": (lambda: K.flash_attention(Q, Q, Q, impl="pallas", warps=2.5), "warps=2.5"),
    "flash-stages": (lambda: K.flash_attention(Q, Q, Q, impl="pallas", stages=1.5), "stages=1.5"),
    "flash-int": (
        lambda: K.flash_attention(*(Q.astype(jnp.int32),) * 3, impl="xla"),
        "attention needs floats",
    ),
    "rms-eps-nan": (
        lambda: K.rms_norm(X, jnp.ones(4), eps=float("nan"), impl="xla"),
        "rms_norm: eps=nan must be a finite number ≥ 0; e.g. eps=1e-05",
    ),
    "rms-eps-str": (lambda: K.rms_norm(X, jnp.ones(4), eps="a", impl="xla"), "eps='a'"),
    "layer-eps-inf": (
        lambda: K.layer_norm(X, jnp.ones(4), jnp.zeros(4), eps=float("inf"), impl="xla"),
        "layer_norm: eps=inf must be a finite number",
    ),
    "rms-block": (
        lambda: K.rms_norm(X, jnp.ones(4), impl="pallas", block_rows=2.5),
        "rms_norm: block_rows=2.5 must be a power of two ≥ 1; e.g. block_rows=64",
    ),
    "ce-block": (
        lambda: K.token_cross_entropy(LOGITS, TARGETS, impl="pallas", block_rows=2.5),
        "token_cross_entropy: block_rows=2.5 must be a power of two",
    ),
    "ce-vocab": (
        lambda: K.token_cross_entropy(LOGITS, TARGETS, impl="pallas", block_vocab=24.0),
        "block_vocab=24.0 must be a power of two ≥ 16",
    ),
    "mse-block": (
        lambda: K.mean_squared_error(X, X, impl="pallas", block_rows=2.5),
        "mean_squared_error: block_rows=2.5 must be a power of two",
    ),
    "matmul-block": (
        lambda: K.matmul(X, W[0], impl="pallas", block_m=32.5),
        "matmul: block_m=32.5 must be a power of two ≥ 16",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_wrong_argument_is_one_line_naming_it(case):
    call, message = CASES[case]
    with pytest.raises(ValueError) as raised:
        call()
    text = str(raised.value)
    assert message in text and "\n" not in text, text


def _reference(x, w, sizes) -> np.ndarray:
    """Row r times its group's weights, by the documented contract for sizes that do not fit:
    a negative size counts as 0, and the groups end at row M; rows past them give zeros."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(np.maximum(np.asarray(sizes), 0)):
        end = min(start + size, x.shape[0])
        y[start:end] = x[start:end] @ w[g]
        start = end
    return y


@pytest.mark.parametrize("impl", ["tiled", "xla"])
def test_traced_sizes_that_do_not_fit_are_cut_at_the_last_row(impl):
    x, w = _normal(10, 4), _normal(3, 4, 5)
    sizes = jnp.asarray([3, -2, 9])  # a negative group, and 12 rows claimed of 10
    got = jax.jit(lambda s: grouped_matmul(x, w, s, impl=impl, tile=4))(sizes)
    np.testing.assert_allclose(got, _reference(x, w, sizes), rtol=1e-5, atol=1e-5)
    fits = jnp.asarray([3, 4, 2])  # sizes that fit are used as given
    got = jax.jit(lambda s: grouped_matmul(x, w, s, impl=impl, tile=4))(fits)
    np.testing.assert_allclose(got, _reference(x, w, fits), rtol=1e-5, atol=1e-5)
