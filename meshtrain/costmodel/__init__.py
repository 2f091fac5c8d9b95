"""The α-β cost model: device and link profiles, collective costs per algorithm, a roofline
step-time estimate with a stated overlap assumption, what a pipeline schedule costs in
lockstep, what offload's host transfers cost, and what the replicas exchange when they step
apart (gossip, the mean every H steps)."""

from meshtrain.costmodel.collectives import (
    ALGORITHMS,
    flat_cost,
    hierarchical_all_reduce,
    hierarchical_cost,
    rabenseifner_all_reduce,
    recursive_doubling_all_reduce,
    ring_all_reduce,
    tree_all_reduce,
)
from meshtrain.costmodel.exchange import ReplicaExchange, ideal_round_bytes
from meshtrain.costmodel.host import HostTransfer, exposed_time, transfer_time
from meshtrain.costmodel.pipeline import (
    held_microbatches,
    lockstep_bubble,
    lockstep_time,
    pass_costs,
)
from meshtrain.costmodel.profiles import PROFILES, DeviceProfile, Link, profile
from meshtrain.costmodel.step import CommItem, StepEstimate, collective_time, placement, step_time

__all__ = [
    "ALGORITHMS",
    "PROFILES",
    "CommItem",
    "DeviceProfile",
    "HostTransfer",
    "Link",
    "ReplicaExchange",
    "StepEstimate",
    "collective_time",
    "exposed_time",
    "flat_cost",
    "held_microbatches",
    "hierarchical_all_reduce",
    "hierarchical_cost",
    "ideal_round_bytes",
    "lockstep_bubble",
    "lockstep_time",
    "pass_costs",
    "placement",
    "profile",
    "rabenseifner_all_reduce",
    "recursive_doubling_all_reduce",
    "ring_all_reduce",
    "step_time",
    "transfer_time",
    "tree_all_reduce",
]
