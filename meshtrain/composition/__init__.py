"""The pairs of features that do not run together yet, as one table.

Each `Refusal` names two features, why they do not compose, the setting to change and the
fix. `pair_problems` reads the table, so the run check refuses a pair only through it, and
adding a feature means adding its rows to the table (`meshtrain.composition.rules`), not a
branch somewhere else::

    Problem  mesh.seq=2: context parallelism with pipelines: ...; set seq=1 or pipe=1

A run is a `meshtrain.RunSpec`; its ``mesh`` may be a `Mesh` or a mapping of axis sizes (a
planner's candidate).
"""

from __future__ import annotations

from meshtrain.composition.refusal import Refusal, model_name
from meshtrain.composition.rules import REFUSALS
from meshtrain.problem import Problem
from meshtrain.run import RunSpec

__all__ = ["REFUSALS", "Refusal", "model_name", "pair_problems"]


def pair_problems(run: RunSpec) -> list[Problem]:
    """Every pair of features in `run` that `REFUSALS` refuses, one `Problem` each.

    Args:
        run: the run (`meshtrain.RunSpec`); its mesh may be axis sizes alone.

    Returns:
        The problems, in the table's order; an empty list when no refused pair is present.
    """
    return [refusal.problem(run) for refusal in REFUSALS if refusal.applies(run)]
