"""Mixture-of-experts routing math: top-k choice, capacity slots, router losses and load stats.

The load-balancing loss has two forms (`ROUTER_LOSSES`): ``"meshtrain"``, Switch's loss per MoE
block over every token (`load_balance_loss`, summed over the blocks by the model), and
``"mixtral"``, transformers' Mixtral loss over every block's real tokens pooled into one
(`router_sums` per block, `pooled_load_balance_loss` of their sums over the blocks).

Everything here is plain jnp on global arrays, so it means the same under every layout. Inside
a region manual over batch axes (a pipeline stage, whose rows are split over the replica and
``expert`` axes, or the replicas' own step of gradient compression) the losses and statistics
are reduced over those axes, so they still describe every row the region sees as one batch;
between local SGD's synchronisations (`meshtrain.layout.rows_apart`) each replica keeps its own.
Shape suffixes: B batch rows, T positions, E experts, K choices per token (top-k), C capacity
slots per expert and sequence.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain.layout import rows_are_apart
from meshtrain.layout.manual import manual_batch_axes
from meshtrain.models.moe_dispatch import Routing

ROUTER_LOSSES = ("meshtrain", "mixtral")


def _row_axes() -> tuple[str, ...]:
    """The manual batch axes the rows here are split over (none outside a manual region)."""
    if rows_are_apart():  # local SGD: each replica its own
        return ()
    return manual_batch_axes()


def _mean_over_rows(x: jax.Array) -> jax.Array:
    """`x`, a mean over this shard's rows, as the mean over the rows of every shard."""
    return _over_rows(lax.pmean, x)


def _over_rows(reduce, x: jax.Array) -> jax.Array:
    """``reduce(x, axes)`` over the manual batch axes; `x` unchanged outside such a region."""
    axes = _row_axes()
    return reduce(x, axes) if axes else x


def capacity(seq_len: int, n_experts: int, top_k: int, factor: float) -> int:
    """Slots per expert and sequence: ⌈factor · T · k / E⌉ (GShard's per-group capacity, with one
    sequence as the group, so what drops does not depend on the layout)."""
    return max(1, math.ceil(factor * seq_len * top_k / n_experts))


def route(
    logits_BTE: jax.Array, top_k: int, *, renormalize: bool, capacity_slots: int | None
) -> Routing:
    """Softmax over the experts, then the top `top_k` (renormalised to sum to one when
    `renormalize`, as Mixtral does); slots in each expert's buffer per sequence.

    Args:
        logits_BTE: router logits, float32.
        top_k: choices per token.
        renormalize: divide the chosen probabilities by their sum.
        capacity_slots: slots per expert and sequence; None for dropless (everything kept).

    Returns:
        The `Routing`.
    """
    probs_BTE = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
    weight_BTK, expert_BTK = jax.lax.top_k(probs_BTE, top_k)
    if renormalize:
        weight_BTK = weight_BTK / jnp.sum(weight_BTK, axis=-1, keepdims=True)
    expert_BTK = expert_BTK.astype(jnp.int32)
    slot_BTK = _slots(expert_BTK, logits_BTE.shape[-1])
    if capacity_slots is None:
        keep_BTK = jnp.ones(expert_BTK.shape, bool)
    else:
        keep_BTK = slot_BTK < capacity_slots
    return Routing(expert_BTK, weight_BTK, slot_BTK, keep_BTK)


def _slots(expert_BTK: jax.Array, n_experts: int) -> jax.Array:
    """Each choice's rank among the choices for its expert in its sequence (k-major order)."""
    B, T, K = expert_BTK.shape
    onehot_BKTE = jax.nn.one_hot(expert_BTK.transpose(0, 2, 1), n_experts, dtype=jnp.int32)
    onehot_BNE = onehot_BKTE.reshape(B, K * T, n_experts)
    rank_BN = jnp.sum((jnp.cumsum(onehot_BNE, axis=1) - 1) * onehot_BNE, axis=-1)
    return rank_BN.reshape(B, K, T).transpose(0, 2, 1).astype(jnp.int32)


def load_balance_loss(logits_BTE: jax.Array, expert_BTK: jax.Array) -> jax.Array:
    """Switch / GShard load-balancing loss ``E · Σ_e f_e · P_e``: f_e the fraction of the k·N
    choices that picked expert e, P_e its mean router probability over the N tokens; 1 when
    balanced."""
    E = logits_BTE.shape[-1]
    probs_E = jnp.mean(jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1), axis=(0, 1))
    frac_E = jnp.mean(jax.nn.one_hot(expert_BTK, E, dtype=jnp.float32), axis=(0, 1, 2))
    probs_E, frac_E = _mean_over_rows(probs_E), _mean_over_rows(frac_E)
    return E * jnp.sum(frac_E * probs_E)


def router_sums(
    logits_BTE: jax.Array, expert_BTK: jax.Array, mask_BT: jax.Array | None = None
) -> dict[str, jax.Array]:
    """One MoE block's share of `pooled_load_balance_loss`, over the tokens `mask_BT` keeps (every
    token without one) of every shard's rows: per expert, the top-k choices that picked it
    (``router_choices`` [E]) and its summed router probability (``router_probs`` [E]), and the
    tokens counted (``router_tokens``)."""
    E = logits_BTE.shape[-1]
    probs_BTE = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
    if mask_BT is None:
        weight_BT = jnp.ones(logits_BTE.shape[:2], jnp.float32)
    else:
        weight_BT = mask_BT.astype(jnp.float32)
    onehot_BTKE = jax.nn.one_hot(expert_BTK, E, dtype=jnp.float32)
    sums = {
        "router_choices": jnp.einsum("btke,bt->e", onehot_BTKE, weight_BT),
        "router_probs": jnp.einsum("bte,bt->e", probs_BTE, weight_BT),
        "router_tokens": jnp.sum(weight_BT),
    }
    return {name: _over_rows(lax.psum, x) for name, x in sums.items()}


def pooled_load_balance_loss(
    choices_E: jax.Array, probs_E: jax.Array, tokens: jax.Array
) -> jax.Array:
    """transformers' Mixtral load-balancing loss ``E · Σ_e (c_e / N) · (p_e / N)`` from the
    `router_sums` added up over the MoE blocks: c_e the choices of expert e, p_e its summed
    router probability, N the tokens (each block counting its own); k when balanced."""
    n = jnp.maximum(tokens, 1.0)
    return choices_E.shape[-1] * jnp.sum((choices_E / n) * (probs_E / n))


def z_loss(logits_BTE: jax.Array) -> jax.Array:
    """Router z-loss (ST-MoE): the mean over tokens of ``logsumexp(logits)²``."""
    return _mean_over_rows(jnp.mean(jax.nn.logsumexp(logits_BTE.astype(jnp.float32), axis=-1) ** 2))


def load_stats(routing: Routing, n_experts: int) -> dict[str, jax.Array]:
    """Choices per expert (min / mean / max over experts) and the fraction of choices dropped."""
    counts_E = jnp.sum(jax.nn.one_hot(routing.expert_BTK, n_experts, dtype=jnp.float32), (0, 1, 2))
    counts_E = _over_rows(lax.psum, counts_E)
    return {
        "tokens_per_expert_min": jnp.min(counts_E),
        "tokens_per_expert_mean": jnp.mean(counts_E),
        "tokens_per_expert_max": jnp.max(counts_E),
        "dropped_fraction": 1.0 - _mean_over_rows(jnp.mean(routing.keep_BTK.astype(jnp.float32))),
    }
