"""Sending tokens to their experts and back: capacity (GShard) and dropless dispatch.

Both run per shard inside a region manual over ``expert`` and the batch axes
(`meshtrain.layout.manual_in_layout`); each shard holds its rows of the batch and its
``E / expert`` experts, and exchanges tokens with the other ``expert`` shards by
``all_to_all``. Inside a pipeline stage, whose region is already manual over ``expert`` and
the replica axes, they run there directly. Outside any layout they run whole, with no
exchange.

- **capacity**: each choice goes to slot ``slot`` of its expert's buffer ``[B, E, C, D]``
  (choices past the capacity C are dropped: they add nothing, so the token passes through
  the residual unchanged); the buffers go to the experts' owners in one ``all_to_all`` and
  come back in another.
- **dropless**: the choices are sorted by expert and run through grouped matmuls
  (`meshtrain.kernels.grouped_matmul`: the tiled loop at active cost, or XLA's
  ``ragged_dot``). Across ``expert`` shards they travel, on a GPU, in a *ragged* exchange
  (`jax.lax.ragged_all_to_all`: each destination is sent exactly its rows, after the counts);
  elsewhere, where that op has no implementation, in a *padded* exchange: each destination
  gets a buffer as large as all the shard's choices (the most it could be sent). Nothing is
  dropped either way.

Shape suffixes: B local batch rows, T positions, D model width, F expert hidden width,
E experts, L local experts (E / expert), K choices per token, C slots, N local tokens,
A = N·K local choices, S ``expert`` shards.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.kernels.grouped_matmul import grouped_matmul, tile_rows
from meshtrain.layout import (
    EXPERT,
    Spec,
    active,
    axes_of,
    axis_size,
    manual_axes,
    manual_in_layout,
)
from meshtrain.layout.manual import manual_batch_axes
from meshtrain.precision import fp8 as precision_fp8

DISPATCH = ("capacity", "dropless")


def exchange_impl() -> str:
    """The dropless exchange across expert shards: ragged where the backend has it (GPU)."""
    return "ragged" if jax.default_backend() == "gpu" else "padded"


class Routing(NamedTuple):
    """Where each token goes (`meshtrain.models.moe_routing.route` makes it).

    Attributes:
        expert_BTK: int32 expert of each of a token's k choices, best first.
        weight_BTK: float32 combine weight of each choice.
        slot_BTK: int32 position of the choice in its expert's buffer for its sequence
            (capacity dispatch; counted top-1 choices first, then top-2, in position order).
        keep_BTK: bool, the choice fits its expert's capacity (always True when dropless).
    """

    expert_BTK: jax.Array
    weight_BTK: jax.Array
    slot_BTK: jax.Array
    keep_BTK: jax.Array


def _einsum(a, b, spec: str):
    return jnp.einsum(spec, a, b)


def swiglu_experts(x_LCD, gate_LDF, up_LDF, down_LFD, fp8: bool = False):
    """Each expert's SwiGLU feed-forward on its own buffer of tokens (fp8 products with
    `fp8`)."""
    product = precision_fp8.matmul(_einsum) if fp8 else _einsum
    h_LCF = jax.nn.silu(product(x_LCD, gate_LDF, "lcd,ldf->lcf"))
    h_LCF = h_LCF * product(x_LCD, up_LDF, "lcd,ldf->lcf")
    return product(h_LCF, down_LFD, "lcf,lfd->lcd")


def _grouped_swiglu(x_MD, sizes_L, weights, impl: str, tile: int, fp8: bool = False):
    """The SwiGLU experts on rows grouped by expert (`sizes_L` rows each, in order; rows past
    the groups give zeros), in tiles of `tile` rows (fp8 products with `fp8`)."""
    gate_LDF, up_LDF, down_LFD = weights
    matmul = functools.partial(grouped_matmul, sizes_L=sizes_L, impl=impl, tile=tile)
    if fp8:
        matmul = precision_fp8.matmul(matmul)
    h_MF = jax.nn.silu(matmul(x_MD, gate_LDF)) * matmul(x_MD, up_LDF)
    return matmul(h_MF, down_LFD)


def capacity_local(x_BTD, routing: Routing, weights, *, n_experts, slots, axis, shards, fp8=False):
    """Capacity dispatch on one shard's rows: buffers, exchange, experts, exchange, combine."""
    B, T, D = x_BTD.shape
    expert_BTK, weight_BTK, slot_BTK, keep_BTK = routing
    K = expert_BTK.shape[-1]
    row_BTK = jnp.broadcast_to(jnp.arange(B)[:, None, None], (B, T, K))
    slot_BTK = jnp.where(keep_BTK, slot_BTK, slots)  # out of range: dropped below
    x_BTKD = jnp.broadcast_to(x_BTD[:, :, None, :], (B, T, K, D))
    buf_BECD = jnp.zeros((B, n_experts, slots, D), x_BTD.dtype)
    buf_BECD = buf_BECD.at[row_BTK, expert_BTK, slot_BTK].set(x_BTKD, mode="drop")
    if shards > 1:  # [B, E, C, D] → [S·B, L, C, D]: my experts' buffers from every shard
        buf_BECD = jax.lax.all_to_all(buf_BECD, axis, 1, 0, tiled=True)
    G, L = buf_BECD.shape[:2]
    buf_LGCD = buf_BECD.transpose(1, 0, 2, 3).reshape(L, G * slots, D)
    y_LGCD = swiglu_experts(buf_LGCD, *weights, fp8=fp8).reshape(L, G, slots, D)
    y_BECD = y_LGCD.transpose(1, 0, 2, 3)
    if shards > 1:  # back: [S·B, L, C, D] → [B, E, C, D]
        y_BECD = jax.lax.all_to_all(y_BECD, axis, 0, 1, tiled=True)
    y_BTKD = y_BECD.at[row_BTK, expert_BTK, slot_BTK].get(mode="fill", fill_value=0)
    return jnp.sum(y_BTKD * weight_BTK[..., None].astype(y_BTKD.dtype), axis=2)


