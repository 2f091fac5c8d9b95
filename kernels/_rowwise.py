"""Shared layout of the row-wise kernels (ReLU, MSE): [N, D] in blocks of whole rows.

The feature dimension is padded to a power of two (Triton block shapes must be), the rows to
whole blocks; a block holds at most `MAX_BLOCK` elements, so wide rows get fewer rows per block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from meshtrain.kernels import _args, _common

MAX_BLOCK = 1 << 15  # elements per block (fp32: 128 kB)
MAX_FEATURES = MAX_BLOCK  # one row must fit a block


def layout(n_rows: int, width: int, block_rows: int | None) -> tuple[int, int, int]:
    """(rows per block, padded rows, padded width) for an [n_rows, width] array."""
    width_p = _common.next_pow2(width)
    cap = max(1, MAX_BLOCK // width_p)
    br = block_rows or min(cap, 256, _common.next_pow2(n_rows))
    return br, _common.cdiv(n_rows, br) * br, width_p


def pad2(x_ND, rows: int, width: int):
    """`x_ND` zero-padded to [rows, width]."""
    return _common.pad_to(_common.pad_to(x_ND, 0, rows), 1, width)


DTYPES = (jnp.float32, jnp.bfloat16)


def check_block_rows(kernel: str, block_rows) -> None:
    """A clear error for a block row count Triton cannot use."""
    _args.power_of_two(kernel, "block_rows", block_rows, example=64)


def check_inputs(kernel: str, arrays: Mapping[str, jax.Array], block_rows) -> None:
    """Clear errors for what the Pallas row-wise kernels cannot take: a dtype other than
    float32 or bfloat16, rows wider than one block, a block row count not a power of two."""
    for name, x in arrays.items():
        if x.dtype not in DTYPES:
            raise ValueError(
                f"{kernel} impl='pallas': {name} dtype {x.dtype} is not supported; supported "
                "dtypes are float32, bfloat16"
            )
    name, x = next(iter(arrays.items()))
    if x.shape[-1] > MAX_FEATURES:
        raise ValueError(
            f"{kernel} impl='pallas': rows of {x.shape[-1]} values exceed the {MAX_FEATURES} "
            f"one block holds; reshape {name}"
        )
    check_block_rows(kernel, block_rows)


def run(
    kernel: Callable,
    name: str,
    blocks: Sequence[jax.Array],
    *,
    vectors: Sequence[jax.Array] = (),
    per_row: bool = False,
    dtype,
    block_rows: int | None,
    interpret: bool,
) -> jax.Array:
    """Runs `kernel` over blocks of whole rows: of the [N, D] `blocks`, then of the [N]
    `vectors`; returns [N, D] in `dtype`, or [N] with `per_row`."""
    N, D = blocks[0].shape
    br, Np, Dp = layout(N, D, block_rows)
    block = pl.BlockSpec((br, Dp), lambda i: (i, 0))
    row = pl.BlockSpec((br,), lambda i: (i,))
    out = _common.pallas_call(
        kernel,
        grid=(Np // br,),
        in_specs=[block] * len(blocks) + [row] * len(vectors),
        out_specs=row if per_row else block,
        out_shape=jax.ShapeDtypeStruct((Np,) if per_row else (Np, Dp), dtype),
        compiler_params=_common.triton_params(4, 1),
        interpret=interpret,
        name=name,
    )(*[pad2(a, Np, Dp) for a in blocks], *[_common.pad_to(v, 0, Np) for v in vectors])
    return out[:N] if per_row else out[:N, :D]
