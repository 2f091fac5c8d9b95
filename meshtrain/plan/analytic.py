"""The analytic model of one candidate: memory per device, communication, modelled step time.

Memory per device, in bytes:
- parameters, gradients (float32, at the parameter's layout) and optimizer moments (float32,
  at the optimizer's layout; two for adamw and lamb, one for lars and sgd);
- activations kept for the backward, per layer and token (Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models", 2022, §4: 34·D + 5·H·T bytes per
  token in 16-bit without recomputation, tensor parallelism dividing all but 10·D of it):
  scaled by the element size / 2; ``full`` remat keeps only each layer's input (2·D per token
  in 16-bit); ``save-dots`` keeps the matmul outputs, taken as half of no remat;
- the logits and their gradient in float32 (B·T/N_b · V/tensor · 8);
- a pipeline stage holds L/p layers and keeps the activations of as many microbatches as
  `meshtrain.costmodel.held_microbatches` reads from the schedule's table (gpipe m, 1f1b p,
  interleaved-1f1b its in-flight chunks / v). zb-h1 also keeps, for each microbatch between
  its input gradient (BWD) and its weight gradient (WGT), what the weight gradient reads (the
  layers' inputs and output gradients); the table counts those microbatches as in flight,
  and they are modelled at the same bytes per token as the others: an upper bound, simple;
- with ``gather_once``, the stage's layer weights that batch axes split, whole (at their size
  after pipe and tensor split them), and their gradient: 2 × `stage_gathered_bytes`.

Offload (host memory, `meshtrain.costmodel.host`):
- ``offload-dots`` moves the residuals ``save-dots`` would keep to host in the forward and back
  in the backward: the device keeps each layer's input, as with ``full``; host memory holds
  the save-dots activations; the FLOPs and device traffic are save-dots'. The writes run
  beside the forward's compute and the fetches beside the backward's; what exceeds them is
  exposed. One transfer per layer and microbatch each way (α each).
- With the optimizer state on host (``Candidate.offload``), the moments are fetched for the
  update, after the backward has freed its activations, and written back after it: device
  memory counts the larger of the moments and the activations with the logits, host memory
  the moments, and both transfers are exposed (one per leaf each way).
- Host memory per device must hold both (`DeviceProfile.host_memory`).
- Asked to price replicas that step apart (local SGD, gossip, federated averaging: a
  `SyncConfig`), no gradient crosses the replica axes; their exchange is
  `meshtrain.comm.exchange.exchange_model`'s (gossip's permutes every step, the mean's
  all-reduce at 1/H), and each device holds its replica's own parameters beside θ̄ and the
  outer optimizer's moments ("replica state").

Device-memory traffic: weights read in the forward and backward and written once (3×), the
optimizer moments read and written (2×), the activations without remat written and read
once (half again for ``save-dots``, which re-runs the elementwise ops), and the logits.
Full remat re-runs the forward: 4/3 of the FLOPs.

Communication comes from `meshtrain.comm.expect` (the same expectation the inspector checks
compiled programs against) and is timed with `meshtrain.costmodel`. In a pipeline a stage
gathers its batch-split weights and reduces their gradient inside its loop, per microbatch
(per tick for gpipe), unless ``gather_once`` does it once per step (`weight_passes`).

The pipeline bubble is `meshtrain.costmodel.lockstep_bubble`: every stage runs the same
program slot by slot, so a slot lasts its slowest stage's pass (1f1b's slots that pair a
forward with another stage's backward cost a backward).

A mixture of experts (`MoEConfig`) is modelled per dispatch (`meshtrain.costmodel.moe`): its
expert weights split over ``expert`` as the rules say, its blocks' feed-forward activations
replaced by the dispatch's buffers, its expert FLOPs at the dispatch's factor over the active
ones, and the dispatch all-to-alls over ``expert`` on the critical path (4 per MoE layer, 6
when remat re-runs the forward).
"""

