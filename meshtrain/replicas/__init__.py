"""The data-parallel replicas and how they synchronise: communicating less.

The replicas are the devices along the replica axes (`Rules.replica_axes`: the batch axes no
parameter is split over). By default the compiler all-reduces their gradients inside the
backward pass. `SyncConfig` replaces that with a step manual over the replica axes:

- `config`: `SyncConfig` (its pairs with other features: `meshtrain.composition`);
- `codecs`: gradient compression (bf16, block-wise int8, top-k, 1-bit sign) as collectives;
- `manual`: the gradient step manual over the replica axes, with error feedback;
- `local_sgd`: local SGD and DiLoCo (replicas step alone, then synchronise parameters);
- `staleness`: bounded staleness (updates apply gradients `s` steps old);
- `step`: what ``run.sync`` changes in the train step (local SGD's whole step, or the
  gradient a synchronous update applies), on the active layout's replica sets;
- `sets`: the sync axes and each parameter's replica set (an MoE's expert weights have fewer);
- `state`: the train state's ``comm`` part and its layout (`with_sync`);
- `stack`: per-replica leaves, stacked on a dimension split over the replica axes;
- `gossip`: gossip mixing over a graph of replicas (ring, torus, exponential, complete) by
  collective permutes, and the replicas' consensus distance;
- `federated`: federated averaging's rounds (the clients a round samples, their weights by
  examples, the weighted mean of their changes);
- `needs`: what gossip needs of the layout (a graph the replicas can form), for the run check.

Gossip and federated rounds run inside `local_sgd`'s step (`SyncConfig.gossip`,
`SyncConfig.client_fraction`).
"""

from meshtrain.replicas.codecs import Codec, parse_compression
from meshtrain.replicas.config import COMPRESSIONS, OUTER_OPTIMIZERS, SyncConfig
from meshtrain.replicas.local_sgd import local_init, local_shardings, local_step, outer_optimizer
from meshtrain.replicas.manual import reduced_grads, residual_init
from meshtrain.replicas.sets import ReplicaSets, replica_sets
from meshtrain.replicas.stack import stacked, stacked_shardings
from meshtrain.replicas.staleness import delay, stale_init
from meshtrain.replicas.state import replicas, with_sync

__all__ = [
    "COMPRESSIONS",
    "OUTER_OPTIMIZERS",
    "Codec",
    "ReplicaSets",
    "SyncConfig",
    "delay",
    "local_init",
    "local_shardings",
    "local_step",
    "outer_optimizer",
    "parse_compression",
    "reduced_grads",
    "replica_sets",
    "replicas",
    "residual_init",
    "stacked",
    "stacked_shardings",
    "stale_init",
    "with_sync",
]
