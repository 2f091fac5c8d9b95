"""The mesh planner and scaling projections."""

from meshtrain.plan.analytic import Modelled, model_candidate
from meshtrain.plan.search import Choice, Plan, PlanError, plan
from meshtrain.plan.space import Candidate, candidates

__all__ = [
    "Candidate",
    "Choice",
    "Modelled",
    "Plan",
    "PlanError",
    "candidates",
    "model_candidate",
    "plan",
]
