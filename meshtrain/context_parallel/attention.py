"""Context-parallel attention on global arrays: picks an algorithm and runs it in a region
manual over the sequence axis (every other mesh axis stays with the compiler)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshtrain._switch import Switch
from meshtrain.context_parallel import blocks, gather, ring, zigzag
from meshtrain.context_parallel.nested import nested_attention
from meshtrain.kernels.select import model_attention_impl
from meshtrain.layout import active, manual_axes, manual_region
from meshtrain.mesh import SEQ
from meshtrain.problem import Problem, raise_if

ALGORITHMS = ("ring", "allgather", "ulysses")
DEFAULT = "ring"
AXIS = SEQ
IMPLS = ("xla", "pallas", "auto")  # how each device computes its blocks (see `block_impl`)
_FNS: dict[str, Callable[..., jax.Array]] = {
    "ring": ring.ring,
    "allgather": gather.allgather,
    "ulysses": gather.ulysses,
}


def algorithm_problems(algorithm) -> list[Problem]:
    """Why `algorithm` is not a context-parallel algorithm (empty when it is one).

    Args:
        algorithm: the value of `Rules.context_parallel` (``--context-parallel``).

    Returns:
        One problem naming ``context_parallel`` and the choices, or none.
    """
    if isinstance(algorithm, str) and algorithm in ALGORITHMS:
        return []
    return [
        Problem(
            "context_parallel",
            algorithm,
            f"unknown algorithm; choose from {', '.join(ALGORITHMS)} "
            "(e.g. --context-parallel ring)",
        )
    ]


def block_impl(impl: str, head_dim: int, dtype=None, seq: int = 0, algorithm: str = DEFAULT) -> str:
    """The block impl `impl` names for heads of width `head_dim` over a sequence of `seq`:
    ``"auto"`` is the faster of the Pallas kernel and the jnp math measured on this GPU
    (`meshtrain.kernels.select.attention_choice`; the jnp math off a GPU, or where nothing was
    measured; with Ulysses cuDNN's too); raises a ValueError for an impl `algorithm` cannot run
    (``"cudnn"`` beside ring or all-gather: no mask by global positions, no gradient of its
    log-sum-exp in jax)."""
    if impl == "cudnn" and algorithm != "ulysses":
        raise ValueError(
            "context parallelism: impl='cudnn' cannot compute a block (cuDNN's attention takes "
            "no mask by global positions, and jax's cuDNN backward drops the gradient of the "
            "log-sum-exp that merging blocks needs); use impl='pallas', 'auto' or 'xla', or "
            "--context-parallel ulysses"
        )
    if impl not in (*IMPLS, "cudnn"):
        raise ValueError(f"context parallelism: impl={impl!r}; choose from {', '.join(IMPLS)}")
    return model_attention_impl(impl, head_dim, dtype, seq=seq, context=algorithm)


def context_attention(
    q_BTHK: jax.Array,
    k_BSGK: jax.Array,
    v_BSGK: jax.Array,
    positions_T: jax.Array,
    *,
    mesh: Mesh,
    algorithm: str = DEFAULT,
    causal: bool = True,
    window: int | None = None,
    impl: str = "xla",
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Self-attention over a sequence split over the mesh axis ``seq``.

    Args:
        q_BTHK: queries [batch, T, heads, head_dim], global (T split over ``seq``).
        k_BSGK, v_BSGK: keys and values [batch, T, kv_heads, head_dim].
        positions_T: the global position of each of the T entries (int): the causal mask and
            window follow these, so a balanced (zig-zag) layout stays exact.
        mesh: the device mesh.
        algorithm: ``ring``, ``allgather`` or ``ulysses`` (see the Context parallelism guide).
        causal: mask keys at later positions.
        window: with `causal`, each query sees keys (t − window, t]; None: all earlier.
        impl: how each device computes its blocks: ``"xla"`` (jnp), ``"pallas"`` (the
            flash-attention kernel at global positions, interpreted off the GPU; head widths
            64 and 128, float32 or bfloat16) or ``"auto"`` (the faster of the two measured on
            this GPU, else xla). ``"cudnn"`` is refused: it cannot compute a block at given
            positions.
        segment_ids: [batch, T] integers in the layout of the tokens (packed documents): a
            query sees only keys of its own segment (padding, id 0, is one more segment, as
            in `meshtrain.models.layers.causal_attention`). None: one sequence per row.

    Returns:
        [batch, T, heads, head_dim] in the dtype of `v_BSGK`, laid out like `q_BTHK`.
    """
    raise_if(algorithm_problems(algorithm))
    T, H, K = q_BTHK.shape[1:]
    opts = blocks.Options(causal, window, block_impl(impl, K, q_BTHK.dtype, T, algorithm))
    axis = AXIS
    n = mesh.shape[axis]
    if T % n:
        raise ValueError(f"context parallelism: sequence length {T} is not divisible by {axis}={n}")
    if algorithm == "ulysses" and H % n:
        raise ValueError(
            f"context_parallel='ulysses': {H} heads are not divisible by {axis}={n}; pick a "
            "head count divisible by seq, or --context-parallel ring"
        )
    if segment_ids is not None and tuple(segment_ids.shape) != q_BTHK.shape[:2]:
        raise ValueError(
            f"context parallelism: segment_ids {tuple(segment_ids.shape)} must be [batch, seq] "
            f"= {q_BTHK.shape[:2]}"
        )
    if opts.impl == "cudnn":  # Ulysses only (`block_impl`)
        fn = gather.ulysses_cudnn
    elif algorithm == "ring":
        fn = ring.for_positions(positions_T, n, opts)
    else:
        fn = _FNS[algorithm]

    def per_device(q, k, v, pos, *seg):
        segs = {"q_segments": seg[0], "k_segments": seg[0]} if seg else {}
        return fn(q, k, v, pos, pos, axis, opts, **segs)

    seq, pos = P(None, axis), P(axis)
    args: tuple[jax.Array, ...] = (q_BTHK, k_BSGK, v_BSGK, jnp.asarray(positions_T, jnp.int32))
    if segment_ids is not None:
        args += (jnp.asarray(segment_ids, jnp.int32),)
    specs = (seq, seq, seq, pos, seq)[: len(args)]
    if not manual_axes():
        region = manual_region(per_device, mesh=mesh, axes={axis}, in_specs=specs, out_specs=seq)
        return region(*args)
    return nested_attention(per_device, args)  # in a pipeline stage or the replicas' step


class Context(NamedTuple):
    """Context parallelism as the active layout asks for it.

    Args:
        mesh: the device mesh.
        algorithm: ``ring``, ``allgather`` or ``ulysses``.
        n: the slices of the tokens' balanced (zig-zag) order: the size of ``seq``, or 1 where
            the tokens keep their plain order (`whole_model_in_region`).
    """

    mesh: Mesh
    algorithm: str
    n: int


_WHOLE = Switch()


def whole_model_in_region() -> contextlib.AbstractContextManager[None]:
    """Inside it the whole model, its embedding and head too, is traced in the enclosing manual
    region (the replicas' own step). Where another automatic axis than ``seq`` splits the
    activations there too (``fsdp`` under hsdp, ``tensor``), the tokens keep their plain
    order: XLA's SPMD partitioner aborts on the zig-zag reordering's gather along ``seq`` in
    such a region (a failed check in spmd_partitioner_util), so causal attention's work is
    unbalanced over ``seq`` there, and exact all the same."""
    return _WHOLE.on()


def _plain_order(mesh: Mesh) -> bool:
    """Whether the tokens keep their plain order here (`whole_model_in_region`)."""
    if not _WHOLE.is_on:
        return False
    manual = manual_axes()
    return any(a != AXIS and a not in manual and s > 1 for a, s in mesh.shape.items())


def active_context() -> Context | None:
    """The context parallelism of the layout being traced: None outside `activation_rules`,
    with ``seq = 1``, or inside a region already manual over ``seq``."""
    layout = active()
    if layout is None or AXIS in manual_axes():
        return None
    n = layout.mesh.shape.get(AXIS, 1)
    if n == 1:
        return None
    algorithm = getattr(layout.rules, "context_parallel", DEFAULT)
    return Context(layout.mesh, algorithm, 1 if _plain_order(layout.mesh) else n)


def attend_active(
    q_BTHK, k_BSGK, v_BSGK, positions_T, *, causal=True, window=None, impl="xla",
    segment_ids=None,
):  # fmt: skip
    """`context_attention` with the active layout's mesh and algorithm (see `active_context`;
    call it only where that is not None): the form a model uses, naming no mesh. `impl` and
    `segment_ids` as `context_attention`'s (a model passes its own attention impl)."""
    ctx = active_context()
    if ctx is None:
        raise ValueError(
            "attend_active: no context parallelism is active (seq = 1, no activation_rules, "
            "or already manual over seq); call it only where active_context() is not None"
        )
    return context_attention(
        q_BTHK, k_BSGK, v_BSGK, positions_T, mesh=ctx.mesh, algorithm=ctx.algorithm,
        causal=causal, window=window, impl=impl, segment_ids=segment_ids,
    )  # fmt: skip


def balanced_order(seq_len: int) -> np.ndarray | None:
    """The zig-zag order tokens take under the active context parallelism, or None (also
    where they keep their plain order, `whole_model_in_region`)."""
    ctx = active_context()
    return None if ctx is None or ctx.n == 1 else zigzag.order(seq_len, ctx.n)
