"""What the refusal rows read off a run: whether it has a feature (``run → bool``) and the
value a row shows (``run → value``), each named, so the rows
(`meshtrain.composition.rules`) are data that point at them."""

from __future__ import annotations

import operator
from collections.abc import Callable

from meshtrain.layout import alternatives, axes_of, rules_for
from meshtrain.mesh import EXPERT, PIPE, TENSOR
from meshtrain.pipeline.schedules import HAND_SCHEDULED
from meshtrain.run import RunSpec

Check = Callable[[RunSpec], bool]
Value = Callable[[RunSpec], object]


def axis(run: RunSpec, name: str) -> int:
    """The size of mesh axis `name` (1 when the mesh lacks it)."""
    return run.sizes.get(name, 1)


def split(name: str) -> Check:
    """``run → axis name > 1``: the run splits over mesh axis `name`."""
    return lambda run: axis(run, name) > 1


def all_of(*checks: Check) -> Check:
    """``run → every one of checks(run)``."""
    return lambda run: all(check(run) for check in checks)


def mesh_value(name: str) -> Value:
    """``run → size of axis name``, the value a mesh row shows."""
    return lambda run: axis(run, name)


def model_value(field: str) -> Value:
    """``run → the model config's field``, the value a model row shows."""
    return lambda run: getattr(run.model, field)


def cudnn(run: RunSpec) -> bool:
    """The model's attention is cuDNN's fused attention."""
    return getattr(run.model, "attention_impl", None) == "cudnn"


def cudnn_name(run: RunSpec) -> str:
    """The value a cuDNN row shows: the attention implementation's name."""
    return "cudnn"


def packed(run: RunSpec) -> bool:
    """Whether the batches carry segment ids (packed documents)."""
    return run.data_spec.packed


def without_sequences(run: RunSpec) -> bool:
    """The data is no token sequences (not ``lm``: ``classify``, ``image``)."""
    return run.data_spec.kind != "lm"


def no_experts(run: RunSpec) -> bool:
    """The model has no experts to split over the expert axis."""
    return EXPERT not in getattr(run.model, "supported_axes", ())


def no_context(run: RunSpec) -> bool:
    """The model declares it cannot split its sequences (``context_parallel = False``)."""
    return getattr(run.model, "context_parallel", True) is False


def router_bias(run: RunSpec) -> bool:
    """The model balances its experts with a bias updated after each step (an MoE's
    ``bias_update_rate > 0``)."""
    return getattr(run.model, "bias_update_rate", 0) > 0


def compresses(run: RunSpec) -> bool:
    """Gradient compression is on."""
    return run.sync.compresses


def local(run: RunSpec) -> bool:
    """The replicas step on their own: local SGD, DiLoCo, gossip or federated averaging."""
    return run.sync.local


def own_step(run: RunSpec) -> bool:
    """The replicas run their own step: gradient compression or `local`."""
    return compresses(run) or local(run)


def plain_local(run: RunSpec) -> bool:
    """Local SGD or DiLoCo (the replicas restart from one average at every sync)."""
    return run.sync.local and not (run.sync.gossips or run.sync.federates)


def gossips(run: RunSpec) -> bool:
    """Gossip averaging is on."""
    return run.sync.gossips


def federates(run: RunSpec) -> bool:
    """Federated averaging is on."""
    return run.sync.federates


def no_sync_every(run: RunSpec) -> bool:
    """No ``--sync-every``."""
    return run.sync.sync_every is None


def synchronous(run: RunSpec) -> bool:
    """The replicas step together (none of `local`)."""
    return not local(run)


def outer_optimizer(run: RunSpec) -> bool:
    """An outer optimizer other than plain averaging is set."""
    return run.sync.outer_optimizer != "average"


def stale(run: RunSpec) -> bool:
    """Bounded staleness is on."""
    return bool(run.sync.staleness)


def loss_scaling(run: RunSpec) -> bool:
    """float16's dynamic loss scale is on."""
    return run.loss_scaling


def several_chunks(run: RunSpec) -> bool:
    """A pipeline whose stages hold several chunks of layers (circular, interleaved-1f1b)."""
    return axis(run, PIPE) > 1 and run.pipeline.chunks_per_stage() > 1


