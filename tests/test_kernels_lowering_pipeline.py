"""The Pallas kernels lower for an H100 target on a CPU-only machine in a pipeline stage's
position: inside a region manual over ``pipe`` that checks varying axes, differentiated there
(as 1F1B's stage backward is), forward and backward.

As tests/test_kernels_lowering.py: the kernels' non-interpreted path is switched on and the
program is exported for ``cuda`` on an abstract mesh of abstract H100s, which runs Pallas'
Triton lowering without a GPU; the `gpu`-marked test below compiles the same stage work for
real and compares it with the jnp paths.
"""

import jax
import jax.numpy as jnp
import pytest
from _kernel_helpers import TRITON_CALL, h100
from jax import export
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from meshtrain import kernels
from meshtrain.layout import manual_region, varying

H100 = h100()
MESH = AbstractMesh((2, 2), ("pipe", "tensor"), (AxisType.Auto,) * 2, abstract_device=H100)
B, T, H, G, K, V = 2, 256, 4, 2, 64, 512
D = H * K


def _spec(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _stage(x, scale, wq, wk, wv, w_out, targets):
    """A stage's work on its own block: norm, attention, loss head, all with the kernels."""
    h = kernels.rms_norm(x, scale, impl="pallas")
    q = (h @ wq).reshape(B, T, H, K)
    k, v = ((h @ w).reshape(B, T, G, K) for w in (wk, wv))
    o = kernels.flash_attention(q, k, v, impl="pallas").reshape(B, T, D)
    logits = (o @ w_out).astype(jnp.float32)
    return kernels.token_cross_entropy(logits, targets, impl="pallas").mean()


def _per_stage(x, scale, wq, wk, wv, w_out, targets):
    """Each stage differentiates its own stage function (its parameters marked varying, as
    the pipeline does) and returns the gradients."""
    params = varying((x, scale, wq, wk, wv, w_out))
    grads = jax.grad(lambda p: _stage(*p, targets))(params)
    return tuple(g[None] for g in grads)


def test_kernels_inside_a_stage_lower_for_h100(compiled_path):
    stage = P("pipe")
    args = (
        _spec(2 * B, T, D), _spec(2 * D), _spec(2 * D, D), _spec(2 * D, G * K),
        _spec(2 * D, G * K), _spec(2 * D, V), _spec(2 * B, T, dtype=jnp.int32),
    )  # fmt: skip
    region = manual_region(
        _per_stage, mesh=MESH, axes={"pipe"}, in_specs=(stage,) * 7, out_specs=(stage,) * 6
    )
    with jax.sharding.use_abstract_mesh(MESH):
        exported = export.export(
            jax.jit(region),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
        )(*args)
    # norm forward and backward, attention forward, dq and dk/dv, cross-entropy forward and
    # backward
    assert exported.mlir_module().count(TRITON_CALL) == 7


@pytest.mark.gpu
def test_kernels_inside_a_stage_compile_and_match_the_jnp_paths_on_a_gpu():
    """On a GPU: the stage's work compiled (Triton, not interpreted) inside a one-device
    region manual over ``pipe``, its gradients against the same work with the jnp paths."""
    from meshtrain.mesh import make_mesh

    gpu = [d for d in jax.devices() if d.platform == "gpu"][:1]
    mesh = make_mesh("pipe=1", devices=gpu)
    keys = jax.random.split(jax.random.key(0), 7)
    shapes = [(B, T, D), (D,), (D, D), (D, G * K), (D, G * K), (D, V)]
    args = [jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16) * 0.05
            for k, s in zip(keys, shapes, strict=False)]  # fmt: skip
    targets = jax.random.randint(keys[-1], (B, T), 0, V)

    def grads(impl):
        def stage(x, scale, wq, wk, wv, w_out):
            h = kernels.rms_norm(x, scale, impl=impl)
            q = (h @ wq).reshape(B, T, H, K)
            k, v = ((h @ w).reshape(B, T, G, K) for w in (wk, wv))
            o = kernels.flash_attention(q, k, v, impl=impl).reshape(B, T, D)
            logits = (o @ w_out).astype(jnp.float32)
            return kernels.token_cross_entropy(logits, targets, impl=impl).mean()

        def per_stage(*p):
            # the gradients vary over pipe (their parameters do), so each stage returns its own
            return tuple(g[None] for g in jax.grad(lambda p: stage(*p))(varying(p)))

        region = manual_region(
            per_stage, mesh=mesh, axes={"pipe"}, in_specs=(P(),) * 6, out_specs=(P("pipe"),) * 6
        )
        return [g[0] for g in jax.jit(region)(*args)]

    for got, want in zip(grads("pallas"), grads("xla"), strict=True):
        got, want = (jnp.asarray(a, jnp.float32) for a in (got, want))
        err = float(jnp.abs(got - want).max() / jnp.maximum(jnp.abs(want).max(), 1e-6))
        assert err < 3e-2, err  # bf16 inputs, float32 accumulation in both paths