from __future__ import annotations

import dataclasses
import math

from meshtrain.comm.exchange import exchange_model
from meshtrain.comm.expect import (
    ParamLayout,
    Traffic,
    expected,
    pipeline_permutes,
    stage_gathered_bytes,
    weight_passes,
)
from meshtrain.costmodel import (
    CommItem,
    DeviceProfile,
    HostTransfer,
    StepEstimate,
    held_microbatches,
    lockstep_bubble,
    step_time,
)
from meshtrain.costmodel.host import FORWARD_SHARE
from meshtrain.costmodel.moe import MoEStep, dispatch_costs
from meshtrain.layout import rules_for
from meshtrain.mesh import EXPERT, PIPE, TENSOR
from meshtrain.models.moe_config import MoEConfig
from meshtrain.plan.space import OFFLOAD_REMATS, Candidate, pipeline_config
from meshtrain.replicas import SyncConfig, replica_sets

MOMENTS = {"adamw": 2, "lamb": 2, "lars": 1, "sgd": 1}
OUTER_MOMENTS = {"average": 0, "nesterov": 1, "adam": 2}  # the outer optimizer's, per parameter
REMAT_ACTIVATION = {"none": 1.0, "save-dots": 0.5}
MOE_BUCKET = "expert all-to-all"


@dataclasses.dataclass(frozen=True)
class Modelled:
    """A candidate with its modelled memory (bytes per device) and step."""

    candidate: Candidate
    memory: dict[str, float]
    estimate: StepEstimate
    flops_per_device: float
    moe: MoEStep | None = None
    gather_once_bytes: float = 0.0  # what gather-once costs (or would cost) per device
    host: dict[str, float] = dataclasses.field(default_factory=dict)  # host bytes per device

    @property
    def peak(self) -> float:
        """Modelled bytes per device: all parts together; with the optimizer state on host,
        the larger of the moments (fetched for the update) and the activations with the
        logits (freed by then)."""
        if not self.candidate.offload:
            return sum(self.memory.values())
        rest = dict(self.memory)
        during = rest.pop("activations") + rest.pop("logits")
        update = rest.pop("optimizer")
        return sum(rest.values()) + max(update, during)

    @property
    def host_peak(self) -> float:
        """Modelled host bytes per device (offload)."""
        return sum(self.host.values())

    @property
    def offloads(self) -> bool:
        """Whether the candidate keeps anything in host memory."""
        return bool(self.host)


@dataclasses.dataclass(frozen=True)
class _Activations:
    """What one device keeps for the backward, and the device-memory traffic it makes."""

    held_tokens: float  # tokens whose activations a stage holds at its peak
    layers: float  # layers on the stage (L / p)
    token_bytes: float  # device bytes kept per layer and token
    host_token_bytes: float  # host bytes per layer and token (offloaded residuals)
    traffic: float  # device-memory bytes the activations move per step
    moe: MoEStep | None


