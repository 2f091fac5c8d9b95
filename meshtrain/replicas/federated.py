"""Federated averaging's rounds: which clients train, and how their updates are weighed.

The replicas are the clients (McMahan et al., "Communication-Efficient Learning of Deep
Networks from Decentralized Data", 2017). Each round a fraction of them is sampled; the server
averages the sampled clients' changes Δ_k, weighted by their examples n_k:
Δ = Σ_k n_k Δ_k / Σ_k n_k over the sampled k, and applies Δ with its own optimizer.

- `sampled_clients`: the clients of a round, drawn from a generator seeded with the run's seed
  and the round alone, so every process draws the same ones and a resumed run draws what the
  uninterrupted one would;
- `round_weights`: each client's weight in a round (n_k / Σ n_k when sampled, 0 otherwise);
- `weighted_mean`: the weighted mean of the clients' values inside a region manual over the
  replica axes (one all-reduce of the weighted values and one of the weights);
- `problems`: settings no round can have, one line each.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshtrain import validate
from meshtrain.problem import Problem


def problems(fraction: float, local_steps: int, clients: int) -> list[Problem]:
    """A sampled fraction outside (0, 1], fewer than one local step, or fewer than two
    clients (the replicas along the replica axes), as one `Problem` each."""
    found = validate.in_range(
        "federated.fraction", fraction, 0, 1, closed="(]", example=0.25,
        note="the share of clients each round trains",
    )  # fmt: skip
    found += validate.positive("federated.local_steps", local_steps, example=8)
    if clients < 2:
        message = (
            f"federated averaging needs at least 2 clients (the replicas); this layout has "
            f"{clients}; give the mesh a data axis of size ≥ 2"
        )
        found.append(Problem("federated", clients, message))
    return found


def clients_per_round(clients: int, fraction: float) -> int:
    """How many clients a round samples: ⌈fraction · clients⌉, at least one."""
    return max(1, min(clients, math.ceil(fraction * clients - 1e-9)))


def sampled_clients(round_: int, clients: int, fraction: float, seed: int = 0) -> np.ndarray:
    """The clients round `round_` trains, ascending: `clients_per_round` of them, drawn without
    replacement from a generator seeded with ``(seed, round_)``."""
    rng = np.random.default_rng((int(seed), int(round_)))
    chosen = rng.choice(clients, size=clients_per_round(clients, fraction), replace=False)
    return np.sort(chosen)


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
    each leaf summed in float32 and returned in its dtype; a client of weight 0 adds nothing."""
    total = lax.psum(weight.astype(jnp.float32), axes)

    def one(x):
        part = lax.psum(weight.astype(jnp.float32) * x.astype(jnp.float32), axes)
        return (part / total).astype(x.dtype)

    return jax.tree.map(one, tree)
