"""What the packed and MoE pipeline tests share: random parameters and the fp32 comparison."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshtrain.models import build_model

GRAD_RTOL, LOSS_RTOL = 2e-5, 1e-5  # fp32, as tests/test_pipeline.py


def random_params(cfg, seed):
    """``(graphdef, params)`` of `cfg`'s model with random float32 parameters from numpy."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))
    rng = np.random.default_rng(seed)
    shapes = nnx.to_pure_dict(state)
    values = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.2, x.shape), x.dtype), shapes)
    return graphdef, values


def assert_close(got, want, what):
    """Every leaf of `got` finite and within `GRAD_RTOL` of `want`'s largest entry."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                            strict=True):  # fmt: skip
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(a)), f"{what} {jax.tree_util.keystr(path)}"
        err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-6)
        assert err <= GRAD_RTOL, f"{what} {jax.tree_util.keystr(path)}: rel err {err:.2e}"
