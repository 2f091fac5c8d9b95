"""cuDNN's fused attention differentiated per shard (`kernels._shard_vjp`), so it runs in a
region nested in a manual one: a pipeline stage, the replicas' own step.

Without a GPU, `cudnn_stand_in` serves the same `jax.nn.dot_product_attention` call with jax's
XLA implementation: the gradients through meshtrain's per-shard custom VJP are compared with
the jnp reference's. The cuda export then shows the real cuDNN forward and backward calls in a
pipeline stage's program (jax's cuDNN version check is answered for the export: nothing
runs).
"""

import jax
import jax.numpy as jnp
import pytest
from _cudnn import CUDNN_CALLS, cudnn_for_export, cudnn_stand_in
from _kernel_helpers import TOL, assert_close, fresh_key
from jax import export
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from meshtrain import layout
from meshtrain.kernels import attention

B, T, H, G, K = 4, 32, 4, 2, 64  # 4 query heads on tensor=4, 2 key/value heads picked


def _inputs(key):
    """bfloat16 queries, keys and values (cuDNN's dtype) and a float32 cotangent weight."""
    keys = jax.random.split(key, 4)
    q = jax.random.normal(keys[0], (B, T, H, K), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (B, T, G, K), jnp.bfloat16) for kk in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], (B, T, H, K))


def _grads(impl, w):
    """The gradients of a weighted sum of `impl`'s attention (the reference in float32)."""

    def loss(q, k, v):
        if impl == "xla":
            q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        return (attention.flash_attention(q, k, v, impl=impl).astype(jnp.float32) * w).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


@pytest.mark.parametrize("nested", [False, True], ids=["layout", "inside-a-manual-region"])
def test_cudnn_gradients_per_shard_equal_the_reference(monkeypatch, nested):
    calls = cudnn_stand_in(monkeypatch)
    key, seed = fresh_key()
    q, k, v, w = _inputs(key)
    mesh = _mesh((2, 1, 4), ("data", "fsdp", "tensor"))
    rules = layout.rules_for("dp+tp")
    if not nested:
        want = _grads("xla", w)(q, k, v)

        def fn(q, k, v):
            with layout.activation_rules(mesh, rules):
                return _grads("cudnn", w)(q, k, v)
    else:  # each data shard differentiates its own block, as a pipeline stage does
        halves = [slice(0, B // 2), slice(B // 2, B)]
        per = [_grads("xla", w[s])(q[s], k[s], v[s]) for s in halves]
        want = [jnp.concatenate([p[i] for p in per]) for i in range(3)]

        def fn(q, k, v):
            with layout.activation_rules(mesh, rules):
                region = layout.manual_region(
                    lambda q, k, v, w: _grads("cudnn", w)(q, k, v), mesh=mesh, axes={"data"},
                    in_specs=(P("data"),) * 4, out_specs=(P("data"),) * 3,
                )  # fmt: skip
                return region(q, k, v, w)

    got = jax.jit(fn)(q, k, v)
    assert calls  # the cuDNN path ran
    for g, r, name in zip(got, want, "qkv", strict=True):
        assert_close(g, r, TOL[jnp.bfloat16][1], f"d{name}", seed)


def test_cudnn_inside_a_pipeline_stage_exports_for_cuda_with_the_fused_calls(monkeypatch):
    """A stage (a region manual over ``pipe``) differentiating cuDNN's attention, heads over
    ``tensor``: the program for ``cuda`` holds one cuDNN forward and one backward call, which
    jax's own differentiation of the nested region could not produce."""
    cudnn_for_export(monkeypatch)
    mesh = _mesh((2, 2, 2), ("pipe", "data", "tensor"))
    rules = layout.rules_for("dp+tp")

    def stage(q, k, v):
        loss = lambda q, k, v: attention.flash_attention(q, k, v, impl="cudnn").sum()
        return jax.grad(loss, argnums=(0, 1, 2))(*layout.varying((q, k, v)))

    def step(q, k, v):
        with layout.activation_rules(mesh, rules):
            return layout.manual_region(
                stage, mesh=mesh, axes={"pipe"}, in_specs=(P("pipe"),) * 3,
                out_specs=(P("pipe"),) * 3,
            )(q, k, v)  # fmt: skip

    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    exported = export.export(
        jax.jit(step),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(c) for c in CUDNN_CALLS],
    )(spec(2 * B, 128, H, K), spec(2 * B, 128, G, K), spec(2 * B, 128, G, K))
    module = exported.mlir_module()
    assert [module.count(f"@{c}(") for c in CUDNN_CALLS] == [1, 1]
