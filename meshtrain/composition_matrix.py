"""The composition matrix: every feature against every other, each cell proven or refused.

A cell is an unordered pair of feature ids (`FEATURES`) from different groups, or from the
same group when that group's features combine (``tp`` with every data strategy). A cell is
**proven** when some test carries ``@pytest.mark.pair(a, b)`` (on the function, or on one of
its ``pytest.param`` cases) and checks that pair equal to one device (or to the feature's
documented reference); it is **refused** when a row of `meshtrain.composition.REFUSALS`
names it in ``cells``. `evidence` reads the markers from the test files with `ast` (nothing
is imported), so the table follows the test suite::

    found = evidence("tests")
    assert missing(found) == []  # every cell proven or refused

`KNOWN_GAPS` lists the cells found not to work, with the failure, until a fix or a refusal
row settles them (`KNOWN_GAPS_BEYOND_PAIRS`: combinations of three or more whose pairs work).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from meshtrain.pair_markers import markers

__all__ = [
    "EXCLUSIVE",
    "FEATURES",
    "GROUPS",
    "KNOWN_GAPS",
    "KNOWN_GAPS_BEYOND_PAIRS",
    "Cell",
    "Evidence",
    "cell",
    "cells",
    "evidence",
    "missing",
    "refused",
]

Cell = tuple[str, str]

# group → feature id → one line on what the feature is.
GROUPS: dict[str, dict[str, str]] = {
    "strategy": {
        "dp": "data parallelism: parameters replicated over the batch axes",
        "fsdp": "fully sharded data parallelism: parameters split over every batch axis",
        "hsdp": "hybrid sharding: parameters split over fsdp, replicated over data",
        "zero1": "ZeRO-1: parameters replicated, optimizer moments split over the batch axes",
        "tp": "tensor parallelism (+tp): layers split over the tensor axis, beside any of the four",
    },
    "pipeline schedule": {
        "gpipe": "pipe > 1, GPipe: all forwards, then all backwards",
        "circular": "pipe > 1, circular: each stage holds several chunks of layers (repeats)",
        "1f1b": "pipe > 1, one forward one backward: at most pipe microbatches in flight",
        "interleaved-1f1b": "pipe > 1, Megatron-LM's interleaved 1F1B: 1f1b with several "
        "chunks of layers per stage (repeats)",
        "zb-h1": "pipe > 1, zero bubble (ZB-H1): the backward split into an input pass and a "
        "deferred weight pass",
    },
    "context parallelism": {
        "ring": "seq > 1, ring attention: key/value blocks passed around the seq axis",
        "allgather": "seq > 1, keys and values all-gathered over the seq axis",
        "ulysses": "seq > 1, Ulysses: heads and sequence exchanged by all-to-all",
    },
    "MoE dispatch": {
        "moe-capacity": "mixture of experts with a capacity per expert (overflow dropped)",
        "moe-dropless": "mixture of experts with every routed token computed",
    },
    "data": {
        "packed": "packed documents: segment ids and positions, loss over real tokens",
    },
    "communicating less": {
        "compression": "gradient compression of the replicas' exchange (--grad-compression)",
        "local-sgd": "local SGD: replicas step alone, parameters averaged every H steps",
        "diloco": "DiLoCo: local SGD with an outer Nesterov optimizer at each sync",
        "staleness": "bounded staleness: the update applies the gradient of s steps before",
        "gossip": "gossip: replicas mix parameters with their neighbours on a graph (--gossip)",
        "federated": "federated averaging: a sampled share of the replicas per round "
        "(--client-fraction)",
    },
    "kernels": {
        "pallas": "the Pallas kernels (attention, norms, loss)",
        "cudnn": "cuDNN's fused attention (GPU)",
    },
    "remat": {"remat": "rematerialisation of the blocks' activations (--remat)"},
    "offload": {
        "offload-optimizer": "the optimizer state in host memory between steps (--offload)",
        "offload-activations": "residuals moved to host memory by the remat policy (offload:...)",
    },
    "accumulation": {"accumulation": "gradient accumulation over microbatches (--accum-steps)"},
    "precision": {
        "bf16": "bfloat16 compute with float32 parameters and optimizer state",
        "fp16": "float16 compute with dynamic loss scaling (--precision fp16)",
        "fp8": "fp8 dense matmuls: e4m3 operands, e5m2 gradients (--precision fp8)",
    },
    "resume": {
        "resume-relayout": "a checkpoint resumed onto another mesh or strategy",
    },
}

FEATURES: dict[str, str] = {k: v for group in GROUPS.values() for k, v in group.items()}

# Sets of features a run has at most one of: their pairs are not cells.
EXCLUSIVE: tuple[frozenset[str], ...] = (
    frozenset({"dp", "fsdp", "hsdp", "zero1"}),  # one data strategy (tp goes with each)
    frozenset({"gpipe", "circular", "1f1b", "interleaved-1f1b", "zb-h1"}),  # one schedule
    frozenset({"ring", "allgather", "ulysses"}),  # one algorithm
    frozenset({"moe-capacity", "moe-dropless"}),  # one dispatch
    frozenset({"pallas", "cudnn"}),  # one attention implementation
    # DiLoCo is local SGD with an outer optimizer; gossip and federated rounds replace its sync
    frozenset({"local-sgd", "diloco", "gossip", "federated"}),
    frozenset({"bf16", "fp16", "fp8"}),  # one precision policy
    frozenset({"remat", "offload-activations"}),  # one remat policy
)

# Cells found not to work (cell → the configuration and the error), until a fix lands or a
# refusal row names them.
KNOWN_GAPS: dict[Cell, str] = {}

# Combinations of more than two features found not to work, though each of their pairs does.
KNOWN_GAPS_BEYOND_PAIRS: dict[tuple[str, ...], str] = {}


def cell(a: str, b: str) -> Cell:
    """The cell of features `a` and `b`, in `FEATURES` order (``cell("tp", "dp") == ("dp",
    "tp")``); raises ``ValueError`` on an unknown id or a pair that is not a cell."""
    order = list(FEATURES)
    for f in (a, b):
        if f not in FEATURES:
            raise ValueError(f"{f!r}: not a feature id; choose from {', '.join(order)}")
    if a == b or any({a, b} <= group for group in EXCLUSIVE):
        raise ValueError(f"({a!r}, {b!r}): one run has only one of them, so it is not a cell")
    return (a, b) if order.index(a) < order.index(b) else (b, a)


def cells() -> list[Cell]:
    """Every cell of the matrix, in `FEATURES` order."""
    return [
        (a, b)
        for a, b in itertools.combinations(FEATURES, 2)
        if not any({a, b} <= group for group in EXCLUSIVE)
    ]


class Evidence(NamedTuple):
    """What the test files say about the matrix.

    Args:
        proofs: cell → the tests (``tests/file.py::function``) that carry its pair marker.
        bad: one line per pair marker that names no cell (unknown id, a feature with itself
            or two of one exclusive group, arguments that are not string literals).
    """

    proofs: dict[Cell, list[str]]
    bad: list[str]


def evidence(root: str | Path = "tests") -> Evidence:
    """The ``pair`` markers of the test files ``root/test_*.py``, read with `ast` (see
    `meshtrain.pair_markers.markers` for where a marker counts).

    Args:
        root: the folder of the test files.

    Returns:
        The proven cells and the markers that name no cell.
    """
    proofs: dict[Cell, list[str]] = {}
    bad: list[str] = []
    for where, found in markers(root):
        try:
            if isinstance(found, str):
                raise ValueError(found)
            c = cell(*found)
        except (TypeError, ValueError) as e:
            bad.append(f"{where}: {e}")
            continue
        if where not in proofs.setdefault(c, []):
            proofs[c].append(where)
    return Evidence(proofs, bad)


def refused(refusals: Iterable | None = None) -> dict[Cell, str]:
    """Cell → the one-line refusal that names it (``first with second: reason``).

    Args:
        refusals: rows with ``first``, ``second``, ``reason`` and ``cells``; None:
            `meshtrain.composition.REFUSALS`.

    Returns:
        The refused cells; a cell two rows name keeps the first row's line.
    """
    if refusals is None:
        from meshtrain.composition import REFUSALS

        refusals = REFUSALS
    out: dict[Cell, str] = {}
    for row in refusals:
        for a, b in row.cells:
            out.setdefault(cell(a, b), f"{row.first} with {row.second}: {row.reason}")
    return out


def missing(proofs: Mapping[Cell, object], refusals: Iterable | None = None) -> list[Cell]:
    """The cells neither proven (a key of `proofs`) nor refused (see `refused`).

    Args:
        proofs: the proven cells, e.g. ``evidence(...).proofs``.
        refusals: as for `refused`.

    Returns:
        The cells with no evidence, in matrix order.
    """
    settled = set(proofs) | set(refused(refusals))
    return [c for c in cells() if c not in settled]
