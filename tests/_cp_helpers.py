"""Context-parallel attention against plain single-device attention, shared by the tests of
the jnp blocks and of the kernel."""

import functools

import jax
import numpy as np

from meshtrain import context_parallel as cp
from meshtrain.kernels import reference
from meshtrain.layout import activation_rules, rules_for
from meshtrain.mesh import make_mesh


@functools.partial(jax.jit, static_argnums=range(1, 6))
def qkv(seed, B, T, H, G, K):
    """Fresh random q, k, v and an output cotangent (one program per shape)."""
    ks = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(ks[0], (B, T, H, K)),
        jax.random.normal(ks[1], (B, T, G, K)),
        jax.random.normal(ks[2], (B, T, G, K)),
        jax.random.normal(ks[3], (B, T, H, K)),
    )


def errors_vs_full(
    algorithms, n, causal, H, G, T, *, K, B, window=None, impl="xla", layout=False, seed=0
):
    """Max |difference| of the output and of dq, dk, dv against full attention, per algorithm.

    The tokens take the zig-zag order for causal attention and its positions go in as a NumPy
    array, as the GPT passes them (so the ring halves its causal work); `layout` runs the call
    under the ``dp`` activation rules (the kernel per shard, batch over data).
    """
    mesh = make_mesh(f"data={8 // n},seq={n}")
    q, k, v, w = qkv(seed, B, T, H, G, K)
    idx = cp.order(T, n) if causal else np.arange(T)
    inv = cp.inverse(idx)

    def full(q, k, v, w):  # w an input, not a constant of the program
        o = reference.attention(q, k, v, causal=causal, window=window)
        return (o * w).sum(), o

    (_, o_want), g_want = jax.jit(jax.value_and_grad(full, (0, 1, 2), has_aux=True))(q, k, v, w)
    out = {}
    for algorithm in algorithms:

        def split(q, k, v, w, algorithm=algorithm):
            def run():
                return cp.context_attention(
                    q[:, idx], k[:, idx], v[:, idx], idx, mesh=mesh, algorithm=algorithm,
                    causal=causal, window=window, impl=impl,
                )  # fmt: skip

            if layout:
                with activation_rules(mesh, rules_for("dp", mesh)):
                    o = run()
            else:
                o = run()
            return (o * w[:, idx]).sum(), o[:, inv]

        with jax.set_mesh(mesh):
            (_, o), g = jax.jit(jax.value_and_grad(split, (0, 1, 2), has_aux=True))(q, k, v, w)
        pairs = zip((o, *g), (o_want, *g_want), strict=True)
        out[algorithm] = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in pairs]
    return out


def assert_split(step, state, batch, mesh, rules) -> None:
    """Under seq > 1 the context-parallel algorithm's collective is in the program of `step`
    (the run is not silently unsplit)."""
    if mesh.shape["seq"] > 1:
        want = {"ring": "collective_permute", "allgather": "all_gather", "ulysses": "all_to_all"}
        assert f"stablehlo.{want[rules.context_parallel]}" in step.lower(state, batch).as_text()
