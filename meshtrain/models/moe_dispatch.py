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
  (`jax.lax.ragged_dot`). Across ``expert`` shards they travel in a *padded* exchange: each
  destination gets a buffer as large as all the shard's choices (the most it could be
  sent), since the ragged all-to-all has no CPU implementation; nothing is dropped.

Shape suffixes: B local batch rows, T positions, D model width, F expert hidden width,
E experts, L local experts (E / expert), K choices per token, C slots, N local tokens,
A = N·K local choices, S ``expert`` shards.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshtrain.layout import (
    EXPERT,
    Spec,
    active,
    axes_of,
    axis_size,
    manual_axes,
    manual_in_layout,
)

DISPATCH = ("capacity", "dropless")


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


def swiglu_experts(x_LCD, gate_LDF, up_LDF, down_LFD):
    """Each expert's SwiGLU feed-forward on its own buffer of tokens."""
    h_LCF = jax.nn.silu(jnp.einsum("lcd,ldf->lcf", x_LCD, gate_LDF))
    h_LCF = h_LCF * jnp.einsum("lcd,ldf->lcf", x_LCD, up_LDF)
    return jnp.einsum("lcf,lfd->lcd", h_LCF, down_LFD)


def _ragged_swiglu(x_MD, sizes_L, gate_LDF, up_LDF, down_LFD):
    """The SwiGLU experts on rows grouped by expert (`sizes_L` rows each, in order)."""
    h_MF = jax.nn.silu(jax.lax.ragged_dot(x_MD, gate_LDF, sizes_L))
    h_MF = h_MF * jax.lax.ragged_dot(x_MD, up_LDF, sizes_L)
    return jax.lax.ragged_dot(h_MF, down_LFD, sizes_L)


def capacity_local(x_BTD, routing: Routing, weights, *, n_experts, slots, axis, shards):
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
    y_LGCD = swiglu_experts(buf_LGCD, *weights).reshape(L, G, slots, D)
    y_BECD = y_LGCD.transpose(1, 0, 2, 3)
    if shards > 1:  # back: [S·B, L, C, D] → [B, E, C, D]
        y_BECD = jax.lax.all_to_all(y_BECD, axis, 0, 1, tiled=True)
    y_BTKD = y_BECD.at[row_BTK, expert_BTK, slot_BTK].get(mode="fill", fill_value=0)
    return jnp.sum(y_BTKD * weight_BTK[..., None].astype(y_BTKD.dtype), axis=2)


def dropless_local(x_BTD, routing: Routing, weights, *, n_experts, axis, shards):
    """Dropless dispatch on one shard's rows: sort by expert, grouped matmuls, unsort."""
    B, T, D = x_BTD.shape
    expert_BTK, weight_BTK = routing.expert_BTK, routing.weight_BTK
    K = expert_BTK.shape[-1]
    A = B * T * K
    expert_A = expert_BTK.reshape(A)
    order_A = jnp.argsort(expert_A, stable=True)
    rows_AD = x_BTD.reshape(B * T, D)[order_A // K]
    sizes_E = jnp.bincount(expert_A, length=n_experts).astype(jnp.int32)
    if shards == 1:
        y_AD = _ragged_swiglu(rows_AD, sizes_E, *weights)
    else:
        y_AD = _padded_exchange(rows_AD, sizes_E, weights, axis=axis, shards=shards)
    y_AD = jnp.zeros_like(y_AD).at[order_A].set(y_AD)  # back to (token, choice) order
    y_BTKD = y_AD.reshape(B, T, K, D)
    return jnp.sum(y_BTKD * weight_BTK[..., None].astype(y_BTKD.dtype), axis=2)


def _padded_exchange(rows_AD, sizes_E, weights, *, axis, shards):
    """Expert-sorted rows to their experts' shards and back, each destination padded to A."""
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
    y_MD = _ragged_swiglu(x_MD, jnp.sum(got_SL, axis=0), *weights)
    y_MD = jnp.where((local_M[order_M] < L)[:, None], y_MD, 0)
    y_SAD = jnp.zeros_like(y_MD).at[order_M].set(y_MD).reshape(shards, A, D)
    back_SAD = jax.lax.all_to_all(y_SAD, axis, 0, 0, tiled=True)
    return jnp.zeros((A, D), back_SAD.dtype).at[src_SA].set(back_SAD, mode="drop")


def dispatch(x_BTD, routing: Routing, weights, *, kind: str, n_experts: int, slots: int):
    """Runs the experts on `x_BTD` by `routing`: per shard over the active layout's
    ``expert`` and batch axes, or whole outside any layout.

    Args:
        x_BTD: tokens, in the compute dtype (global array).
        routing: from `meshtrain.models.moe_routing.route`.
        weights: ``(gate [E, D, F], up [E, D, F], down [E, F, D])`` in the compute dtype.
        kind: ``"capacity"`` or ``"dropless"``.
        n_experts: E.
        slots: capacity slots per expert and sequence (capacity only).

    Returns:
        [B, T, D]: the weighted sum of each token's kept experts' outputs (0 if all dropped).
    """
    if kind == "capacity":
        local = functools.partial(capacity_local, n_experts=n_experts, slots=slots)
    else:
        local = functools.partial(dropless_local, n_experts=n_experts)
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
    inside = manual & {EXPERT, *layout.rules.batch_axes({a: axis_size(a) for a in manual})}
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