def no_replicas(run: RunSpec) -> bool:
    """The rules split the parameters over every batch axis (e.g. fsdp): no replicas."""
    rules = run.rules or rules_for("auto", run.sizes)
    return not rules.replica_axes(run.sizes)


def fsdp_and_tensor(run: RunSpec) -> bool:
    """The rules split the parameters over both fsdp and tensor (hsdp+tp on fsdp, tensor > 1)."""
    rules = run.rules or rules_for("auto", run.sizes)
    named = {a for e in rules.params.values() for o in alternatives(e) for a in axes_of(o)}
    on = {a for a in ("fsdp", "tensor") if axis(run, a) > 1 and a in named}
    return on == {"fsdp", "tensor"} and bool(rules.replica_axes(run.sizes))


def batch_split_with_parameters(run: RunSpec) -> bool:
    """An axis that splits the parameters splits the batch too (fsdp under hsdp): inside the
    replicas' own step it stays with the compiler and splits each replica's rows."""
    rules = run.rules or rules_for("auto", run.sizes)
    inside = set(rules.batch_axes(run.sizes)) - set(rules.replica_axes(run.sizes)) - {EXPERT}
    return bool(inside)


def gathers_tokens(run: RunSpec) -> bool:
    """The step gathers tokens along the sequence: packed documents' ids (reordered with the
    tokens), a mixture of experts' dispatch."""
    return packed(run) or not no_experts(run)


def clips(run: RunSpec) -> bool:
    """Global-norm clipping is on."""
    return run.optim.clip_norm > 0


def context_algorithm(*names: str) -> Check:
    """``run → its context parallelism's algorithm is one of names`` (ring by default)."""
    return lambda run: getattr(run.rules, "context_parallel", "ring") in names


def sliding_window(run: RunSpec) -> bool:
    """The model's attention has a sliding window."""
    return bool(getattr(run.model, "sliding_window", 0))


def float32_compute(run: RunSpec) -> bool:
    """The model computes in float32 (the fp32 policy, or a model config left at float32)."""
    return run.precision.resolved(run.model) == "fp32"


def fp16_kernels(run: RunSpec) -> bool:
    """float16 compute with a hand-written kernel (pallas, cudnn) in attention or norms."""
    names = {str(getattr(run.model, f, "")) for f in ("attention_impl", "norm_impl")}
    return run.precision.resolved(run.model) == "fp16" and bool(names & {"pallas", "cudnn"})


def hand_scheduled(run: RunSpec) -> bool:
    """A pipeline under a hand-scheduled schedule (1f1b, interleaved-1f1b, zb-h1)."""
    return axis(run, PIPE) > 1 and run.pipeline.schedule in HAND_SCHEDULED


def compiler_axes_in_stage(run: RunSpec) -> bool:
    """A pipeline stage keeps an axis the compiler partitions inside it: tensor, or a batch
    axis that splits the parameters (fsdp) when the stage weights are not gathered once."""
    if axis(run, TENSOR) > 1:
        return True
    if run.pipeline.gather_once:
        return False
    rules = run.rules or rules_for("auto", run.sizes)
    replicas = set(rules.replica_axes(run.sizes))
    return any(a not in replicas and a != EXPERT for a in rules.batch_axes(run.sizes))


def custom_loss(run: RunSpec) -> bool:
    """A custom ``loss_fn`` replaces the built-in loss."""
    return run.loss_fn is not None


def loss_kernel(run: RunSpec) -> bool:
    """The loss runs through a kernel (``train.loss_impl`` other than xla)."""
    return run.train.loss_impl != "xla"


def builtin_loss(run: RunSpec) -> bool:
    """A built-in loss other than the default cross entropy is chosen."""
    return run.train.loss != "cross_entropy"


def strategy(run: RunSpec) -> str:
    """The name of the run's layout rules."""
    return (run.rules or rules_for("auto", run.sizes)).name


def setting(path: str) -> Value:
    """The run's setting at a dotted path (``"sync.gossip"``): the value a row shows."""
    return operator.attrgetter(path)