def model_candidate(
    cand: Candidate,
    layouts: list[ParamLayout],
    cfg,
    *,
    batch: int,
    seq_len: int,
    device: DeviceProfile,
    optimizer: str = "adamw",
    sync: SyncConfig | None = None,
) -> Modelled:
    """Models one candidate (see the module docstring).

    Args:
        cand: the candidate.
        layouts: its parameters' layouts (`param_layouts` under its rules).
        cfg: the `GPTConfig` or `MoEConfig` (widths, layers, heads, dtype, vocabulary).
        batch: global batch (sequences).
        seq_len: tokens per sequence.
        device: the device profile.
        optimizer: the optimizer's name.
        sync: replicas that step apart, to price their exchange instead of the gradient's
            all-reduce (the planner never chooses one itself).

    Returns:
        A `Modelled`.
    """
    sizes = cand.sizes
    rules = rules_for(cand.strategy)
    batch_axes = rules.batch_axes(sizes)
    tokens_local = batch * seq_len / math.prod(sizes[a] for a in batch_axes)
    item = 2 if cfg.dtype in ("bfloat16", "float16") else 4
    pc = pipeline_config(cand) if cand.pipe > 1 else None
    params, opt = _state_bytes(layouts, sizes, optimizer)
    acts = _activations(cand, cfg, pc, item, seq_len, tokens_local, device)
    host, transfers = _host_parts(cand, acts, tokens_local, opt, len(layouts), optimizer)
    logits = tokens_local * _backbone(cfg).padded_vocab / cand.tensor * 8
    memory = {
        "parameters": params,
        "gradients": params,
        "optimizer": opt,
        "activations": acts.held_tokens * acts.layers * acts.token_bytes,
        "logits": logits,
    }
    # The stage's batch-split weights whole, and their gradient, kept for the step.
    whole = 2 * stage_gathered_bytes(layouts, sizes, batch_axes) if cand.pipe > 1 else 0.0
    if cand.gather_once:
        memory["gathered weights"] = whole
    comm = _communication(cand, rules, layouts, cfg, pc, batch, seq_len, item, sync)
    if sync is not None and sync.local:
        # each replica's own parameters beside θ̄, and the outer optimizer's moments
        memory["replica state"] = params * (1 + OUTER_MOMENTS.get(sync.outer_optimizer, 0))
    flops = _flops(cand, cfg, acts.moe, batch, seq_len)
    if acts.moe is not None:
        comm += _moe_items(acts.moe, cand)
    est = step_time(
        flops=flops,
        hbm_bytes=3 * params + 2 * opt + acts.traffic + logits,  # weights read ×2, update r/w
        comm=comm,
        sizes=sizes,
        device=device,
        bubble=_bubble(cand),
        host=transfers,
    )
    moe = acts.moe
    if moe is not None:
        moe = dataclasses.replace(moe, seconds=est.comm_s.get(MOE_BUCKET, 0.0))
    return Modelled(cand, memory, est, flops, moe, whole, host)


def _backbone(cfg):
    """The dense transformer's config: a mixture of experts' backbone, or `cfg` itself."""
    return cfg.backbone if isinstance(cfg, MoEConfig) else cfg


def _state_bytes(layouts: list[ParamLayout], sizes: dict, optimizer: str) -> tuple[float, float]:
    """Bytes per device of the parameters (each at its layout) and of the optimizer moments."""
    all_axes = {a for a, s in sizes.items() if s > 1}
    params = sum(p.nbytes / p.split(all_axes, sizes) for p in layouts)
    opt = sum(
        p.nbytes / math.prod(sizes[a] for dim in p.opt_axes for a in dim) for p in layouts
    ) * MOMENTS.get(optimizer, 2)
    return params, opt


def _activations(
    cand: Candidate, cfg, pc, item: int, seq_len: int, tokens_local: float, device
) -> _Activations:
    """The activations a stage keeps under the candidate's remat policy and schedule."""
    per_token, moe = _token_bytes(cand, cfg, item, seq_len, tokens_local, device)
    g = _backbone(cfg)
    L, p = g.n_layers, cand.pipe
    traffic = 2 * tokens_local * (L / p) * per_token  # activations written and read once
    per_token, host_token, traffic = _with_remat(cand.remat, per_token, traffic, g.d_model, item)
    if pc is not None:
        m, v = cand.microbatches, pc.chunks_per_stage()
        held = tokens_local / m * held_microbatches(cand.schedule, p, m, v)
    else:
        held = tokens_local
    return _Activations(held, L / p, per_token, host_token, traffic, moe)


