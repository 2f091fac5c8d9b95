"""The flash kernel at global positions lowers for an H100 target on a CPU-only machine, inside
a region manual over ``seq`` (context parallelism), forward and backward.

As tests/test_kernels_lowering.py: the kernels' non-interpreted path is switched on and the
program is exported for ``cuda`` on an abstract mesh of abstract H100s, which runs Pallas'
Triton lowering (the position refs, the position-range block skipping) without a GPU. It does
not compile Triton to PTX: the `gpu`-marked test in tests/test_context_parallel_flash.py does.
"""

import jax
import jax.numpy as jnp
import pytest
from _kernel_helpers import TRITON_CALL, export_for_cuda, h100
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from meshtrain import context_parallel as cp
from meshtrain.kernels import attention as flash
from meshtrain.layout import manual_region

H100 = h100()
MESH = AbstractMesh((2, 2), ("data", "seq"), (AxisType.Auto,) * 2, abstract_device=H100)
B, T, H, G, K = 2, 512, 4, 2, 64


def _spec(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


ARGS = (_spec(B, T, H, K), _spec(B, T, G, K), _spec(B, T, G, K), _spec(B, T, H, K))


def _grads_of_context_attention(algorithm, causal, window):
    """fwd+bwd of `context_attention` with the kernel, zig-zag positions, seq = 2."""
    pos = jnp.asarray(cp.order(T, 2))

    def fn(q, k, v, w):
        def loss(q, k, v):
            o = cp.context_attention(
                q, k, v, pos, mesh=MESH, algorithm=algorithm, causal=causal, window=window,
                impl="pallas",
            )  # fmt: skip
            return (o.astype(jnp.float32) * w.astype(jnp.float32)).sum()

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    return fn


# (algorithm, causal, window) -> Triton calls: the ring runs the forward on its own block and
# in its scan's body (2), the backward's dq and dk/dv kernels likewise (4): with the kernel the
# ring takes whole blocks, and the kernel skips the tiles the zig-zag mask leaves empty. The
# gathering algorithms run one forward and one backward (3).
CASES = {
    ("ring", True, None): 6,
    ("ring", True, 100): 6,
    ("ring", False, None): 6,
    ("allgather", True, None): 3,
    ("ulysses", True, None): 3,
}


@pytest.mark.parametrize("algorithm, causal, window", sorted(CASES, key=str))
def test_context_attention_with_the_kernel_lowers_for_h100(
    algorithm, causal, window, compiled_path
):
    grads = _grads_of_context_attention(algorithm, causal, window)
    module = export_for_cuda(grads, ARGS, MESH).mlir_module()
    assert module.count(TRITON_CALL) == CASES[algorithm, causal, window]


def test_block_forward_and_backward_with_segments_lower_in_a_seq_region(compiled_path):
    """The two per-device functions themselves, with positions and segment ids (the packed
    path's interface), in a region manual over seq."""

    def per_device(q, k, v, do, q_pos, k_pos, seg):
        o, lse = flash.block_forward(
            q, k, v, q_pos, k_pos, causal=True, window=None, q_segments=seg, k_segments=seg
        )
        delta = jnp.einsum("bthk,bthk->bht", o, do.astype(jnp.float32)).reshape(lse.shape)
        return (o, *flash.block_backward(
            q, k, v, q_pos, k_pos, do, lse, delta, causal=True, window=None,
            q_segments=seg, k_segments=seg,
        ))  # fmt: skip

    seq, row = P(None, "seq"), P("seq")
    region = manual_region(
        per_device, mesh=MESH, axes={"seq"}, in_specs=(seq, seq, seq, seq, row, row, seq),
        out_specs=(seq,) * 4,
    )  # fmt: skip
    args = (
        *ARGS,
        _spec(T, dtype=jnp.int32),
        _spec(T, dtype=jnp.int32),
        _spec(B, T, dtype=jnp.int32),
    )
    module = export_for_cuda(region, args, MESH).mlir_module()
    assert module.count(TRITON_CALL) == 3  # forward, dq, dk/dv


def test_without_the_switch_the_same_export_holds_no_kernel():
    """The interpreted path (the CPU's) lowers to no Triton call: the counts above are the
    kernels' own."""
    jax.clear_caches()
    grads = _grads_of_context_attention("ring", True, None)
    module = export_for_cuda(grads, ARGS, MESH).mlir_module()
    assert module.count(TRITON_CALL) == 0
