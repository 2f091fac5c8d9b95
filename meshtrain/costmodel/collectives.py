"""α-β costs of collectives, per algorithm (Hockney's model).

p devices take part; m is the message in bytes (for all-reduce the reduced buffer, for
all-gather the gathered result, for reduce-scatter the input before scattering, for all-to-all
each device's whole buffer); α is the per-message latency and β the seconds per byte of one
link direction. Reduction arithmetic is taken as free (the γ term left out: on GPUs it hides
under the transfers). The closed forms follow Thakur, Rabenseifner & Gropp, "Optimization of
Collective Communication Operations in MPICH" (IJHPCA 2005) and Chan et al., "Collective
communication: theory, practice, and experience" (2007), as surveyed by Ben-Nun & Hoefler,
"Demystifying Parallel and Distributed Deep Learning" (2019), §5.
"""

from __future__ import annotations

import math

from meshtrain.costmodel.profiles import Link

ALGORITHMS = ("ring", "tree", "recursive-doubling", "rabenseifner")
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _log2(p: int) -> int:
    """⌈log₂p⌉ (0 for one device)."""
    return math.ceil(math.log2(p)) if p > 1 else 0


def ring_all_reduce(p: int, m: float, alpha: float, beta: float) -> float:
    """Ring: a reduce-scatter then an all-gather around the ring.
    T = 2(p−1)·α + 2·(p−1)/p·m·β."""
    return 0.0 if p <= 1 else 2 * (p - 1) * alpha + 2 * (p - 1) / p * m * beta


def tree_all_reduce(p: int, m: float, alpha: float, beta: float) -> float:
    """Binary tree: reduce to the root, then broadcast, whole message per step.
    T = 2·⌈log₂p⌉·(α + m·β)."""
    return 2 * _log2(p) * (alpha + m * beta)


def recursive_doubling_all_reduce(p: int, m: float, alpha: float, beta: float) -> float:
    """Recursive doubling (butterfly): log₂p exchanges of the whole message.
    T = ⌈log₂p⌉·(α + m·β)."""
    return _log2(p) * (alpha + m * beta)


def rabenseifner_all_reduce(p: int, m: float, alpha: float, beta: float) -> float:
    """Rabenseifner: reduce-scatter by recursive halving, then all-gather by recursive doubling.
    T = 2·⌈log₂p⌉·α + 2·(p−1)/p·m·β."""
    return 0.0 if p <= 1 else 2 * _log2(p) * alpha + 2 * (p - 1) / p * m * beta


def all_gather(p: int, m: float, alpha: float, beta: float, algorithm: str = "ring") -> float:
    """All-gather of an m-byte result. Ring: T = (p−1)·α + (p−1)/p·m·β; recursive doubling
    (and Rabenseifner's second half): T = ⌈log₂p⌉·α + (p−1)/p·m·β; tree (gather then
    broadcast): T = 2·⌈log₂p⌉·α + (p−1)/p·m·β + ⌈log₂p⌉·m·β."""
    if p <= 1:
        return 0.0
    if algorithm == "ring":
        return (p - 1) * alpha + (p - 1) / p * m * beta
    if algorithm in ("recursive-doubling", "rabenseifner"):
        return _log2(p) * alpha + (p - 1) / p * m * beta
    return 2 * _log2(p) * alpha + (p - 1) / p * m * beta + _log2(p) * m * beta


def reduce_scatter(p: int, m: float, alpha: float, beta: float, algorithm: str = "ring") -> float:
    """Reduce-scatter of an m-byte input. Ring: T = (p−1)·α + (p−1)/p·m·β; recursive halving:
    T = ⌈log₂p⌉·α + (p−1)/p·m·β; tree (reduce then scatter): T = 2·⌈log₂p⌉·α + ⌈log₂p⌉·m·β +
    (p−1)/p·m·β."""
    return all_gather(p, m, alpha, beta, algorithm)  # the same closed forms, mirrored


def all_to_all(p: int, m: float, alpha: float, beta: float, algorithm: str = "ring") -> float:
    """All-to-all of m bytes per device. Pairwise exchange (used for "ring"): T = (p−1)·α +
    (p−1)/p·m·β; Bruck (log-steps, for the others): T = ⌈log₂p⌉·α + ⌈log₂p⌉·m/2·β."""
    if p <= 1:
        return 0.0
    if algorithm == "ring":
        return (p - 1) * alpha + (p - 1) / p * m * beta
    return _log2(p) * alpha + _log2(p) * m / 2 * beta


def permute(m: float, alpha: float, beta: float) -> float:
    """One point-to-point send of m bytes (every device at once): T = α + m·β."""
    return alpha + m * beta


_ALL_REDUCE = {
    "ring": ring_all_reduce,
    "tree": tree_all_reduce,
    "recursive-doubling": recursive_doubling_all_reduce,
    "rabenseifner": rabenseifner_all_reduce,
}


def flat_cost(kind: str, p: int, m: float, link: Link, algorithm: str = "ring") -> float:
    """Seconds for one collective of `kind` over p devices joined by `link`.

    Args:
        kind: one of `KINDS`.
        p: devices in the group.
        m: bytes (see the module docstring).
        link: the link every step crosses.
        algorithm: one of `ALGORITHMS`.

    Returns:
        The α-β time.
    """
    a, b = link.alpha, link.beta
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: choose from {', '.join(ALGORITHMS)}")
    if kind == "all-reduce":
        return _ALL_REDUCE[algorithm](p, m, a, b)
    if kind == "all-gather":
        return all_gather(p, m, a, b, algorithm)
    if kind == "reduce-scatter":
        return reduce_scatter(p, m, a, b, algorithm)
    if kind == "all-to-all":
        return all_to_all(p, m, a, b, algorithm)
    if kind == "collective-permute":
        return permute(m, a, b) if p > 1 else 0.0
    raise ValueError(f"kind={kind!r}: choose from {', '.join(KINDS)}")


def hierarchical_all_reduce(g: int, k: int, m: float, intra: Link, inter: Link) -> float:
    """Two-level all-reduce over k nodes of g devices: ring reduce-scatter within each node,
    ring all-reduce of the m/g shard across nodes (g such rings at once, one per local rank),
    ring all-gather within the node.
    T = 2·[(g−1)·α₁ + (g−1)/g·m·β₁] + 2(k−1)·α₂ + 2·(k−1)/k·(m/g)·β₂."""
    a1, b1, a2, b2 = intra.alpha, intra.beta, inter.alpha, inter.beta
    within = (g - 1) * a1 + (g - 1) / g * m * b1 if g > 1 else 0.0
    return 2 * within + ring_all_reduce(k, m / g, a2, b2)


def hierarchical_cost(kind: str, g: int, k: int, m: float, intra: Link, inter: Link) -> float:
    """Two-level cost of `kind` over k nodes × g devices per node (all-reduce as in
    `hierarchical_all_reduce`; all-gather and reduce-scatter: the cross-node ring on m/g then
    the in-node ring, T = (g−1)·α₁ + (g−1)/g·m·β₁ + (k−1)·α₂ + (k−1)/k·(m/g)·β₂; all-to-all and
    permutes cross the slow link at full size)."""
    if kind == "all-reduce":
        return hierarchical_all_reduce(g, k, m, intra, inter)
    if kind in ("all-gather", "reduce-scatter"):
        return flat_cost(kind, g, m, intra) + flat_cost(kind, k, m / g, inter)
    return flat_cost(kind, g * k, m, inter)
