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
    """A gossip topology the replica axes of `rules` on a mesh of `sizes` cannot form. Each
    leaf gossips among its own copies, so beside expert parallelism the graph must form over
    the data replicas alone too (an expert's weights have one copy per data replica). A layout
    with no replicas at all (and so no clients for federated averaging) is the composition
    table's to refuse (`meshtrain.composition`), so it adds nothing here."""
    sets = replica_sets(rules, sizes)
    if not sets.axes or not sync.gossips:
        return []
    found = gossip.problems(sync.gossip, {a: sizes[a] for a in sets.axes}, field="gossip")
    own = tuple(a for a in sets.axes if a not in sets.split)
    if found or not sets.split or not own:
        return found
    over = " × ".join(f"{a}={sizes[a]}" for a in own)
    experts = gossip.problems(sync.gossip, {a: sizes[a] for a in own}, field="gossip")
    return [Problem(p.field, p.value, f"the expert weights ({over}): {p.message}") for p in experts]