def _token_bytes(
    cand: Candidate, cfg, item: int, seq_len: int, tokens_local: float, device
) -> tuple[float, MoEStep | None]:
    """Activation bytes per layer and token without remat (Korthikanti et al.), averaged over
    a mixture of experts' dense and MoE blocks; with its dispatch's step where there is one."""
    g = _backbone(cfg)
    D, H, L, t = g.d_model, g.n_heads, g.n_layers, cand.tensor
    # q, k, v and the attention output: D wide unless head_dim says; latent attention's q and
    # k are as wide as its scores (nope + rope), v and the output as its values
    scores, values = g.attention_widths()
    HK = H * (scores + values) / 2
    per_token = (10 * D + (16 * D + 8 * HK + 5 * H * seq_len) / t) * item / 2
    if not isinstance(cfg, MoEConfig):
        return per_token, None
    # An MoE block keeps its attention's share (Korthikanti's 7·D + (8·D + 5·H·T)/t) and
    # the dispatch's buffers instead of the dense feed-forward's 3·D + 16·D/t.
    cost = dispatch_costs(cfg, tokens=tokens_local, shards=cand.expert, device=device)
    n_moe = cfg.n_moe_layers
    attn = (7 * D + (8 * HK + 5 * H * seq_len) / t) * item / 2
    moe_token = attn + (cost.activation_bytes + cost.hidden_bytes / t) / tokens_local
    per_token = ((L - n_moe) * per_token + n_moe * moe_token) / L
    exchanges = 4 if cand.remat == "none" else 6  # remat re-runs the forward's dispatch
    return per_token, MoEStep(cost, n_moe / cand.pipe, exchanges)


def _with_remat(
    remat: str, per_token: float, traffic: float, D: int, item: int
) -> tuple[float, float, float]:
    """Device bytes per layer and token, host bytes per layer and token, and the traffic,
    under `remat`."""
    host_token = 0.0
    if remat == "full":
        per_token = 2 * D * item / 2
    elif remat in OFFLOAD_REMATS:
        host_token = per_token * REMAT_ACTIVATION[OFFLOAD_REMATS[remat]]
        per_token = 2 * D * item / 2
        traffic *= 1.5  # as save-dots: the elementwise ops re-run
    else:
        per_token *= REMAT_ACTIVATION[remat]
        traffic *= 1.5 if remat == "save-dots" else 1.0  # elementwise ops re-run
    return per_token, host_token, traffic


def _host_parts(
    cand: Candidate,
    acts: _Activations,
    tokens_local: float,
    opt: float,
    n_leaves: int,
    optimizer: str,
) -> tuple[dict[str, float], list[HostTransfer]]:
    """Host bytes per device and the transfers to and from it (offloaded residuals, the
    optimizer state on host)."""
    host: dict[str, float] = {}
    transfers: list[HostTransfer] = []
    if acts.host_token_bytes:
        host["activations"] = acts.held_tokens * acts.layers * acts.host_token_bytes
        moved = tokens_local * acts.layers * acts.host_token_bytes  # every microbatch's, once
        copies = round(acts.layers) * max(1, cand.microbatches)
        transfers += [
            HostTransfer("residuals", "to host", moved, FORWARD_SHARE, copies),
            HostTransfer("residuals", "to device", moved, 1 - FORWARD_SHARE, copies),
        ]
    if cand.offload:
        host["optimizer"] = opt
        leaves = n_leaves * MOMENTS.get(optimizer, 2)
        transfers += [
            HostTransfer("optimizer", "to device", opt, 0.0, leaves),
            HostTransfer("optimizer", "to host", opt, 0.0, leaves),
        ]
    return host, transfers


def _communication(
    cand: Candidate, rules, layouts, cfg, pc, batch: int, seq_len: int, item: int, sync
) -> list[CommItem]:
    """The step's collectives: the expectation's buckets, and the exchange of replicas that
    step apart (no gradient crosses them)."""
    sizes = cand.sizes
    batch_axes = rules.batch_axes(sizes)
    g = _backbone(cfg)
    own = sync is not None and sync.local
    shape = Traffic(
        sizes, batch_axes, batch * seq_len, d_model=g.d_model, act_itemsize=item, pipeline=pc,
        batch=batch, own_axes=replica_sets(rules, sizes).axes if own else (),
    )  # fmt: skip
    exp = expected(layouts, shape)
    comm = _comm_items(exp.bytes, cand, batch_axes, g.n_layers, layouts, sizes, pc)
    if own:
        assert sync is not None
        comm += exchange_model(sync, rules, sizes, layouts).items()
    return comm


