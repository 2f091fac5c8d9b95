"""Shared layout of the row-wise kernels (ReLU, MSE): [N, D] in blocks of whole rows.

The feature dimension is padded to a power of two (Triton block shapes must be), the rows to
whole blocks; a block holds at most `MAX_BLOCK` elements, so wide rows get fewer rows per block.
"""

from __future__ import annotations

from meshtrain.kernels import _common

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


def check_block_rows(kernel: str, block_rows) -> None:
    """A clear error for a block row count Triton cannot use."""
    if block_rows is not None and (block_rows < 1 or block_rows & (block_rows - 1)):
        raise ValueError(f"{kernel}: block_rows={block_rows} must be a power of two")
