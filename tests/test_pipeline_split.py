"""Tests for meshtrain.pipeline.split: a backward cut into its input pass and its weight pass
computes exactly the backward's gradients, with every equation in one pass only.

fp32 tolerance: the passes run the backward's own equations in its order, so they agree with
`jax.vjp` to float32 rounding (1e-6 relative to the largest entry; measured ≤ 1e-7).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtrain.models import GPTConfig, build_model
from meshtrain.pipeline.split import split_backward

RTOL = 1e-6


def _layer(remat: str):
    """One llama block as ``f(params, x) -> y``, its random parameters and a random input."""
    cfg = GPTConfig(style="llama", d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                    max_seq_len=8, vocab_size=64, remat=remat)  # fmt: skip
    parts = build_model(cfg, seed=0).pipeline_parts()
    blocks = getattr(build_model(cfg, seed=0), parts.blocks)
    graphdef, state = nnx.split(blocks)
    rng = np.random.default_rng(7)
    params = jax.tree.map(
        lambda a: jnp.asarray(rng.normal(0, 0.3, a.shape), a.dtype), nnx.to_pure_dict(state)
    )
    x = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32)
    return (lambda c, x: parts.run_blocks(nnx.merge(graphdef, c), x)), params, x


def _cut(f, params, x, ct):
    """The backward of `f` at (params, x) cut in two, with the full vjp for reference."""
    y, vjp = jax.vjp(f, params, x)
    leaves, treedef = jax.tree.flatten(vjp)

    def bwd(*a):
        g_c, g_x = jax.tree.unflatten(treedef, list(a[:-1]))(a[-1])
        return [g_x, *jax.tree.leaves(g_c)]

    cut = split_backward(bwd, [*leaves, ct], 1, len(leaves))
    return cut, leaves, bwd


@pytest.mark.parametrize("remat", ["none", "full"])
def test_input_and_weight_passes_equal_the_whole_backward(remat):
    f, params, x = _layer(remat)
    ct = jnp.asarray(np.random.default_rng(3).normal(size=x.shape), jnp.float32)
    cut, leaves, bwd = _cut(f, params, x, ct)
    (g_x,), handover = cut.input_pass(*leaves, ct)
    g_w = cut.weight_pass(leaves, handover)
    want = bwd(*leaves, ct)
    assert [h.shape for h in handover] == [s.shape for s in cut.handover]
    for got, ref in zip([g_x, *g_w], want, strict=True):
        ref = np.asarray(ref)
        err = np.abs(np.asarray(got) - ref).max() / max(np.abs(ref).max(), 1e-6)
        assert err <= RTOL, err


@pytest.mark.parametrize("remat", ["none", "full"])
def test_no_matmul_runs_twice_and_the_weight_pass_holds_only_weight_gradients(remat):
    """The two passes' matrix products add up to the whole backward's (nothing recomputed);
    the weight pass's are the seven weight matrices' gradients (q, k, v, o, gate, up, down)
    and B's the rest."""
    f, params, x = _layer(remat)
    ct = jnp.zeros_like(x)
    cut, leaves, bwd = _cut(f, params, x, ct)
    (_,), handover = cut.input_pass(*leaves, ct)

    def dots(fn, *args):
        return _count(jax.make_jaxpr(fn)(*args).jaxpr, "dot_general")

    whole = dots(bwd, *leaves, ct)
    b = dots(lambda *a: cut.input_pass(*a), *leaves, ct)
    w = dots(lambda h: cut.weight_pass(leaves, h), handover)
    assert w == 7
    assert b + w == whole


def _count(jaxpr, name: str) -> int:
    """Equations named `name` in `jaxpr` and every jaxpr nested in it."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                n += _count(inner, name)
    return n
