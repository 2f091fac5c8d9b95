"""Client partitions: the examples of a dataset split among federated clients, identically
distributed or not.

`dirichlet_partition` gives each client a Dirichlet(α) mix of the groups (the labels of an
image dataset, the documents or sources of a token corpus): for each group it draws the
clients' shares p ~ Dir(α, ..., α) and splits the group's examples, shuffled, at those shares
(Hsu, Qi & Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated
Visual Classification", 2019). Small α gives each client few groups (α = 0.1: most clients see
one or two labels); large α approaches an identically distributed split. Every example goes
to exactly one client, and the partition is a function of its arguments alone: a resumed run
recomputes the same one. `group_skew` measures what a partition gives.
"""

from __future__ import annotations

import numpy as np

MAX_DRAWS = 100  # redraws allowed for every client to reach `min_examples`


def dirichlet_partition(
    groups, clients: int, alpha: float, *, seed: int = 0, min_examples: int = 1
) -> list[np.ndarray]:
    """Splits examples among `clients`, each a Dirichlet(`alpha`) mix of the groups.

    Args:
        groups: one group id per example (a label, a document or source id).
        clients: the number of clients.
        alpha: the Dirichlet concentration, > 0 (0.1: strongly skewed; 100: nearly i.i.d.).
        seed: the generator's seed (the partition depends on it alone).
        min_examples: the fewest examples a client may get; the shares are redrawn (up to
            `MAX_DRAWS` times) until every client has that many.

    Returns:
        One sorted array of example indices per client; together they hold every example
        once.

    Raises:
        ValueError: a bad argument, or no draw giving every client `min_examples` (the message
            names the fix).
    """
    groups = np.asarray(groups)
    n = len(groups)
    if groups.ndim != 1 or n == 0:
        raise ValueError(f"groups: one group id per example, got shape {groups.shape}")
    if not isinstance(clients, int) or clients < 1:
        raise ValueError(f"clients={clients!r}: must be a positive integer, e.g. 8")
    if not alpha > 0:
        raise ValueError(f"alpha={alpha!r}: the Dirichlet concentration must be > 0, e.g. 0.1")
    if min_examples * clients > n:
        raise ValueError(
            f"min_examples={min_examples}: {clients} clients need {min_examples * clients} "
            f"examples and there are {n}; use fewer clients or a smaller min_examples"
        )
    rng = np.random.default_rng(seed)
    members = _members(groups)
    for _ in range(MAX_DRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
        for idx in members:
            idx = rng.permutation(idx)
            shares = rng.dirichlet(np.full(clients, float(alpha)))
            cuts = np.round(np.cumsum(shares)[:-1] * len(idx)).astype(int)
            for c, piece in enumerate(np.split(idx, cuts)):
                parts[c].append(piece)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) >= min_examples:
            return out
    raise ValueError(
        f"alpha={alpha!r}: in {MAX_DRAWS} draws some of the {clients} clients always got fewer "
        f"than {min_examples} examples; raise alpha, use fewer clients or lower min_examples"
    )


def _members(groups: np.ndarray) -> list[np.ndarray]:
    """The ascending example indices of each group, the groups in sorted order."""
    _, codes = np.unique(groups, return_inverse=True)
    order = np.argsort(codes, kind="stable")
    return np.split(order, np.cumsum(np.bincount(codes))[:-1])


def group_skew(partition: list[np.ndarray], groups) -> float:
    """How far the clients' group mixes are from the whole dataset's: the mean over clients,
    weighted by their examples, of the total variation distance between a client's group
    frequencies and the dataset's (0: identical mixes; near 1: disjoint groups)."""
    kinds, codes = np.unique(np.asarray(groups), return_inverse=True)
    whole = np.bincount(codes, minlength=len(kinds)) / len(codes)
    n = sum(len(p) for p in partition)
    total = 0.0
    for p in partition:
        if len(p):
            mix = np.bincount(codes[p], minlength=len(kinds)) / len(p)
            total += len(p) / n * 0.5 * float(np.abs(mix - whole).sum())
    return total
