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

With ``DataConfig.client_alpha`` the training batches are drawn per client (`ClientOrder`): the
training examples are partitioned among the data-parallel replicas (`client_partition`, the
groups from `example_groups`), and block r of every global batch (rows ``[r·B/R, (r+1)·B/R)``)
holds client r's examples only. Each client reads its part in epochs, each epoch a fresh
permutation drawn from the seed, the client and the epoch, so a batch is a function of the
seed and the step alone: the saved step resumes it, on any process count.
"""

from __future__ import annotations

import sys

import numpy as np

from meshtrain.problem import Problem

MAX_DRAWS = 100  # redraws allowed for every client to reach `min_examples`
MAX_GROUPS = 4096  # past this many labels or documents, runs of them are groups
SPANS_PER_CLIENT = 8  # data without labels or documents: contiguous spans ("sources")
_STREAM = 0x636C69  # tags the clients' epoch permutations apart from other draws of `seed`


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


def example_groups(examples, clients: int) -> np.ndarray:
    """The group of each training example: its label or its document (runs of consecutive
    ones past `MAX_GROUPS`), else its span of `SPANS_PER_CLIENT` · `clients` contiguous spans
    of the examples."""
    groups = examples.groups()
    if groups is None:
        return spans(examples.count, SPANS_PER_CLIENT * clients)
    kinds, codes = np.unique(np.asarray(groups), return_inverse=True)
    return codes * MAX_GROUPS // len(kinds) if len(kinds) > MAX_GROUPS else codes


def spans(count: int, n: int) -> np.ndarray:
    """`count` examples cut into `n` (at most `count`) contiguous spans of near-equal size."""
    return np.arange(count) * min(n, count) // count


def client_partition(
    examples, clients: int, alpha: float, *, seed: int, min_examples: int
) -> list[np.ndarray]:
    """`dirichlet_partition` of `examples` (a `Dataset`'s training examples) by
    `example_groups`; ValueError naming ``data.client_alpha`` when it cannot be met."""
    groups = example_groups(examples, clients)
    try:
        return dirichlet_partition(groups, clients, alpha, seed=seed, min_examples=min_examples)
    except ValueError:
        raise ValueError(
            f"data.client_alpha={alpha!r}: in {MAX_DRAWS} draws some of the {clients} clients "
            f"always got fewer than the {min_examples} examples of their rows of a batch; raise "
            "--data.client-alpha, or use fewer replicas or a smaller batch"
        ) from None


class ClientOrder:
    """The example indices of rows ``[lo, hi)`` of every global batch drawn per client: a
    sequence indexed by step, endless (grain's `MapDataset.source` reads it).

    Block r of step s is positions ``[s·b, (s+1)·b)`` of client r's stream (b = B/R): its
    part in epochs, each a permutation drawn from (`seed`, r, epoch).

    Args:
        parts: each client's example indices (`client_partition`).
        batch_size: the global batch size B, a multiple of the client count R.
        seed: the permutations' seed.
        rows: the rows of each global batch to give.
    """

    def __init__(self, parts: list[np.ndarray], batch_size: int, seed: int, rows=None):
        self.parts, self.seed = parts, seed
        self.per_client = batch_size // len(parts)
        self.rows = rows or (0, batch_size)
        self._cache: dict[int, tuple[int, np.ndarray]] = {}  # client → (epoch, permutation)

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, step: int) -> np.ndarray:
        """Example indices of rows ``[lo, hi)`` of global batch `step`."""
        (lo, hi), b = self.rows, self.per_client
        blocks = [
            self.block(r, step)[max(lo - r * b, 0) : hi - r * b]
            for r in range(lo // b, -(-hi // b))
        ]
        return np.concatenate(blocks)

    def block(self, client: int, step: int) -> np.ndarray:
        """Client `client`'s b example indices in batch `step`."""
        part, b = self.parts[client], self.per_client
        epochs, offsets = np.divmod(int(step) * b + np.arange(b), len(part))
        out = np.empty(b, dtype=np.int64)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            out[here] = part[self._permutation(client, int(epoch))[offsets[here]]]
        return out

    def _permutation(self, client: int, epoch: int) -> np.ndarray:
        """The order of `client`'s part in `epoch` (the latest epoch's kept per client)."""
        cached = self._cache.get(client)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([_STREAM, self.seed, client, epoch])
            cached = (epoch, rng.permutation(len(self.parts[client])))
            self._cache[client] = cached
        return cached[1]


def client_problems(alpha: float | None, local: bool) -> list[Problem]:
    """Client data where the replicas do not step apart (`local`: the sync settings'
    ``SyncConfig.local``), where a client partition means nothing."""
    if alpha is None or local:
        return []
    return [
        Problem(
            "data.client_alpha",
            alpha,
            "client data needs replicas that step apart: add --client-fraction, --gossip or "
            "--sync-every",
        )
    ]
