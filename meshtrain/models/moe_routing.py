"""Mixture-of-experts routing math: top-k choice, capacity slots, router losses and load stats.

The choice (`Choice`) is Mixtral's (softmax, top-k) or DeepSeek-V3's (sigmoid scores, a
balancing bias that moves the choice only, group-limited top-k, a routed scale).

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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain.layout import rows_are_apart
from meshtrain.layout.manual import manual_batch_axes
from meshtrain.models.moe_dispatch import Routing

ROUTER_LOSSES = ("meshtrain", "mixtral")
ROUTER_SCORES = ("softmax", "sigmoid")


class Choice(NamedTuple):
    """How a router chooses: its score function (`ROUTER_SCORES`), the equal expert groups
    and how many of them each token may use (DeepSeek-V3's ``n_group`` and ``topk_group``), and
    the factor the chosen weights are scaled by (``routed_scaling_factor``)."""

    scores: str = "softmax"
    groups: int = 1
    groups_per_token: int = 1
    scale: float = 1.0


MIXTRAL = Choice()  # softmax, one group, scale 1


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
    logits_BTE: jax.Array,
    top_k: int,
    *,
    renormalize: bool,
    capacity_slots: int | None,
    choice: Choice = MIXTRAL,
    bias_E: jax.Array | None = None,
) -> Routing:
    """Scores over the experts (`Choice.scores`), then the top `top_k` (renormalised to sum to
    one when `renormalize`, as Mixtral does); slots in each expert's buffer per sequence.

    Args:
        logits_BTE: router logits, float32.
        top_k: choices per token.
        renormalize: divide the chosen scores by their sum.
        capacity_slots: slots per expert and sequence; None for dropless (everything kept).
        choice: the score function, expert groups and routed scale (softmax, one group,
            scale 1 by default: Mixtral's router).
        bias_E: a balancing bias added to the scores for the choice only (its weights are the
            unbiased scores); no gradient flows into it. None: no bias.

    Returns:
        The `Routing`.
    """
    weight_BTK, expert_BTK = choose(logits_BTE, top_k, choice, bias_E)
    if renormalize:
        weight_BTK = weight_BTK / (jnp.sum(weight_BTK, axis=-1, keepdims=True) + 1e-20)
    weight_BTK = weight_BTK * choice.scale
    slot_BTK = _slots(expert_BTK, logits_BTE.shape[-1])
    if capacity_slots is None:
        keep_BTK = jnp.ones(expert_BTK.shape, bool)
    else:
        keep_BTK = slot_BTK < capacity_slots
    return Routing(expert_BTK, weight_BTK, slot_BTK, keep_BTK)


def scores(logits_BTE: jax.Array, kind: str) -> jax.Array:
    """Each token's affinity to each expert: ``softmax`` over the experts or ``sigmoid`` each."""
    logits_BTE = logits_BTE.astype(jnp.float32)
    if kind == "sigmoid":
        return jax.nn.sigmoid(logits_BTE)
    return jax.nn.softmax(logits_BTE, axis=-1)


def choose(
    logits_BTE: jax.Array, top_k: int, choice: Choice, bias_E: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The top `top_k` experts of each token on score + bias, within its best
    ``choice.groups_per_token`` groups (a group scored by the sum of its two best biased scores,
    DeepSeek-V3's group-limited routing); their unbiased scores, and their ids (int32)."""
    scores_BTE = scores(logits_BTE, choice.scores)
    biased_BTE = scores_BTE
    if bias_E is not None:
        biased_BTE = scores_BTE + lax.stop_gradient(bias_E.astype(jnp.float32))
    if choice.groups > 1:
        biased_BTE = _within_best_groups(biased_BTE, choice.groups, choice.groups_per_token)
    _, expert_BTK = jax.lax.top_k(lax.stop_gradient(biased_BTE), top_k)
    expert_BTK = expert_BTK.astype(jnp.int32)
    return jnp.take_along_axis(scores_BTE, expert_BTK, axis=-1), expert_BTK


def _within_best_groups(biased_BTE: jax.Array, groups: int, keep: int) -> jax.Array:
    """`biased_BTE` with the experts outside each token's best `keep` of `groups` equal groups
    set to -inf (a group's score: the sum of its two best entries)."""
    B, T, E = biased_BTE.shape
    biased_BTGP = biased_BTE.reshape(B, T, groups, E // groups)
    best_BTG = jnp.sum(jax.lax.top_k(biased_BTGP, min(2, E // groups))[0], axis=-1)
    _, group_BTK = jax.lax.top_k(best_BTG, keep)
    chosen_BTG = jnp.sum(jax.nn.one_hot(group_BTK, groups, dtype=jnp.int32), axis=-2) > 0
    masked_BTGP = jnp.where(chosen_BTG[..., None], biased_BTGP, -jnp.inf)
    return masked_BTGP.reshape(B, T, E)


def _slots(expert_BTK: jax.Array, n_experts: int) -> jax.Array:
    """Each choice's rank among the choices for its expert in its sequence (k-major order)."""
    B, T, K = expert_BTK.shape
    onehot_BKTE = jax.nn.one_hot(expert_BTK.transpose(0, 2, 1), n_experts, dtype=jnp.int32)
    onehot_BNE = onehot_BKTE.reshape(B, K * T, n_experts)
    rank_BN = jnp.sum((jnp.cumsum(onehot_BNE, axis=1) - 1) * onehot_BNE, axis=-1)
    return rank_BN.reshape(B, K, T).transpose(0, 2, 1).astype(jnp.int32)


def token_probs(logits_BTE: jax.Array, kind: str = "softmax") -> jax.Array:
    """Each token's router probabilities for the balancing losses: the softmax, or (``sigmoid``
    scores) the sigmoid scores divided by their sum over the experts (DeepSeek-V3's form)."""
    scores_BTE = scores(logits_BTE, kind)
    if kind == "sigmoid":
        return scores_BTE / jnp.sum(scores_BTE, axis=-1, keepdims=True)
    return scores_BTE


def load_balance_loss(
    logits_BTE: jax.Array, expert_BTK: jax.Array, kind: str = "softmax"
) -> jax.Array:
    """Switch / GShard load-balancing loss ``E · Σ_e f_e · P_e``: f_e the fraction of the k·N
    choices that picked expert e, P_e its mean router probability (`token_probs` of score
    function `kind`) over the N tokens; 1 when balanced."""
    E = logits_BTE.shape[-1]
    probs_E = jnp.mean(token_probs(logits_BTE, kind), axis=(0, 1))
    frac_E = jnp.mean(jax.nn.one_hot(expert_BTK, E, dtype=jnp.float32), axis=(0, 1, 2))
    probs_E, frac_E = _mean_over_rows(probs_E), _mean_over_rows(frac_E)
    return E * jnp.sum(frac_E * probs_E)


def router_sums(
    logits_BTE: jax.Array,
    expert_BTK: jax.Array,
    mask_BT: jax.Array | None = None,
    kind: str = "softmax",
) -> dict[str, jax.Array]:
    """One MoE block's share of `pooled_load_balance_loss`, over the tokens `mask_BT` keeps (every
    token without one) of every shard's rows: per expert, the top-k choices that picked it
    (``router_choices`` [E]) and its summed router probability (``router_probs`` [E]), and the
    tokens counted (``router_tokens``)."""
    E = logits_BTE.shape[-1]
    probs_BTE = token_probs(logits_BTE, kind)
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


def expert_counts(expert_BTK: jax.Array, n_experts: int) -> jax.Array:
    """The top-k choices that picked each expert [E], float32, over the rows of every shard."""
    counts_E = jnp.sum(jax.nn.one_hot(expert_BTK, n_experts, dtype=jnp.float32), (0, 1, 2))
    return _over_rows(lax.psum, counts_E)


def load_stats(routing: Routing, n_experts: int) -> dict[str, jax.Array]:
    """Choices per expert (min / mean / max over experts) and the fraction of choices dropped."""
    counts_E = expert_counts(routing.expert_BTK, n_experts)
    return {
        "tokens_per_expert_min": jnp.min(counts_E),
        "tokens_per_expert_mean": jnp.mean(counts_E),
        "tokens_per_expert_max": jnp.max(counts_E),
        "dropped_fraction": 1.0 - _mean_over_rows(jnp.mean(routing.keep_BTK.astype(jnp.float32))),
    }
