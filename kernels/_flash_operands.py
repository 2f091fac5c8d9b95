"""Around the flash kernels: operands padded to whole blocks, their BlockSpecs, and the launch.

Sequences are zero-padded up to the block and the padding is masked by index. The optional mask
inputs (segment ids, positions) travel as `MaskInputs`: a call passes only those present, and
the kernel receives None for the others.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from meshtrain.kernels import _common
from meshtrain.kernels._flash_tiles import MaskInputs, Tiling


def specs(t: Tiling, H: int, G: int, K: int) -> dict[str, pl.BlockSpec]:
    """BlockSpecs shared by the kernels: query tiles, whole key/value rows of one head, etc."""
    R = H // G
    Tp, Sp, bq, bk = t.padded_q, t.padded_k, t.bq, t.bk
    return dict(
        q_tile=pl.BlockSpec((None, bq, None, K), lambda b, h, i: (b, i, h, 0)),
        q_all=pl.BlockSpec((None, Tp, None, K), lambda b, h, j: (b, 0, h, 0)),
        kv_all=pl.BlockSpec((None, Sp, None, K), lambda b, h, i: (b, 0, h // R, 0)),
        kv_tile=pl.BlockSpec((None, bk, None, K), lambda b, h, j: (b, j, h // R, 0)),
        kvh_tile=pl.BlockSpec((None, bk, None, K), lambda b, h, j: (b, j, h, 0)),
        row_tile=pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
        row_all=pl.BlockSpec((None, None, Tp), lambda b, h, j: (b, h, 0)),
        seg_q_tile=pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),
        seg_q_all=pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0)),
        seg_k_all=pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0)),
        seg_k_tile=pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
        pos_q_tile=pl.BlockSpec((bq,), lambda b, h, i: (i,)),
        pos_q_all=pl.BlockSpec((Tp,), lambda b, h, j: (0,)),
        pos_k_all=pl.BlockSpec((Sp,), lambda b, h, i: (0,)),
        pos_k_tile=pl.BlockSpec((bk,), lambda b, h, j: (j,)),
    )


def pad_positions(pos, size):
    """Positions padded to `size` with copies of the last one (the padding is masked by
    index; repeating the edge keeps each block's position range that of its real entries)."""
    pos = pos.astype(jnp.int32)
    return jnp.pad(pos, (0, size - pos.shape[0]), mode="edge")


def pad_operands(t: Tiling, q, k, v, segments=None, positions=None):
    """q, k, v zero-padded to whole blocks, and the padded `MaskInputs`.

    Args:
        t: the tiling (block sizes, true lengths).
        q, k, v: [B, T, H, K] and [B, S, G, K].
        segments: None, or the query and key segment ids [B, T] and [B, S] (padded with 0).
        positions: None, or the query and key positions [T] and [S] (padded with the last).

    Returns:
        ``(q, k, v, MaskInputs)``, the inputs as the kernels take them.
    """
    Tp, Sp = t.padded_q, t.padded_k
    padded = (_common.pad_to(q, 1, Tp), _common.pad_to(k, 1, Sp), _common.pad_to(v, 1, Sp))
    seg_q = seg_k = pos_q = pos_k = None
    if segments is not None:
        seg_q = _common.pad_to(segments[0].astype(jnp.int32), 1, Tp)
        seg_k = _common.pad_to(segments[1].astype(jnp.int32), 1, Sp)
    if positions is not None:
        pos_q, pos_k = pad_positions(positions[0], Tp), pad_positions(positions[1], Sp)
    return (*padded, MaskInputs(seg_q, seg_k, pos_q, pos_k))


def with_mask_inputs(kernel, n_in: int, present: tuple[bool, ...]):
    """`kernel`, which takes its first `n_in` input refs, then one `MaskInputs` of refs, then
    its output refs; the call passes the first inputs, then only the pairs of optional refs
    that are `present` (segment ids, positions), then the outputs."""

    def run(*refs, **static):
        out, at = [], n_in
        for here in present:
            out += refs[at : at + 2] if here else [None, None]
            at += 2 if here else 0
        return kernel(*refs[:n_in], MaskInputs(*out), *refs[at:], **static)

    return run


def launch(
    kernel, t: Tiling, inputs, in_names, extra: MaskInputs, *, outs, out_shape, over_queries,
    interpret, name,
):  # fmt: skip
    """Runs `kernel` on a grid (batch, heads, blocks) with `inputs` and the mask inputs present.

    Args:
        kernel: ``kernel(*input_refs, MaskInputs, *output_refs, t=)``.
        t: the tiling, passed to the kernel as ``t``.
        inputs: the padded arrays; the first is the queries [B, Tp, H, K], the second the
            keys [B, Sp, G, K].
        in_names: the `specs` name of each input's BlockSpec.
        extra: the padded `MaskInputs`.
        outs: the `specs` name of the output's BlockSpec, or a list of them.
        out_shape: the outputs' shapes, as `pl.pallas_call` takes them.
        over_queries: the grid's last axis runs over query blocks (else over key blocks).
        interpret: run the kernel interpreted.
        name: the kernel's name in profiles.

    Returns:
        What `_common.pallas_call` returns.
    """
    (B, _, H, K), G = inputs[0].shape, inputs[1].shape[2]
    sp = specs(t, H, G, K)
    q_side, k_side = ("tile", "all") if over_queries else ("all", "tile")
    args, arg_specs, present = [], [], []
    for kind, on_q, on_k in (("seg", extra.seg_q, extra.seg_k), ("pos", extra.pos_q, extra.pos_k)):
        present.append(on_q is not None)
        if on_q is not None:
            args += [on_q, on_k]
            arg_specs += [sp[f"{kind}_q_{q_side}"], sp[f"{kind}_k_{k_side}"]]
    blocks = t.padded_q // t.bq if over_queries else t.padded_k // t.bk
    return _common.pallas_call(
        functools.partial(with_mask_inputs(kernel, len(inputs), tuple(present)), t=t),
        grid=(B, H, blocks),
        in_specs=[sp[n] for n in in_names] + arg_specs,
        out_specs=[sp[n] for n in outs] if isinstance(outs, list) else sp[outs],
        out_shape=out_shape,
        compiler_params=_common.triton_params(t.warps or (4 if K <= 64 else 8), t.stages),
        interpret=interpret,
        name=name,
    )(*inputs, *args)
