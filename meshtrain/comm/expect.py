"""The collectives a layout should need, worked out from its parameters, and what does not fit.

Every parameter's layout (its logical names resolved under the rules) says what the step must
communicate. Sizes are per device, as `Collective.buffer_bytes` counts them (the whole buffer a
collective works on), with B·T the tokens of one step and N_b the batch ways:

- **gradient reduction** (all-reduce or reduce-scatter over the batch axes): every
  parameter's gradient once, at its size after the non-batch axes (tensor, pipe) split it.
  XLA may reduce-scatter or all-reduce then slice; both count the same buffer. A parameter
  sharded over some batch axes and replicated over others (HSDP) adds an all-reduce of its
  shard over the replicating axes. In a 1F1B pipeline the head's gradients are summed over
  ``pipe`` and the replica axes together. A mixture of experts' expert weights split over
  ``expert`` (a batch axis) are each device's own experts: reduced over the other batch axes
  only, never gathered. With gradient compression (``--grad-compression``)
  the reduction over the replica axes is the codec's own all-to-alls and all-gathers, each
  gradient shard counted as `Codec.buffer_bytes` says (a ZeRO-1 parameter gather over the
  same axes is counted with them).
- **parameter gathers** (all-gather over the batch axes): a parameter sharded over batch axes
  is gathered before its use in the forward and again in the backward when it lives in the
  scanned layer stack (XLA does not keep the gathered stack between the two loops); once
  otherwise. A parameter replicated while its optimizer state is sharded (ZeRO-1) is gathered
  once after the update.
- **tensor activations** (all-reduce over ``tensor``): Megatron's pattern per weight matrix
  split over ``tensor``: a row-parallel matrix (split on its input dimension, and an embedding
  table split over the vocabulary) all-reduces its output [B·T/N_b, d] in the forward; a
  column-parallel one (split on its output dimension) all-reduces the gradient of its input
  in the backward. XLA does not add the partial input gradients of sibling projections
  (q, k, v; gate, up) before reducing them, so each counts.
- **pipeline permutes** (collective-permute over ``pipe``): one microbatch activation
  [B/(m·N_b), T, d] in float32 per slot and direction in which the schedule's table sends
  something (a stage sends after every forward but the model's last chunk's, and after every
  backward but its first chunk's; `meshtrain.pipeline.slots.permute_uses`), the permutes the
  compiled program runs (the inspector counts each in the slots whose branch holds it);
- **pipeline stage sums** (all-reduce over ``pipe``): the stage outputs and their cotangent
  summed across stages in float32, 2·B·T/N_b·d·4 bytes; the hand-scheduled schedules (1f1b,
  interleaved-1f1b, zb-h1) run the head inside their loop and sum only the cotangent,
  B·T/N_b·d·4.

In a pipeline, a stage's layer weights split over batch axes are gathered inside the loop:
gpipe and circular run every tick of their forward loop and of its backward, v·m + p − 1
ticks each way, a tick gathering one chunk (1/v of the stage's weights) and reducing its
gradient; the hand-scheduled ones gather for each forward and each backward (input-gradient)
pass of a microbatch, 2m times the stage's weights, and reduce the gradient m times. With
``PipelineConfig.gather_once`` the stage's weights are gathered once per step and their
gradient reduced once (`weight_passes`).

- **expert dispatch** (all-to-all over ``expert``): a mixture of experts' dispatch buffers,
  there and back, forward and backward (4 per MoE layer, 6 under remat, which re-runs the
  forward's), at the bytes `meshtrain.costmodel.moe.dispatch_costs` models on this backend.

Anything else is reported: a collective of another kind or over other axes (an all-gather of
activations over ``tensor`` after bad propagation, an all-to-all), a bucket more than 10 %
over its expectation (naming its largest contributor), and XLA's "Involuntary full
rematerialization" warning.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
from flax import nnx

from meshtrain._units import fmt_bytes
from meshtrain.comm.report import Row, axes_label
from meshtrain.costmodel import profile
from meshtrain.costmodel.moe import dispatch_costs
from meshtrain.layout import Rules, axes_of, resolve
from meshtrain.mesh import EXPERT, PIPE, TENSOR
from meshtrain.models.moe_config import MoEConfig
from meshtrain.pipeline import PipelineConfig
from meshtrain.pipeline.schedules import HAND_SCHEDULED
from meshtrain.pipeline.slots import permute_uses
from meshtrain.replicas import Codec, gossip, parse_compression, replica_sets
from meshtrain.run import RunSpec
from meshtrain.state import abstract_model

BUCKETS = (
    "gradient reduction",
    "parameter gathers",
    "tensor activations",
    "pipeline permutes",
    "pipeline stage sums",
    "expert dispatch",
    "replica exchange",
)
TOLERANCE = 0.10  # a bucket this much over its expectation is flagged
SMALL_BYTES = 4096  # collectives below this per step (scalars: loss, norms) are not judged
_NOT_MATRICES = ("bias", "scale")  # parameter names that are vectors, not weight matrices


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One parameter: its path, shape, logical names and the mesh axes of each dimension."""

    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    axes: tuple[tuple[str, ...], ...]  # mesh axes per dimension (parameters)
    opt_axes: tuple[tuple[str, ...], ...]  # mesh axes per dimension (optimizer state)
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def split(self, axes: set[str] | tuple[str, ...], sizes: Mapping[str, int]) -> int:
        """How many ways the mesh axes in `axes` split this parameter."""
        return math.prod(sizes[a] for dim in self.axes for a in dim if a in axes)


