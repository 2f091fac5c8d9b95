"""The replicas' own exchange in a compiled step, per step, beside the α-β model's.

When the replicas step on their own (local SGD, DiLoCo, gossip, federated averaging), what they
send each other is not a gradient all-reduce every step: gossip's permutes run every step (the
exponential graph's sit in a switch, one branch a step), and the mean's all-reduce sits in a
conditional branch that runs on one step in H. The inspector counts each instruction of the
program once; `replica_exchange` weighs each by the share of steps that run it, and puts the
cost model's figures beside it (`meshtrain.costmodel.ReplicaExchange`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from meshtrain._units import fmt_bytes
from meshtrain.comm.axes import axes_of_groups
from meshtrain.comm.expect import ParamLayout
from meshtrain.comm.hlo import Collective
from meshtrain.costmodel import ReplicaExchange, ideal_round_bytes, profile, step_time
from meshtrain.costmodel.exchange import BUCKET
from meshtrain.layout import Rules
from meshtrain.replicas import SyncConfig, gossip, replica_sets
from meshtrain.run import RunSpec

DEVICE = "h100"  # the profile the modelled time is given on


def replica_exchange(cs: list[Collective], run: RunSpec, params: list[ParamLayout]) -> dict:
    """Bytes one device sends the other replicas per step, compiled and modelled.

    Args:
        cs: the compiled step's collectives.
        run: the run (resolved; its ``sync`` steps the replicas apart).
        params: the parameters' layouts.

    Returns:
        ``compiled_bytes`` (each collective over the replica axes, sent as a bandwidth-optimal
        algorithm sends it, at the share of steps that run it), ``modelled_bytes`` and
        ``modelled_s`` (`meshtrain.costmodel.ReplicaExchange` on the ``device`` profile),
        ``sync_every``, ``permutes_per_step``, and under federated averaging ``ideal_bytes``.
    """
    sizes, sync = run.sizes, run.sync
    model = exchange_model(sync, run.rules, sizes, params)
    h = model.sync_every
    replicas = {a: sizes[a] for a in model.axes}
    period = gossip.period(sync.gossip, replicas) if sync.gossips else 1
    compiled = 0.0
    for c in cs:
        over = axes_of_groups(c.groups, sizes, permute=c.kind == "collective-permute")
        if not over or not set(over) <= set(model.axes):
            continue
        sent = c.count * c.wire_bytes
        if c.kind == "collective-permute":
            compiled += sent / period if c.conditional else sent
        elif c.kind == "all-reduce":
            compiled += sent / h if c.conditional else sent
    device = profile(DEVICE)
    est = step_time(flops=0.0, hbm_bytes=0.0, comm=model.items(), sizes=sizes, device=device)
    out = {
        "compiled_bytes": round(compiled),
        "modelled_bytes": round(model.sent_per_step()),
        "modelled_s": est.comm_s.get(BUCKET, 0.0),
        "device": DEVICE,
        "sync_every": h,
        "permutes_per_step": model.peers,
    }
    if sync.federates:
        ideal = ideal_round_bytes(model.param_bytes, model.replicas, sync.client_fraction)
        out["ideal_bytes"] = round(ideal / h)
    return out


def exchange_model(
    sync: SyncConfig, rules: Rules, sizes: Mapping[str, int], params: list[ParamLayout]
) -> ReplicaExchange:
    """The cost model's view of the replicas' exchange under `sync` on a layout: over the sync
    axes, of the parameter shard each device holds (split by every other axis, and by an
    MoE's ``expert`` for the expert weights), with gossip's permutes per step."""
    sets = replica_sets(rules, sizes)
    kept = set(sizes) - (set(sets.axes) - set(sets.split))  # the axes a device's shard is split by
    shard = sum(p.nbytes / p.split(kept, sizes) for p in params)
    replicas = {a: sizes[a] for a in sets.axes}
    peers = gossip.sent_per_step(sync.gossip, replicas) if sync.gossips else 0
    h = sync.sync_every or 1
    return ReplicaExchange(sets.axes, math.prod(replicas.values()), shard, peers, h)


def exchange_line(exchange: dict) -> str:
    """One line saying what the replicas send each other per step."""
    line = (
        f"replica exchange per step: {fmt_bytes(exchange['compiled_bytes'])} sent (compiled), "
        f"{fmt_bytes(exchange['modelled_bytes'])} modelled, "
        f"{exchange['modelled_s'] * 1e6:.0f} µs on {exchange['device']} (α-β)"
    )
    if exchange.get("permutes_per_step"):
        line += f" · {exchange['permutes_per_step']} permutes of the parameters every step"
    line += f" · the mean every {exchange['sync_every']} steps"
    if "ideal_bytes" in exchange:
        line += (
            f" · federated: every replica takes part in the round's all-reduce (the unsampled "
            f"add zeros); only the sampled clients sending would be "
            f"{fmt_bytes(exchange['ideal_bytes'])}"
        )
    return line
