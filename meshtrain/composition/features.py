"""The features of the composition matrix, as data: each group's ids with a line on what each
is, and the sets of features one run has at most one of.

The refusal rows (`meshtrain.composition.rules`) name their cells through the families here
(`PIPELINES`, `CONTEXT`, ...), so a feature added to a group reaches every row that names it.
"""

from __future__ import annotations

__all__ = ["CONTEXT", "EXCLUSIVE", "FEATURES", "GROUPS", "LOCAL", "MOE", "PIPELINES"]

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

# The families of ids the refusal rows name together.
PIPELINES: tuple[str, ...] = tuple(GROUPS["pipeline schedule"])
CONTEXT: tuple[str, ...] = tuple(GROUPS["context parallelism"])
MOE: tuple[str, ...] = tuple(GROUPS["MoE dispatch"])
LOCAL: tuple[str, ...] = ("local-sgd", "diloco", "gossip", "federated")  # replicas step alone

# Sets of features a run has at most one of: their pairs are not cells.
EXCLUSIVE: tuple[frozenset[str], ...] = (
    frozenset({"dp", "fsdp", "hsdp", "zero1"}),  # one data strategy (tp goes with each)
    frozenset(PIPELINES),  # one schedule
    frozenset(CONTEXT),  # one algorithm
    frozenset(MOE),  # one dispatch
    frozenset(GROUPS["kernels"]),  # one attention implementation
    # DiLoCo is local SGD with an outer optimizer; gossip and federated rounds replace its sync
    frozenset(LOCAL),
    frozenset(GROUPS["precision"]),  # one precision policy
    frozenset({"remat", "offload-activations"}),  # one remat policy
)
