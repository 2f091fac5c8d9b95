"""Gossip averaging: each replica mixes its parameters with its neighbours' on a graph.

A topology over the m replicas (the devices along the replica axes, numbered row-major in the
axes' order) gives for each mixing step t a doubly stochastic matrix W_t, and one mixing step
sets θ_r ← Σ_j W_t[r, j] θ_j. Inside a region manual over the replica axes that is a weighted
sum of collective permutes, one per neighbour: no all-reduce, and the bytes a replica sends
depend on its degree, not on m.

- ``ring``: W = (I + S + S⁻¹) / 3, S the cyclic shift over the replicas (m = 2: (I + S) / 2);
- ``torus``: over two replica axes of sizes a × b, W = (I + S_a + S_a⁻¹ + S_b + S_b⁻¹) / 5, S_a
  shifting along the first axis and S_b along the second (an axis of size 2 has S = S⁻¹: that
  neighbour counts twice, through one permute, and W stays doubly stochastic);
- ``exponential``: one peer per step, at distance 2^k with k = t mod log₂ m: W_t = (I + S^(2^k))
  / 2. For m a power of two, log₂ m consecutive steps multiply to 11ᵀ / m (Assran et al.,
  "Stochastic Gradient Push", 2019): exact consensus;
- ``complete``: W = 11ᵀ / m through m − 1 permutes; it equals averaging over every replica,
  the reference the others are tested against.

Beside expert parallelism each leaf gossips among its own copies (`meshtrain.replicas.sets`):
an MoE's dense weights on the graph over the devices of data and expert, its expert weights on
the graph over the data replicas alone, as local SGD and federated averaging average each leaf.

Lian et al. ("Can Decentralized Algorithms Outperform Centralized Algorithms?", 2017) analyse
decentralized SGD with such a W; Ben-Nun & Hoefler's survey discusses gossip's rounds.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshtrain import validate
from meshtrain.problem import Problem
from meshtrain.replicas.config import TOPOLOGIES


@dataclasses.dataclass(frozen=True)
class Term:
    """One term of a mixing step: the replicas' values shifted by `by` along `axes` (the
    replica r takes replica r − by's), times `weight`; ``by == 0`` is the replica's own."""

    axes: tuple[str, ...]
    by: int
    weight: float


def problems(topology: str, sizes: dict[str, int], field: str = "sync.gossip") -> list[Problem]:
    """What keeps `topology` from forming over replica axes of `sizes` (in mesh order), as one
    `Problem` each.

    Args:
        topology: one of `TOPOLOGIES`.
        sizes: the replica axes and their sizes, in mesh order.
        field: the setting's name in the messages.
    """
    found = validate.one_of(field, topology, TOPOLOGIES, example="ring")
    if found:
        return found
    m = math.prod(sizes.values())
    axes = " × ".join(f"{a}={s}" for a, s in sizes.items()) or "none"
    if m < 2:
        return [Problem(field, topology, f"needs at least 2 replicas; the replica axes give {m}")]
    if topology == "torus" and (len(sizes) != 2 or min(sizes.values()) < 2):
        message = (
            f"needs two replica axes of size ≥ 2 (for example data=2,fsdp=4 under dp); the "
            f"replica axes are {axes}; use ring on one axis"
        )
        return [Problem(field, topology, message)]
    if topology == "exponential" and m & (m - 1):
        message = f"needs a power-of-two number of replicas; {axes} gives {m}; use ring"
        return [Problem(field, topology, message)]
    return []


def period(topology: str, sizes: dict[str, int]) -> int:
    """After how many mixing steps a topology's matrices repeat (log₂ m for ``exponential``,
    1 for the fixed graphs)."""
    if topology == "exponential":
        return max(1, math.prod(sizes.values()).bit_length() - 1)
    return 1


def terms(topology: str, sizes: dict[str, int], step: int = 0) -> list[Term]:
    """The terms of mixing step `step` (see the module docstring); their weights sum to 1.

    Args:
        topology: one of `TOPOLOGIES`.
        sizes: the replica axes and their sizes, in mesh order.
        step: the mixing step (only ``exponential`` changes with it).

    Raises:
        ValueError: the topology cannot form over `sizes` (`problems`).
    """
    found = problems(topology, sizes)
    if found:
        raise ValueError(str(found[0]))
    axes = tuple(sizes)
    m = math.prod(sizes.values())
    if topology == "complete":
        raw = [(axes, by, 1 / m) for by in range(m)]
    elif topology == "exponential":
        raw = [(axes, 0, 0.5), (axes, 2 ** (step % period(topology, sizes)), 0.5)]
    elif topology == "ring":
        raw = (
            [(axes, by, 1 / 3) for by in (0, 1, -1)] if m > 2 else [(axes, 0, 0.5), (axes, 1, 0.5)]
        )
    else:  # torus
        raw = [(axes, 0, 0.2)] + [((a,), by, 0.2) for a in axes for by in (1, -1)]
    # The same shift reached twice (±1 along an axis of size 2) is one permute, weights summed.
    merged: dict[tuple[tuple[str, ...], int], float] = {}
    for over, by, weight in raw:
        n = math.prod(sizes[a] for a in over)
        key = (axes if by % n == 0 else over, by % n)
        merged[key] = merged.get(key, 0.0) + weight
    return [Term(over, by, weight) for (over, by), weight in merged.items()]


def matrix(topology: str, sizes: dict[str, int], step: int = 0) -> np.ndarray:
    """W of mixing step `step` as an m × m array (row r: the weights replica r takes)."""
    m = math.prod(sizes.values())
    grid = np.arange(m).reshape(tuple(sizes.values()))
    w = np.zeros((m, m))
    for t in terms(topology, sizes, step):
        if len(t.axes) == len(sizes):
            src = (np.arange(m) - t.by) % m
        else:
            dim = list(sizes).index(t.axes[0])
            src = np.roll(grid, t.by, axis=dim).ravel()
        w[np.arange(m), src] += t.weight
    return w


def sent_per_step(topology: str, sizes: dict[str, int]) -> int:
    """Copies of its parameters a replica sends per mixing step: its distinct shifts besides its
    own (ring 2, or 1 for two replicas; torus 4, fewer along an axis of size 2; exponential 1;
    complete m − 1)."""
    return sum(1 for t in terms(topology, sizes) if t.by)


def _shifted(x: jax.Array, t: Term, sizes: dict[str, int]) -> jax.Array:
    """`x` of the replica `t.by` before this one along `t.axes` (a collective permute)."""
    n = math.prod(sizes[a] for a in t.axes)
    perm = [(i, (i + t.by) % n) for i in range(n)]
    return lax.ppermute(x, t.axes if len(t.axes) > 1 else t.axes[0], perm)


def _mix_fixed(tree, topology: str, sizes: dict[str, int], step: int):
    """One mixing step of a fixed `step`, in float32 per leaf."""

    def one(x):
        total = None
        for t in terms(topology, sizes, step):
            y = x if t.by == 0 else _shifted(x, t, sizes)
            part = t.weight * y.astype(jnp.float32)
            total = part if total is None else total + part
        return total.astype(x.dtype)

    return jax.tree.map(one, tree)


def mix(tree, topology: str, sizes: dict[str, int], step: jax.Array | int = 0):
    """One gossip mixing step of this replica's `tree` (call it inside a region manual over
    the replica axes): θ_r ← Σ_j W_t[r, j] θ_j, each leaf summed in float32.

    Args:
        tree: this replica's arrays.
        topology: one of `TOPOLOGIES`.
        sizes: the replica axes and their sizes, in mesh order.
        step: the mixing step t (a traced step picks the ``exponential`` peer with a switch).

    Returns:
        The mixed tree, each leaf in its own dtype.
    """
    n = period(topology, sizes)
    if isinstance(step, int) or n == 1:
        return _mix_fixed(tree, topology, sizes, step % n if isinstance(step, int) else 0)
    branches = [lambda tr, k=k: _mix_fixed(tr, topology, sizes, k) for k in range(n)]
    return lax.switch(jnp.asarray(step, jnp.int32) % n, branches, tree)


def consensus_distance(tree, axes: tuple[str, ...]) -> jax.Array:
    """The replicas' mean distance to their average, ‖θ_r − θ̄‖ over all leaves (inside a region
    manual over the replica `axes`; one all-reduce per leaf, so read it when logging)."""
    squares = []
    for x in jax.tree.leaves(tree):
        x = x.astype(jnp.float32)
        squares.append(jnp.sum(jnp.square(x - lax.pmean(x, axes))))
    return lax.pmean(jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32))), axes)
