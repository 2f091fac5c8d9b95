"""What gossip needs of the layout: a graph the replicas can form (`layout_problems`, one
line each, for the run check)."""

from __future__ import annotations

from collections.abc import Mapping

from meshtrain.layout import Rules
from meshtrain.problem import Problem
from meshtrain.replicas import gossip
from meshtrain.replicas.config import SyncConfig
from meshtrain.replicas.sets import replica_sets


def layout_problems(sync: SyncConfig, rules: Rules, sizes: Mapping[str, int]) -> list[Problem]:
    """A gossip topology the replica axes of `rules` on a mesh of `sizes` cannot form. A layout
    with no replicas at all (and so no clients for federated averaging) is the composition
    table's to refuse (`meshtrain.composition`), so it adds nothing here."""
    axes = replica_sets(rules, sizes).axes
    if not axes or not sync.gossips:
        return []
    return gossip.problems(sync.gossip, {a: sizes[a] for a in axes}, field="gossip")