def dropless_local(
    x_BTD, routing: Routing, weights, *, n_experts, axis, shards, grouped, fp8=False
):
    """Dropless dispatch on one shard's rows: sort by expert, grouped matmuls (`grouped`:
    the `grouped_matmul` impl), unsort."""
    B, T, D = x_BTD.shape
    expert_BTK, weight_BTK = routing.expert_BTK, routing.weight_BTK
    K = expert_BTK.shape[-1]
    A = B * T * K
    expert_A = expert_BTK.reshape(A)
    order_A = jnp.argsort(expert_A, stable=True)
    rows_AD = x_BTD.reshape(B * T, D)[order_A // K]
    sizes_E = jnp.bincount(expert_A, length=n_experts).astype(jnp.int32)
    # Tiles sized for the choices a shard's experts get when balanced (A rows over E / S
    # experts), not for the exchange's worst-case buffer; the planner assumes the same.
    tile = tile_rows(A, n_experts // shards)
    experts = functools.partial(_grouped_swiglu, weights=weights, impl=grouped, tile=tile, fp8=fp8)
    if shards == 1:
        y_AD = experts(rows_AD, sizes_E)
    else:
        exchange = _ragged_exchange if exchange_impl() == "ragged" else _padded_exchange
        y_AD = exchange(rows_AD, sizes_E, experts, axis=axis, shards=shards)
    y_AD = jnp.zeros_like(y_AD).at[order_A].set(y_AD)  # back to (token, choice) order
    y_BTKD = y_AD.reshape(B, T, K, D)
    return jnp.sum(y_BTKD * weight_BTK[..., None].astype(y_BTKD.dtype), axis=2)


def _padded_exchange(rows_AD, sizes_E, experts, *, axis, shards):
    """Expert-sorted rows to their experts' shards and back, each destination padded to A;
    ``experts(x_MD, sizes_L)`` runs the local experts on rows grouped by local expert."""
    A, D = rows_AD.shape
    L = sizes_E.shape[0] // shards
    sizes_SL = sizes_E.reshape(shards, L)
    count_S = jnp.sum(sizes_SL, axis=1)
    start_S = jnp.cumsum(count_S) - count_S
    r_A = jnp.arange(A)
    valid_SA = r_A[None, :] < count_S[:, None]
    src_SA = jnp.where(valid_SA, start_S[:, None] + r_A[None, :], A)
    send_SAD = rows_AD.at[src_SA].get(mode="fill", fill_value=0)
    recv_SAD = jax.lax.all_to_all(send_SAD, axis, 0, 0, tiled=True)
    got_SL = jax.lax.all_to_all(sizes_SL, axis, 0, 0, tiled=True)  # from each source
    # Each received row's local expert (L for padding), then grouped by expert.
    ends_SL = jnp.cumsum(got_SL, axis=1)
    local_SA = jnp.sum(r_A[None, :, None] >= ends_SL[:, None, :], axis=-1)
    local_M = local_SA.reshape(shards * A)
    order_M = jnp.argsort(local_M, stable=True)
    x_MD = recv_SAD.reshape(shards * A, D)[order_M]
    y_MD = experts(x_MD, jnp.sum(got_SL, axis=0))  # padding rows sort last: zeros
    y_SAD = jnp.zeros_like(y_MD).at[order_M].set(y_MD).reshape(shards, A, D)
    back_SAD = jax.lax.all_to_all(y_SAD, axis, 0, 0, tiled=True)
    return jnp.zeros((A, D), back_SAD.dtype).at[src_SA].set(back_SAD, mode="drop")


def _ragged_exchange(rows_AD, sizes_E, experts, *, axis, shards):
    """Expert-sorted rows to their experts' shards and back with `ragged_all_to_all`: each
    destination receives exactly its rows, after the counts are gathered; the receive
    buffer holds the most a shard could be sent (S·A rows), but only the rows travel."""
    A, D = rows_AD.shape
    L = sizes_E.shape[0] // shards
    sizes_SL = sizes_E.reshape(shards, L)
    count_S = jnp.sum(sizes_SL, axis=1)  # rows for each destination, contiguous from start_S
    sent_SS = jax.lax.all_gather(count_S, axis)  # [source, destination]
    me = jax.lax.axis_index(axis)
    start_SS = jnp.cumsum(sent_SS, axis=1) - sent_SS  # where a source's rows for s begin
    land_SS = jnp.cumsum(sent_SS, axis=0) - sent_SS  # where they land at s: after lower sources
    recv_S = sent_SS[:, me]
    recv_MD = _ragged_all_to_all(
        rows_AD, jnp.zeros((shards * A, D), rows_AD.dtype), start_SS[me], count_S,
        land_SS[me], recv_S, axis=axis,
    )  # fmt: skip
    # Each received row's local expert (L past the last source's rows), then grouped.
    got_SL = jax.lax.all_to_all(sizes_SL, axis, 0, 0, tiled=True)  # from each source
    r_M = jnp.arange(shards * A)
    src_M = jnp.sum(jnp.cumsum(recv_S)[None, :] <= r_M[:, None], axis=1)  # source of row
    at_M = r_M - land_SS[jnp.minimum(src_M, shards - 1), me]
    ends_SL = jnp.cumsum(got_SL, axis=1)
    local_M = jnp.sum(at_M[:, None] >= ends_SL[jnp.minimum(src_M, shards - 1)], axis=-1)
    local_M = jnp.where(src_M < shards, local_M, L)
    order_M = jnp.argsort(local_M, stable=True)
    y_MD = experts(recv_MD[order_M], jnp.sum(got_SL, axis=0))
    y_MD = jnp.zeros_like(y_MD).at[order_M].set(y_MD)
    return _ragged_all_to_all(
        y_MD, jnp.zeros((A, D), y_MD.dtype), land_SS[:, me], recv_S, start_SS[:, me], count_S,
        axis=axis,
    )  # fmt: skip


def _ragged_all_to_all(x, out, in_offsets, send_sizes, out_offsets, recv_sizes, *, axis):
    """`jax.lax.ragged_all_to_all` over `axis` (a seam: tests put a reference in its place
    on backends without the op)."""
    return jax.lax.ragged_all_to_all(
        x, out, in_offsets, send_sizes, out_offsets, recv_sizes, axis_name=axis
    )


def shard_sizes(expert_BTK, n_experts: int, shards: int, row_blocks: int) -> list[np.ndarray]:
    """The group sizes each shard's grouped matmul sees for a routing (an analysis aid for
    tests and benchmarks): the batch rows split into `row_blocks` equal blocks, one per shard
    of the dispatch region (the expert shards innermost, as the region lays them out), expert
    shard s owning experts ``[s·L, (s+1)·L)`` and receiving the choices of its exchange
    group's rows.

    Args:
        expert_BTK: the routing's experts, [B, T, K] (B divisible by `row_blocks`).
        n_experts: E.
        shards: the ``expert`` axis size.
        row_blocks: the region's shards (all batch axes and ``expert`` together).

    Returns:
        One [E / shards] int array per row block, in order.
    """
    blocks = np.asarray(expert_BTK).reshape(row_blocks, -1)
    L, out = n_experts // shards, []
    for first in range(0, row_blocks, shards):
        group = blocks[first : first + shards].reshape(-1)
        for s in range(shards):
            mine = group[(group >= s * L) & (group < (s + 1) * L)] - s * L
            out.append(np.bincount(mine, minlength=L))
    return out


def dispatch(
    x_BTD,
    routing: Routing,
    weights,
    *,
    kind: str,
    n_experts: int,
    slots: int,
    grouped: str = "auto",
    fp8: bool = False,
):
    """Runs the experts on `x_BTD` by `routing`: per shard over the active layout's
    ``expert`` and batch axes, or whole outside any layout.

    Args:
        x_BTD: tokens, in the compute dtype (global array).
        routing: from `meshtrain.models.moe_routing.route`.
        weights: ``(gate [E, D, F], up [E, D, F], down [E, F, D])`` in the compute dtype.
        kind: ``"capacity"`` or ``"dropless"``.
        n_experts: E.
        slots: capacity slots per expert and sequence (capacity only).
        grouped: the grouped-matmul impl of dropless dispatch (`grouped_matmul`'s ``impl``).
        fp8: the experts' products as fp8 matmuls (`meshtrain.precision.fp8.matmul`).

    Returns:
        [B, T, D]: the weighted sum of each token's kept experts' outputs (0 if all dropped).
    """
    if kind == "capacity":
        local = functools.partial(capacity_local, n_experts=n_experts, slots=slots, fp8=fp8)
    else:
        local = functools.partial(dropless_local, n_experts=n_experts, grouped=grouped, fp8=fp8)
    layout = active()
    if layout is None:
        return local(x_BTD, routing, weights, axis=None, shards=1)
    shards = axis_size(EXPERT)
    manual = manual_axes()
    if manual and (shards == 1 or EXPERT in manual):
        # Inside a region already manual over expert (or with no expert axis): a pipeline
        # stage, the replicas' own step. These are this shard's rows and, over expert, its
        # experts; exchange with the other expert shards directly (a region nested here could
        # not be differentiated); the other axes stay automatic.
        return local(x_BTD, routing, weights, axis=EXPERT if shards > 1 else None, shards=shards)
    inside = manual & {EXPERT, *manual_batch_axes()}
    if inside:
        raise ValueError(
            f"the expert dispatch inside a region manual over {', '.join(sorted(inside))} "
            "needs that region manual over expert too"
        )
    batch = axes_of(layout.activation_spec(("batch", None, None), x_BTD.shape)[0])
    rows = tuple(a for a in batch if a != EXPERT) + ((EXPERT,) if shards > 1 else ())
    if not rows:
        return local(x_BTD, routing, weights, axis=None, shards=1)
    row_spec = Spec(rows)
    weight_spec = Spec(EXPERT) if shards > 1 else Spec()
    region = manual_in_layout(
        functools.partial(local, axis=EXPERT, shards=shards),
        axes=rows,
        in_specs=(row_spec, Routing(*(row_spec,) * 4), (weight_spec,) * 3),
        out_specs=row_spec,
    )
    return region(x_BTD, routing, tuple(weights))