def param_layouts(
    param_vars: nnx.State, rules: Rules, sizes: Mapping[str, int]
) -> list[ParamLayout]:
    """Every parameter of an (abstract) model with its layout under `rules` on `sizes`."""
    out = []
    for path, var in nnx.to_flat_state(param_vars):
        value = var.get_value() if hasattr(var, "get_value") else var.value
        names = tuple(var.get_metadata().get("out_sharding") or (None,) * len(value.shape))

        def per_dim(table, names=names, shape=value.shape):
            resolved = resolve(names, table, sizes, shape=shape)
            spec = tuple(resolved) + (None,) * (len(shape) - len(resolved))
            return tuple(tuple(a for a in axes_of(s) if sizes.get(a, 1) > 1) for s in spec)

        out.append(
            ParamLayout(
                path="/".join(str(p) for p in path),
                shape=tuple(value.shape),
                names=names,
                axes=per_dim(rules.params),
                opt_axes=per_dim(rules.optimizer_table),
                itemsize=value.dtype.itemsize,
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class Expectation:
    """Bytes per device per step each bucket should move, and how each was worked out."""

    bytes: dict[str, float]
    why: dict[str, str]


class Traffic(NamedTuple):
    """What the expectation reads from a run: the mesh, the batch, the widths, the codec."""

    sizes: Mapping[str, int]
    batch_axes: tuple[str, ...]
    tokens: int  # tokens (or examples) per step, B·T
    d_model: int | None = None  # the width of activations passed between pipeline stages
    act_itemsize: int = 4  # bytes per activation element (the compute dtype)
    pipeline: PipelineConfig | None = None
    batch: int | None = None  # the global batch B (for microbatch sizes in a pipeline)
    codec: Codec | None = None  # the gradient compression, when not ``none``
    replica_axes: tuple[str, ...] = ()  # the replica axes the codec reduces over
    dispatch: float = 0.0  # an MoE's dispatch all-to-all buffers over expert, per step
    own_axes: tuple[str, ...] = ()  # the replica axes, when the replicas step on their own
    exchanges: int = 0  # then: each parameter shard's collectives over them in the program

    @classmethod
    def of(cls, run: RunSpec) -> Traffic:
        """The traffic of `run` (its mesh may be axis sizes alone)."""
        run = run.resolved()
        sizes, spec, sync, rules = run.sizes, run.data_spec, run.sync, run.rules
        assert rules is not None  # resolved() fills them in
        codec = parse_compression(sync.grad_compression) if sync.compresses else None
        dtype = getattr(run.model_config, "dtype", "float32")
        return cls(
            sizes,
            rules.batch_axes(sizes),
            tokens=spec.batch_size * (spec.seq_len or 1),
            d_model=getattr(run.model, "d_model", None),
            act_itemsize=2 if dtype in ("bfloat16", "float16") else 4,
            pipeline=run.pipeline,
            batch=spec.batch_size,
            codec=codec,
            replica_axes=rules.replica_axes(sizes) if codec is not None else (),
            dispatch=_dispatch_bytes(run.model, sizes, spec.batch_size * (spec.seq_len or 1)
                                     / math.prod(sizes[a] for a in rules.batch_axes(sizes))),
            own_axes=replica_sets(rules, sizes).axes if sync.local else (),
            exchanges=exchange_instructions(sync, replica_sets(rules, sizes).axes, sizes),
        )  # fmt: skip


def expected(params: list[ParamLayout], run: RunSpec | Traffic) -> Expectation:
    """The analytic collectives of a layout (see the module docstring).

    Args:
        params: the parameters' layouts (`param_layouts`).
        run: the run (`meshtrain.run.RunSpec`; its mesh may be axis sizes alone), or its
            `Traffic` when no run is at hand.

    Returns:
        An `Expectation`.

    Raises:
        TypeError: `run` is neither a `RunSpec` nor a `Traffic`.
    """
    if isinstance(run, RunSpec):
        traffic = Traffic.of(run)
    elif isinstance(run, Traffic):
        traffic = run
    else:
        raise TypeError(
            f"expected() takes a RunSpec or a Traffic as run, not {type(run).__name__}: "
            "expected(params, RunSpec(...)) or expected(params, Traffic(sizes, batch_axes, ...))"
        )
    sizes, batch_axes, tokens, d_model, act_itemsize, pipeline, batch, codec, replica_axes = (
        traffic[:9]
    )
    own_axes = traffic.own_axes
    ways = math.prod(sizes[a] for a in batch_axes)
    model_axes = {a for a, s in sizes.items() if s > 1 and a not in batch_axes}
    b = dict.fromkeys(BUCKETS, 0.0)
    why: dict[str, str] = {}
    pipe = sizes.get(PIPE, 1)
    pc = (pipeline or PipelineConfig()) if pipe > 1 else None
    gathers, reductions = weight_passes(pc, pipe) if pc is not None else (2.0, 1.0)
    for p in params:
        # A batch axis that splits a parameter's experts gives each device its own experts:
        # it is a model axis for that parameter (nothing gathered, nothing reduced over it).
        owned = _expert_axes(p)
        local = p.nbytes / p.split(model_axes | owned, sizes)
        sharded = {a for dim in p.axes for a in dim if a in batch_axes} - owned
        opt_sharded = {a for dim in p.opt_axes for a in dim if a in batch_axes} - owned
        reducing = [a for a in batch_axes if a not in owned]
        if own_axes:
            # The replicas step apart: no gradient crosses them; each parameter shard goes
            # through the exchange's collectives over them (a split over the other batch axes,
            # hsdp's fsdp, still reduces its gradient inside each replica).
            shard = local / p.split(sharded - set(own_axes), sizes)
            b["replica exchange"] += traffic.exchanges * shard
            if sharded - set(own_axes):
                b["gradient reduction"] += local
        elif codec is not None:
            # Compressed: the codec's exchange of each shard over the replica axes, and the
            # compiler's reduction over any batch axis that splits the parameter (hsdp's fsdp).
            rest = {a for a, n in sizes.items() if n > 1 and a not in replica_axes}
            shard = math.prod(p.shape) // p.split(rest, sizes)
            replicas = math.prod(sizes[a] for a in replica_axes)
            b["gradient reduction"] += codec.buffer_bytes(shard, replicas)
            if sharded:
                b["gradient reduction"] += local
        elif reducing:
            # A pipeline stage's split weights reduce their gradient inside the loop.
            staged = pc is not None and sharded and "layers" in p.names
            b["gradient reduction"] += local * (reductions if staged else 1)
            if sharded and set(reducing) - sharded:
                b["gradient reduction"] += local / p.split(sharded, sizes)
        if sharded - set(own_axes):
            b["parameter gathers"] += local * (gathers if "layers" in p.names else 1)
        elif opt_sharded and not own_axes:
            # ZeRO-1's gather after the update; with a codec it runs over the replica axes
            # like the codec's own gathers, and is counted with them.
            b["gradient reduction" if codec is not None else "parameter gathers"] += local
        if sizes.get(TENSOR, 1) > 1 and p.path.rsplit("/", 1)[-1] not in _NOT_MATRICES:
            b["tensor activations"] += _tensor_bytes(p, tokens / ways, act_itemsize)
    why["gradient reduction"] = (
        f"each gradient shard through the {codec.spec} codec over the replica axes"
        if codec is not None
        else "each gradient once at its model-parallel size (+ HSDP shard)"
    )
    why["parameter gathers"] = (
        "batch-sharded weights: forward + backward for stacked layers"
        if pc is None
        else f"batch-sharded weights: a stage's {gathers:g}× per step ({_passes_why(pc)})"
    )
    why["tensor activations"] = "forward AR per row-parallel, backward AR per column-parallel"
    if own_axes:
        why["replica exchange"] = (
            f"each parameter shard in {traffic.exchanges} collectives over the replica axes "
            "(gossip's permutes, each counted once; the mean's all-reduce, run every H steps)"
        )
    if pc is not None and d_model and batch:
        m = pc.num_microbatches(pipe)
        sends = pipeline_permutes(pc, pipe)
        seq = tokens // batch
        micro = batch / (m * ways) * seq * d_model * 4
        b["pipeline permutes"] = sends * micro
        # gpipe and circular sum the last stage's outputs and the first stage's input
        # cotangents over pipe; the hand-scheduled ones run the head inside the loop and sum
        # only the latter.
        sums = 1 if pc.schedule in HAND_SCHEDULED else 2
        b["pipeline stage sums"] = sums * tokens / ways * d_model * 4
        why["pipeline permutes"] = (
            f"{sends} microbatch activations of {fmt_bytes(micro)}: the {pc.schedule} "
            "table's slots that send one, each way"
        )
        why["pipeline stage sums"] = (
            "input cotangents summed over pipe (f32)"
            if sums == 1
            else "stage outputs and cotangents summed over pipe (f32)"
        )
    if traffic.dispatch:
        b["expert dispatch"] = traffic.dispatch
        why["expert dispatch"] = "the MoE dispatch's buffers, there and back, forward and backward"
    return Expectation(b, why)


def exchange_instructions(sync, replica_axes: tuple[str, ...], sizes: Mapping[str, int]) -> int:
    """The collectives over the replica axes each parameter shard goes through in the compiled
    step when the replicas step on their own (0 when they do not): the mean's all-reduce, and
    under gossip one permute per neighbour, every peer of the exponential graph's period
    counted (each sits in its own branch of a switch)."""
    if not sync.local:
        return 0
    if not sync.gossips:
        return 1
    replicas = {a: sizes[a] for a in replica_axes}
    steps = range(gossip.period(sync.gossip, replicas))
    shifts = {(t.axes, t.by) for k in steps for t in gossip.terms(sync.gossip, replicas, k) if t.by}
    return 1 + len(shifts)


def pipeline_permutes(pipeline: PipelineConfig, pipe: int) -> int:
    """Collective-permutes a pipeline runs per step under `pipeline` on `pipe` stages.

    Args:
        pipeline: the pipeline settings (schedule, microbatches, chunks per stage).
        pipe: stages.

    Returns:
        One per slot (tick) and direction in which some stage sends a microbatch activation
        (forward) or cotangent (backward), as the schedule's table says
        (`meshtrain.pipeline.slots.permute_uses`); every device waits for each of them, and
        none sends more than one payload in it.
    """
    m, v = pipeline.num_microbatches(pipe), pipeline.chunks_per_stage()
    return _permutes(pipeline.schedule, pipe, m, v)


@functools.lru_cache(maxsize=256)
def _permutes(schedule: str, p: int, m: int, v: int) -> int:
    """`pipeline_permutes` of (schedule, p, m, v), kept."""
    config = PipelineConfig(schedule=schedule, microbatches=m, repeats=v)
    return sum(permute_uses(config, p)[0].values())


def weight_passes(pipeline: PipelineConfig, pipe: int) -> tuple[float, float]:
    """How many times per step a pipeline stage gathers its weights split over batch axes,
    and how many times it reduces their gradient, in units of the stage's whole weights.

    Args:
        pipeline: the pipeline settings.
        pipe: stages (> 1).

    Returns:
        ``(gathers, reductions)``: (1, 1) with ``gather_once``; (2m, m) for the
        hand-scheduled schedules (each microbatch's forward and backward gather, its
        backward reduces); 2(v·m + p − 1)/v and (v·m + p − 1)/v for gpipe and circular
        (every tick of the forward loop and of its backward runs one chunk, 1/v of the stage).
    """
    if pipeline.gather_once:
        return 1.0, 1.0
    m, v = pipeline.num_microbatches(pipe), pipeline.chunks_per_stage()
    if pipeline.schedule in HAND_SCHEDULED:
        return 2.0 * m, float(m)
    ticks = (v * m + pipe - 1) / v
    return 2.0 * ticks, ticks


def _passes_why(pc: PipelineConfig) -> str:
    """Why a stage gathers its weights as often as `weight_passes` says."""
    if pc.gather_once:
        return "gathered once per step, kept for every microbatch"
    if pc.schedule in HAND_SCHEDULED:
        return "each microbatch's forward and backward"
    return "every tick of the forward loop and of its backward"


def stage_weight_bytes(model, mesh, rules: Rules) -> float:
    """`stage_gathered_bytes` of a model config's parameters on a mesh, from its abstract
    model (nothing is allocated).

    Args:
        model: a model config (its ``build(rngs=...)`` makes the model).
        mesh: the mesh.
        rules: the layout rules.
    """
    graphdef, abstract = abstract_model(lambda: model.build(rngs=nnx.Rngs(0)))
    params = nnx.split(nnx.merge(graphdef, abstract), nnx.Param, ...)[1]
    sizes = dict(mesh.shape)
    layouts = param_layouts(params, rules, sizes)
    return stage_gathered_bytes(layouts, sizes, rules.batch_axes(sizes))


def stage_gathered_bytes(
    params: list[ParamLayout], sizes: Mapping[str, int], batch_axes: tuple[str, ...]
) -> float:
    """Bytes per device of a pipeline stage's layer weights that batch axes split, at their
    size after those axes gather them: what ``gather_once`` keeps whole for the step.

    Args:
        params: the parameters' layouts.
        sizes: mesh axis sizes.
        batch_axes: the batch axes.

    Returns:
        Σ over the stacked layers' weights split over a batch axis (an expert axis's own
        experts aside) of their bytes split by the model axes (pipe, tensor) alone.
    """
    model_axes = {a for a, s in sizes.items() if s > 1 and a not in batch_axes}
    total = 0.0
    for p in params:
        owned = _expert_axes(p)
        sharded = {a for dim in p.axes for a in dim if a in batch_axes} - owned
        if sharded and "layers" in p.names:
            total += p.nbytes / p.split(model_axes | owned, sizes)
    return total


def _dispatch_bytes(model, sizes: Mapping[str, int], tokens_local: float) -> float:
    """The all-to-all buffer bytes per device and step of an MoE's dispatch over ``expert``,
    as the planner models them (`meshtrain.costmodel.moe.dispatch_costs`, on this backend); 0 for
    other models or without an expert axis."""
    shards = sizes.get(EXPERT, 1)
    if not isinstance(model, MoEConfig) or shards == 1:
        return 0.0
    device = profile("h100" if jax.default_backend() == "gpu" else "cpu-sim")
    cost = dispatch_costs(model, tokens=tokens_local, shards=shards, device=device)
    exchanges = 4 if model.remat == "none" else 6  # remat re-runs the forward's two
    return cost.buffer_bytes * exchanges * model.n_moe_layers / sizes.get(PIPE, 1)


def _expert_axes(p: ParamLayout) -> set[str]:
    """The mesh axes that split `p`'s ``expert`` dimension."""
    return {a for name, dim in zip(p.names, p.axes, strict=False) if name == "expert" for a in dim}


def _tensor_bytes(p: ParamLayout, tokens_local: float, itemsize: int) -> float:
    """Activation all-reduce bytes the matrix `p` needs under tensor parallelism."""
    dims = [i for i, n in enumerate(p.names) if n != "layers"]
    if len(dims) < 2 or not any(TENSOR in p.axes[i] for i in dims):
        return 0.0
    layers = math.prod(p.shape[i] for i, n in enumerate(p.names) if n == "layers")
    first = dims[0]
    if TENSOR in p.axes[first]:  # row-parallel (or a vocab-split embedding): output reduced
        width = p.shape[dims[-1]]
    else:  # column-parallel: input gradient reduced
        width = p.shape[first]
    return layers * tokens_local * width * itemsize


def bucket_of(
    row: Row,
    batch_axes: tuple[str, ...],
    compressed_axes: tuple[str, ...] = (),
    own_axes: tuple[str, ...] = (),
) -> str | None:
    """The expected bucket a summary row belongs to, or None when no layout should need it.
    With gradient compression over `compressed_axes`, the codec's all-to-alls and all-gathers
    over those axes are the gradient reduction; when the replicas step on their own over
    `own_axes`, the permutes and all-reduces over those axes are their exchange."""
    axes = row.axes
    if axes is None:
        return None
    on_batch = bool(axes) and set(axes) <= set(batch_axes)
    if own_axes and row.kind in ("collective-permute", "all-reduce") and axes:
        if set(axes) <= set(own_axes):
            return "replica exchange"
    if compressed_axes and row.kind in ("all-to-all", "all-gather") and axes:
        if set(axes) <= set(compressed_axes):
            return "gradient reduction"
    if row.kind in ("all-reduce", "reduce-scatter") and on_batch:
        return "gradient reduction"
    if row.kind == "all-gather" and on_batch:
        return "parameter gathers"
    if row.kind == "all-reduce" and axes == (TENSOR,):
        return "tensor activations"
    if row.kind == "collective-permute" and axes == (PIPE,):
        return "pipeline permutes"
    if row.kind == "all-reduce" and axes == (PIPE,):
        return "pipeline stage sums"
    if row.kind == "all-to-all" and axes == (EXPERT,):
        return "expert dispatch"
    if row.kind == "all-reduce" and axes[:1] == (PIPE,) and set(axes[1:]) <= set(batch_axes):
        return "gradient reduction"  # 1F1B sums the head's gradients over stages and replicas
    return None


def judge(
    rows: list[Row],
    expectation: Expectation,
    batch_axes: tuple[str, ...],
    largest: Mapping,
    compressed_axes: tuple[str, ...] = (),
    own_axes: tuple[str, ...] = (),
) -> tuple[dict[str, float], list[str]]:
    """Measured bytes per bucket and the flags: unexpected collectives and overshoots.

    Args:
        rows: the summary rows (`summarize`).
        expectation: the analytic expectation.
        batch_axes: the batch axes.
        largest: per bucket, a description of its largest contributor (for the flag).
        compressed_axes: the replica axes a gradient codec reduces over (see `bucket_of`).
        own_axes: the replica axes, when the replicas step on their own (see `bucket_of`).

    Returns:
        ``(measured, flags)``.
    """
    measured = dict.fromkeys(BUCKETS, 0.0)
    flags = []
    for row in rows:
        bucket = bucket_of(row, batch_axes, compressed_axes, own_axes)
        if bucket is None:
            if row.bytes >= SMALL_BYTES:
                flags.append(
                    f"unexpected {row.kind} over {axes_label(row.axes)}: {row.count}× per step, "
                    f"{fmt_bytes(row.bytes)}; no layout rule needs it"
                    + (
                        " (activations gathered: a constraint or propagation went wrong)"
                        if row.kind == "all-gather"
                        else ""
                    )
                )
            continue
        measured[bucket] += row.bytes
    for bucket in BUCKETS:
        want, got = expectation.bytes[bucket], measured[bucket]
        if got > want * (1 + TOLERANCE) and got - want >= SMALL_BYTES:
            ratio = f"{got / want:.2f}× the expected" if want else "none expected, got"
            flags.append(
                f"{bucket}: {fmt_bytes(got)}, {ratio} {fmt_bytes(want)}"
                + (f"; largest: {largest[bucket]}" if bucket in largest else "")
            )
    return measured, flags