def _flops(cand: Candidate, cfg, moe: MoEStep | None, batch: int, seq_len: int) -> float:
    """FLOPs per device per step: the dispatch's extra expert work, remat's second forward."""
    n = math.prod(cand.sizes.values())
    flops = cfg.flops_per_token(seq_len) * batch * seq_len / n
    if moe is not None:
        # flops_per_token counts the experts at their active cost; the dispatch computes more.
        extra = (moe.cost.flops - moe.cost.active_flops) * moe.layers / cand.tensor
        flops += extra
    if cand.remat == "full":
        flops *= 4 / 3  # the forward runs twice
    return flops


def _bubble(cand: Candidate) -> float:
    """The pipeline bubble of the candidate's schedule in lockstep (0 without a pipeline)."""
    if cand.pipe > 1:
        return lockstep_bubble(cand.schedule, cand.pipe, cand.microbatches, cand.repeats)
    return 0.0


def _moe_items(moe: MoEStep, cand: Candidate) -> list[CommItem]:
    """The dispatch all-to-alls over ``expert`` (one buffer per microbatch in a pipeline)."""
    if cand.expert == 1 or not moe.cost.buffer_bytes:
        return []
    micro = max(1, cand.microbatches)
    count = round(moe.exchanges * moe.layers * micro)
    return [CommItem(MOE_BUCKET, "all-to-all", (EXPERT,), moe.cost.buffer_bytes / micro, count)]


def _shards_weights(axis: str, layouts: list[ParamLayout]) -> bool:
    """Whether `axis` splits some weight other than by its experts (a split of the experts
    gives each device its own experts: nothing to gather)."""
    return any(
        axis in dim
        for p in layouts
        for name, dim in zip(p.names, p.axes, strict=False)
        if name != "expert"
    )


def _comm_items(b: dict, cand: Candidate, batch_axes, L, layouts, sizes, pc) -> list[CommItem]:
    """The expectation's buckets as collectives with realistic message sizes (one per layer
    and pass; a pipeline stage's passes as `weight_passes` counts them)."""
    items = []
    sharded = tuple(a for a in batch_axes if _shards_weights(a, layouts))
    gathers, reductions = weight_passes(pc, cand.pipe) if pc is not None else (2.0, 1.0)
    layers = max(1, L // cand.pipe)
    if b["gradient reduction"]:
        kind = "reduce-scatter" if sharded else "all-reduce"
        count = round(reductions * layers) + 1 if sharded and pc is not None else 1
        items.append(
            CommItem(
                "gradient reduction",
                kind,
                tuple(batch_axes),
                b["gradient reduction"] / count,
                count,
            )
        )
    if b["parameter gathers"]:
        axes = sharded or tuple(batch_axes)
        count = max(1, round(gathers * layers)) + 2
        items.append(
            CommItem("parameter gathers", "all-gather", axes, b["parameter gathers"] / count, count)
        )
    if b["tensor activations"]:
        count = 7 * max(1, L // cand.pipe) + 2
        items.append(
            CommItem(
                "tensor activations",
                "all-reduce",
                (TENSOR,),
                b["tensor activations"] / count,
                count,
            )
        )
    if b["pipeline permutes"]:
        sends = pipeline_permutes(pc, cand.pipe)
        items.append(
            CommItem(
                "pipeline permutes",
                "collective-permute",
                (PIPE,),
                b["pipeline permutes"] / sends,
                sends,
            )
        )
        items.append(
            CommItem("pipeline stage sums", "all-reduce", (PIPE,), b["pipeline stage sums"])
        )
    return items
