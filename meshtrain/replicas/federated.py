"""Federated averaging's rounds: which clients train, and how their updates are weighed.

The replicas are the clients (McMahan et al., "Communication-Efficient Learning of Deep
Networks from Decentralized Data", 2017). Each round a fraction of them is sampled; the server
averages the sampled clients' changes Δ_k, weighted by their examples n_k:
Δ = Σ_k n_k Δ_k / Σ_k n_k over the sampled k, and applies Δ with its own optimizer.

- `sampled_mask`, `sampled_clients`: the clients of a round, drawn from a key made of the
  run's seed and the round alone, so every process draws the same ones and a resumed run draws
  what the uninterrupted one would;
- `round_weights`: each client's weight in a round (n_k / Σ n_k when sampled, 0 otherwise);
- `weighted_mean`: the weighted mean of the clients' values inside a region manual over the
  replica axes (one all-reduce of the weighted values and one of the weights);
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshtrain.layout import varying


def clients_per_round(clients: int, fraction: float) -> int:
    """How many clients a round samples: ⌈fraction · clients⌉, at least one."""
    return max(1, min(clients, math.ceil(fraction * clients - 1e-9)))


def sampled_mask(round_, clients: int, fraction: float, seed: int = 0) -> jax.Array:
    """Which clients round `round_` trains, as a float32 ``[clients]`` mask of 0 and 1:
    `clients_per_round` of them, the first of a permutation drawn from the key of `seed` folded
    with `round_` (`round_` may be traced: the step draws it on every device alike)."""
    key = jax.random.fold_in(jax.random.key(int(seed)), jnp.asarray(round_, jnp.uint32))
    chosen = jax.random.permutation(key, clients)[: clients_per_round(clients, fraction)]
    return jnp.zeros((clients,), jnp.float32).at[chosen].set(1.0)


def sampled_clients(round_: int, clients: int, fraction: float, seed: int = 0) -> np.ndarray:
    """The clients round `round_` trains, ascending (`sampled_mask`'s, on the host)."""
    return np.flatnonzero(np.asarray(sampled_mask(round_, clients, fraction, seed)))


def round_weights(sampled, examples) -> np.ndarray:
    """Each client's weight in a round: its examples over the sampled clients' total when it
    is sampled, 0 otherwise (float32, summing to 1).

    Args:
        sampled: the round's clients (`sampled_clients`).
        examples: every client's number of examples.
    """
    examples = np.asarray(examples, np.float64)
    weights = np.zeros(len(examples))
    weights[np.asarray(sampled)] = examples[np.asarray(sampled)]
    total = weights.sum()
    if total <= 0:
        raise ValueError("round_weights: the sampled clients hold no examples")
    return (weights / total).astype(np.float32)


def weighted_mean(tree, weight: jax.Array, axes: tuple[str, ...]):
    """Σ_k w_k x_k / Σ_k w_k over the clients along `axes` (inside a region manual over them),
    each leaf summed in float32 and returned in its dtype; a client of weight 0 adds nothing.
    A weight the same along some of `axes` (a client spanning several devices) counts once per
    device there."""
    weight = varying(weight.astype(jnp.float32), axes)
    total = lax.psum(weight, axes)

    def one(x):
        part = lax.psum(weight * x.astype(jnp.float32), axes)
        return (part / total).astype(x.dtype)

    return jax.tree.map(one, tree)
