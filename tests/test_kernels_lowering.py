"""Every Pallas kernel, forward and backward, lowers for an H100 target on a CPU-only machine.

The kernels are exported for ``cuda`` inside an abstract mesh whose device is an abstract H100
(recipe: the jax-0.12 field notes), with their non-interpreted path switched on. That runs
Pallas' Triton lowering, which the interpret-mode tests never touch, and catches its errors
in CI on both the jax of the venv and, in `make test-lowest`, jax 0.11.2 (the GPU image's).
It does not compile Triton to PTX: the `gpu`-marked tests do that on a GPU.
"""

import jax
import jax.numpy as jnp
import pytest
from _kernel_helpers import TRITON_CALL, export_for_cuda, h100
from jax.sharding import AbstractMesh, AxisType

from meshtrain import kernels

H100 = h100()


def _spec(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _grad_of(fn, n_args):
    """fwd+bwd: the gradient of sum(fn(...)) in float32 with respect to the first n_args."""
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), tuple(range(n_args)))


# name -> (function, argument specs, Triton calls expected in its module)
CASES = {
    "attention_fwd": (
        lambda q, k, v: kernels.flash_attention(q, k, v, impl="pallas"),
        (_spec(2, 256, 8, 128), _spec(2, 256, 2, 128), _spec(2, 256, 2, 128)),
        1,
    ),
    "attention_fwd_bwd": (
        _grad_of(lambda q, k, v: kernels.flash_attention(q, k, v, impl="pallas"), 3),
        (_spec(2, 256, 4, 64), _spec(2, 256, 4, 64), _spec(2, 256, 4, 64)),
        3,  # forward, dq, dk/dv
    ),
    "attention_segments_fwd_bwd": (  # packed documents: the segment-id mask
        _grad_of(
            lambda q, k, v, s: kernels.flash_attention(q, k, v, impl="pallas", segment_ids=s), 3
        ),
        (
            _spec(2, 200, 4, 64),
            _spec(2, 200, 2, 64),
            _spec(2, 200, 2, 64),
            _spec(2, 200, dtype=jnp.int32),
        ),
        3,
    ),
    "rms_norm_fwd_bwd": (
        _grad_of(lambda x, w: kernels.rms_norm(x, w, impl="pallas"), 2),
        (_spec(1000, 768), _spec(768, dtype=jnp.float32)),
        2,
    ),
    "layer_norm_fwd_bwd": (
        _grad_of(lambda x, w, b: kernels.layer_norm(x, w, b, impl="pallas"), 3),
        (_spec(1000, 768), _spec(768, dtype=jnp.float32), _spec(768, dtype=jnp.float32)),
        2,
    ),
    "cross_entropy_fwd_bwd": (
        lambda x, t: jax.grad(lambda x: kernels.token_cross_entropy(x, t, impl="pallas").mean())(x),
        (_spec(1000, 50304), _spec(1000, dtype=jnp.int32)),
        2,
    ),
    "matmul_fwd_bwd": (
        _grad_of(lambda x, w, b: kernels.matmul(x, w, b, activation="gelu", impl="pallas"), 3),
        (_spec(512, 768), _spec(768, 1024), _spec(1024, dtype=jnp.float32)),
        3,  # the recomputed pre-activation, dx, dw (the forward's own output is unused: DCE)
    ),
    "relu_fwd_bwd": (
        _grad_of(lambda x: kernels.relu(x, impl="pallas"), 1),
        (_spec(64, 16, 16, 96),),
        2,
    ),
    "mse_fwd_grad": (
        lambda p, t: jax.value_and_grad(
            lambda p: kernels.mean_squared_error(p, t, impl="pallas").mean()
        )(p),
        (_spec(1000, 10), _spec(1000, 10)),
        2,  # the loss (kept: its value is returned) and the gradient
    ),
}


def _export_for_h100(fn, args):
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=H100)
    return export_for_cuda(fn, args, mesh)


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_lowers_for_h100(name, compiled_path):
    fn, args, calls = CASES[name]
    module = _export_for_h100(fn, args).mlir_module()
    assert module.count(TRITON_CALL) == calls, f"{name}: {module.count(TRITON_CALL)} Triton calls"


def test_the_check_sees_the_interpreted_path_as_no_kernel():
    """Without switching the path, the same export holds no Triton call: the count above is
    the kernels' own, not something every export has."""
    fn, args, _ = CASES["rms_norm_fwd_bwd"]
    jax.clear_caches()
    assert _export_for_h100(fn, args).mlir_module().count(TRITON_CALL) == 0


def test_a_tuned_configuration_reaches_the_triton_launch(compiled_path):
    """The block sizes, warps and stages the GPU check's sweep tunes are the launch's: the
    exported kernel carries them (the defaults otherwise)."""
    q = _spec(1, 256, 2, 128)

    def launch(**config):
        fn = lambda q: kernels.flash_attention(q, q, q, impl="pallas", **config)  # noqa: E731
        return _export_for_h100(fn, (q,)).mlir_module()

    tuned = launch(block_q=128, block_k=32, warps=8, stages=3)
    assert "num_warps = 8 : i32" in tuned and "num_stages = 3 : i32" in tuned
    default = launch()
    assert "num_warps = 8 : i32" in default and "num_stages = 2 : i32" in default  # head width 128
