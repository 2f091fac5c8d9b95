"""What the replicas' own exchange costs per step, when they step apart: gossip's permutes of
the parameters to its neighbours every step, and the all-reduce that forms their mean every H
steps (local SGD's and DiLoCo's synchronisation, gossip's model, a federated round's server
step).

Both are `meshtrain.costmodel.CommItem`s of the bucket ``"replica exchange"``, so
`step_time` prices them with the α-β model like any other collective; the mean's all-reduce
runs on one step in H and counts 1/H per step. Nothing here knows a topology: the caller
gives the permutes per step (`meshtrain.replicas.gossip.sent_per_step`).

Federated averaging's all-reduce takes every replica (the unsampled ones add zeros), so its
bytes are a full exchange; `ideal_round_bytes` is what only the sampled clients would send.
"""

from __future__ import annotations

import dataclasses

from meshtrain.costmodel.step import CommItem

BUCKET = "replica exchange"


@dataclasses.dataclass(frozen=True)
class ReplicaExchange:
    """One device's exchange with the other replicas, per step.

    Args:
        axes: the replica axes.
        replicas: how many replicas (the product of the axes' sizes).
        param_bytes: the parameter bytes one device holds and sends (its shard).
        peers: collective permutes of those bytes every step (gossip; 0 otherwise).
        sync_every: H, the steps between two means (1: every step).
    """

    axes: tuple[str, ...]
    replicas: int
    param_bytes: float
    peers: int = 0
    sync_every: int = 1

    def items(self) -> list[CommItem]:
        """The permutes and the mean's all-reduce as `CommItem`s (the all-reduce at 1/H)."""
        out = []
        if self.peers:
            out.append(
                CommItem(BUCKET, "collective-permute", self.axes, self.param_bytes, self.peers)
            )
        out.append(CommItem(BUCKET, "all-reduce", self.axes, self.param_bytes, 1 / self.sync_every))
        return out

    def sent_per_step(self) -> float:
        """Bytes one device sends per step: each permute whole, the all-reduce's bandwidth-
        optimal 2(n − 1)/n of the buffer, 1/H of it."""
        n = self.replicas
        mean = 2 * (n - 1) / n * self.param_bytes if n > 1 else 0.0
        return self.peers * self.param_bytes + mean / self.sync_every


def ideal_round_bytes(param_bytes: float, replicas: int, fraction: float) -> float:
    """The bytes one federated round would move per device if only its sampled clients sent:
    the `fraction` of the all-reduce's bandwidth-optimal 2(n − 1)/n of the parameters."""
    return fraction * 2 * (replicas - 1) / replicas * param_bytes
