"""The pairs of features that do not run together yet, as one table.

Each `Refusal` names two features, why they do not compose, the setting to change and the
fix. `pair_problems` reads the table, so the run check refuses a pair only through it, and
adding a feature means adding its rows here, not a branch somewhere else::

    Problem  mesh.seq=2: context parallelism with pipelines: ...; set seq=1 or pipe=1

A run is a `meshtrain.RunSpec`; its ``mesh`` may be a `Mesh` or a mapping of axis sizes (a
planner's candidate).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from meshtrain.layout import alternatives, axes_of, rules_for
from meshtrain.loss import cross_entropy
from meshtrain.mesh import AXES, EXPERT, PIPE, SEQ
from meshtrain.models import families
from meshtrain.models.base import DataSpec
from meshtrain.models.gpt_config import GPTConfig
from meshtrain.models.moe_config import MoEConfig
from meshtrain.pipeline import PipelineConfig
from meshtrain.pipeline.schedules import HAND_SCHEDULED
from meshtrain.precision import Precision
from meshtrain.problem import Problem
from meshtrain.replicas import SyncConfig
from meshtrain.run import RunSpec, TrainConfig

__all__ = ["REFUSALS", "Refusal", "model_name", "pair_problems"]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Two features that do not run together.

    Args:
        first: the feature whose setting is named (``"gradient compression"``).
        second: the feature it does not run with (``"pipelines"``).
        reason: why, in a few words.
        applies: ``run → bool``: whether `run` has both features.
        field: the setting the problem is filed under, as the CLI names it without dashes;
            ``{model}`` stands for the model family (``gpt.attention_impl``).
        fix: what to change, naming the flags (``{model}`` as in `field`).
        value: ``run → value`` of `field`, shown in the line.
        example: ``() → (with_pair, without_pair)``: two dicts of run attributes, the first
            refused for this pair, the second the same run with one of the two features
            removed (the table's test builds runs from them).
        cells: the cells of the composition matrix this row refuses, as pairs of feature ids
            (`meshtrain.composition_matrix.FEATURES`); empty where neither feature is one.
    """

    first: str
    second: str
    reason: str
    applies: Callable[[RunSpec], bool]
    field: str
    fix: str
    value: Callable[[RunSpec], object] = lambda run: None
    example: Callable[[], tuple[dict, dict]] | None = None
    cells: tuple[tuple[str, str], ...] = ()

    def problem(self, run: RunSpec) -> Problem:
        """The one-line `Problem` for `run` (which `applies`)."""
        name = model_name(run.model)
        fix = self.fix.format(model=name)
        message = f"{self.first} with {self.second}: {self.reason}; {fix}"
        return Problem(self.field.format(model=name), self.value(run), message)


def model_name(model) -> str:
    """The family name of a model config (``gpt`` for anything else)."""
    return next((n for n, f in families().items() if isinstance(model, f.config)), "gpt")


def _axis(run: RunSpec, name: str) -> int:
    """The size of mesh axis `name` (1 when the mesh lacks it)."""
    return run.sizes.get(name, 1)


def _packed(run: RunSpec) -> bool:
    """Whether the batches carry segment ids (packed documents)."""
    return run.data_spec.packed


def _kind(run: RunSpec) -> str:
    """The data's kind (``lm``, ``classify``, ``image``)."""
    return run.data_spec.kind


def _compresses(run: RunSpec) -> bool:
    """Gradient compression is on."""
    return run.sync.compresses


def _local(run: RunSpec) -> bool:
    """The replicas step on their own: local SGD, DiLoCo, gossip or federated averaging."""
    return run.sync.local


def _plain_local(run: RunSpec) -> bool:
    """Local SGD or DiLoCo (the replicas restart from one average at every sync)."""
    return run.sync.local and not (run.sync.gossips or run.sync.federates)


def _gossips(run: RunSpec) -> bool:
    """Gossip averaging is on."""
    return run.sync.gossips


def _federates(run: RunSpec) -> bool:
    """Federated averaging is on."""
    return run.sync.federates


def _no_replicas(run: RunSpec) -> bool:
    """The rules split the parameters over every batch axis (e.g. fsdp): no replicas."""
    rules = run.rules or rules_for("auto", run.sizes)
    return not rules.replica_axes(run.sizes)


def _fsdp_and_tensor(run: RunSpec) -> bool:
    """The rules split the parameters over both fsdp and tensor (hsdp+tp on fsdp, tensor > 1)."""
    rules = run.rules or rules_for("auto", run.sizes)
    named = {a for e in rules.params.values() for o in alternatives(e) for a in axes_of(o)}
    split = {a for a in ("fsdp", "tensor") if _axis(run, a) > 1 and a in named}
    return split == {"fsdp", "tensor"} and bool(rules.replica_axes(run.sizes))


def _pooled_router_loss(run: RunSpec) -> bool:
    """The model adds Mixtral's load-balancing loss, pooled over every MoE block, to the loss."""
    model = run.model
    if not isinstance(model, MoEConfig):
        return False
    return model.router_losses == "mixtral" and model.aux_loss_coef > 0


def _kernels(run: RunSpec) -> set[str]:
    """The hand-written kernels (pallas, cudnn) the model's attention or norms name."""
    names = {str(getattr(run.model, f, "")) for f in ("attention_impl", "norm_impl")}
    return names & {"pallas", "cudnn"}


def _mesh_value(axis: str) -> Callable[[RunSpec], int]:
    """``run → size of axis``, the value a mesh row shows."""
    return lambda run: _axis(run, axis)


def _grad_compression(run: RunSpec) -> str:
    """The ``--grad-compression`` value."""
    return run.sync.grad_compression


def _sync_every(run: RunSpec) -> int | None:
    """The ``--sync-every`` value."""
    return run.sync.sync_every


def _gossip(run: RunSpec) -> str | None:
    """The ``--gossip`` value."""
    return run.sync.gossip


def _client_fraction(run: RunSpec) -> float | None:
    """The ``--client-fraction`` value."""
    return run.sync.client_fraction


_LM = DataSpec("lm", 16, 32, 256)  # the examples' data: 16 windows of 32 bytes


def _run(mesh: Mapping[str, int], **kw) -> dict:
    """Run attributes: a small GPT on byte windows, over `mesh`, unless `kw` says otherwise."""
    full = {**dict.fromkeys(AXES, 1), **mesh}
    return {"model": GPTConfig(n_layers=4), "data": _LM, "mesh": full, **kw} | {
        "rules": kw.get("rules") or rules_for("dp", full)
    }


def _pair(with_mesh: Mapping[str, int], without_mesh: Mapping[str, int], **kw):
    """An example: the same settings on a mesh that has the pair and one that has not."""
    return lambda: (_run(with_mesh, **_build(kw)), _run(without_mesh, **_build(kw)))


def _build(kw: dict) -> dict:
    """Calls the zero-argument builders among `kw`'s values (configs are built late)."""
    return {k: v() if callable(v) else v for k, v in kw.items()}


def _sync_example(sync: dict, other: dict, mesh=None, rules=None, model=None):
    """An example for a sync pair: `sync` (SyncConfig fields) refused, `other` accepted (on
    `model`, built late, when given)."""

    def build():
        base = mesh or {"data": 8}
        made = {"rules": rules_for(rules, _run(base)["mesh"])} if rules else {}
        if model is not None:
            made["model"] = model()
        return (
            _run(base, sync=SyncConfig(**sync), **made),
            _run(base, sync=SyncConfig(**other), **made),
        )

    return build


def _gpt(**kw):
    """A builder of a `GPTConfig` with `kw` (built when the example runs)."""
    return lambda: GPTConfig(**kw)


def _lm(**kw):
    """A builder of the examples' data with `kw` changed."""
    return lambda: _LM._replace(**kw)


def _images() -> DataSpec:
    """Image classification data: no sequence to split."""
    return DataSpec("image", 16, None, 10, image_shape=(8, 8, 1))


def _no_context_model():
    """A GPT config that declares it cannot split sequences (``context_parallel = False``)."""
    return type("NoContextGPT", (GPTConfig,), {"context_parallel": False})()


def _both(on: Callable[[RunSpec], bool], axis: str) -> Callable[[RunSpec], bool]:
    """``run → on(run) and axis > 1``: a feature beside a split over `axis`."""
    return lambda run: on(run) and _axis(run, axis) > 1


def _model_value(field: str) -> Callable[[RunSpec], object]:
    """``run → the model config's `field```, the value a model row shows."""
    return lambda run: getattr(run.model, field)


# the matrix's feature ids of each family
_PIPELINES = ("gpipe", "circular", "1f1b", "interleaved-1f1b", "zb-h1")
_CONTEXT = ("ring", "allgather", "ulysses")
_MOE = ("moe-capacity", "moe-dropless")
_LOCAL = ("local-sgd", "diloco", "gossip", "federated")  # the replicas step on their own


def _cells(firsts: tuple[str, ...], seconds: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Every matrix cell of one id of `firsts` with one of `seconds`."""
    return tuple((a, b) for a in firsts for b in seconds)


# The features each sync row's second feature stands for in the matrix (pure fsdp is the
# strategy without replicas).
_SYNC_SECONDS = {
    "pipelines": _PIPELINES,
    "several chunks per stage (circular, interleaved-1f1b)": ("circular", "interleaved-1f1b"),
    "context parallelism": _CONTEXT,
    "expert parallelism (MoE)": _MOE,
    "a strategy without replicas": ("fsdp",),
}


def _with_cells(rows: tuple[Refusal, ...], firsts: tuple[str, ...]) -> tuple[Refusal, ...]:
    """`rows` (of one sync feature, `firsts` its ids) naming their matrix cells."""
    return tuple(
        dataclasses.replace(r, cells=_cells(firsts, _SYNC_SECONDS.get(r.second, ()))) for r in rows
    )


def _circular() -> PipelineConfig:
    """The circular schedule with two chunks of layers per stage."""
    return PipelineConfig(schedule="circular", repeats=2)


def _sync_axis_rows(first, field, value, flags, on, example: dict) -> tuple[Refusal, ...]:
    """A sync feature with what its step manual over the replicas cannot hold: context
    parallelism, several chunks of layers per stage (circular, interleaved-1f1b), and a strategy
    without replicas."""
    return (
        Refusal(
            first,
            "context parallelism",
            f"{flags} runs the step in a region manual over the replicas, and jax cannot "
            "differentiate the context-parallel attention's region over seq nested inside it",
            _both(on, SEQ),
            field,
            f"set seq=1 in --mesh, or drop {flags}",
            value,
            _sync_example(example, {}, mesh={"seq": 2, "data": 4}),
        ),
        Refusal(
            first,
            "several chunks per stage (circular, interleaved-1f1b)",
            f"{flags} runs the pipeline's loop inside the replicas' region, where each stage "
            "holds only its contiguous layers, and a schedule with several chunks per stage "
            "interleaves them across stages",
            lambda run: on(run) and _axis(run, PIPE) > 1 and run.pipeline.chunks_per_stage() > 1,
            field,
            f"use --schedule gpipe, 1f1b or zb-h1 (or --repeats 1), or drop {flags}",
            value,
            lambda: (
                _run(
                    {"pipe": 2, "data": 4},
                    sync=SyncConfig(**example),
                    pipeline=_circular(),
                ),
                _run({"pipe": 2, "data": 4}, pipeline=_circular()),
            ),
        ),
        Refusal(
            first,
            "a strategy without replicas",
            f"{flags} works across replicas (batch axes of size > 1 no parameter is split "
            "over), and this layout has none",
            lambda run: on(run) and _no_replicas(run),
            field,
            "use --strategy dp, zero1 or hsdp (hsdp: replicas over data) on a mesh with data ≥ 2",
            value,
            _sync_example(example, {}, mesh={"data": 8}, rules="fsdp"),
        ),
    )


# The replicas' own step, scheme by scheme: (name, matrix ids, on, field, value, flag, the
# settings of an example, why it exchanges no gradients).
_SCHEMES = (
    ("local SGD", ("local-sgd", "diloco"), _plain_local, "sync_every", _sync_every,
     "--sync-every", {"sync_every": 4}, "local SGD exchanges parameters, not gradients"),
    ("gossip", ("gossip",), _gossips, "gossip", _gossip, "--gossip",
     {"gossip": "ring", "sync_every": 4},
     "gossip mixes parameters, and compressing them needs CHOCO-SGD's correction (each "
     "replica's running estimate of its neighbours' values), which meshtrain does not build"),
    ("federated averaging", ("federated",), _federates, "client_fraction", _client_fraction,
     "--client-fraction", {"client_fraction": 0.5, "sync_every": 4},
     "federated averaging exchanges each round's parameter change, not gradients"),
)  # fmt: skip


def _own_step_rows() -> tuple[Refusal, ...]:
    """Each scheme of the replicas' own step with what it cannot run beside: gradient
    compression, bounded staleness, float16's loss scale, what its region cannot hold
    (`_sync_axis_rows`), and for gossip, expert parallelism."""
    rows: list[Refusal] = []
    for name, ids, on, field, value, flag, example, exchange in _SCHEMES:
        rows += [
            Refusal(
                name,
                "gradient compression",
                exchange,
                _and(on, _compresses),
                "grad_compression",
                f"drop one of --grad-compression and {flag}",
                _grad_compression,
                _sync_example({**example, "grad_compression": "int8"}, example),
                cells=_cells(ids, ("compression",)),
            ),
            Refusal(
                "bounded staleness",
                name,
                "staleness models a parameter server with synchronous replicas",
                _and(on, _stale),
                "staleness",
                f"drop one of --staleness and {flag}",
                lambda run: run.sync.staleness,
                _sync_example({**example, "staleness": 2}, {"staleness": 2}),
                cells=_cells(("staleness",), ids),
            ),
            Refusal(
                "fp16 loss scaling",
                name,
                f"the loss scale is one value for the run, and {name}'s replicas step apart, "
                "each with gradients that overflow on their own",
                _and(on, _loss_scaling),
                "precision",
                f"use --precision bf16 (no loss scaling), or drop {flag}",
                lambda run: run.precision.policy,
                _precision_example(example),
                cells=_cells(ids, ("fp16",)),
            ),
            *_with_cells(_sync_axis_rows(name, field, value, flag, on, example), ids),
        ]
        if name == "gossip":
            rows += _with_cells((_expert_row(name, field, value, flag, on, example),), ids)
    return tuple(rows)


def _and(*checks: Callable[[RunSpec], bool]) -> Callable[[RunSpec], bool]:
    """``run → every one of checks(run)``."""
    return lambda run: all(check(run) for check in checks)


def _stale(run: RunSpec) -> bool:
    """Bounded staleness is on."""
    return bool(run.sync.staleness)


def _loss_scaling(run: RunSpec) -> bool:
    """float16's dynamic loss scale is on."""
    return run.loss_scaling


def _precision_example(example: dict):
    """An example for a loss-scaling row: the sync `example` under fp16, then under bf16."""

    def build():
        sync = SyncConfig(**example)
        return (
            _run({"data": 8}, sync=sync, precision=Precision(policy="fp16")),
            _run({"data": 8}, sync=sync, precision=Precision(policy="bf16")),
        )

    return build


def _expert_row(name, field, value, flag, on, example: dict) -> Refusal:
    """Gossip beside expert > 1, where the replicas are no one graph."""
    return Refusal(
        name,
        "expert parallelism (MoE)",
        "under expert > 1 an expert's weights have one copy per data replica and the dense "
        "weights one per device over data and expert, so the replicas form no single graph to "
        "mix over (local SGD and federated averaging average each leaf over its own copies)",
        lambda run: on(run) and _axis(run, EXPERT) > 1,
        field,
        f"set expert=1 in --mesh (the experts then replicate), or use --sync-every without {flag}",
        value,
        lambda: (
            _run({"expert": 2, "data": 4}, model=MoEConfig(), sync=SyncConfig(**example)),
            _run({"data": 8}, model=MoEConfig(), sync=SyncConfig(**example)),
        ),
    )


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "expert parallelism",
        "a model without experts",
        "only a mixture-of-experts model has experts to split over expert > 1",
        lambda run: (
            _axis(run, EXPERT) > 1 and EXPERT not in getattr(run.model, "supported_axes", ())
        ),
        "mesh.expert",
        "set expert=1 in --mesh, or use --model moe",
        _mesh_value(EXPERT),
        lambda: (
            _run({"expert": 2, "data": 4}),
            _run({"expert": 2, "data": 4}, model=MoEConfig()),
        ),
    ),
    Refusal(
        "context parallelism",
        "a model that cannot split its sequences",
        "the model declares context_parallel = False",
        lambda run: _axis(run, SEQ) > 1 and getattr(run.model, "context_parallel", True) is False,
        "mesh.seq",
        "set seq=1 in --mesh",
        _mesh_value(SEQ),
        lambda: (
            _run({"seq": 2, "data": 4}, model=_no_context_model()),
            _run({"data": 8}, model=_no_context_model()),
        ),
    ),
    Refusal(
        "context parallelism",
        "pipelines",
        "the ring and the pipeline stages do not compose yet",
        lambda run: _axis(run, SEQ) > 1 and _axis(run, PIPE) > 1,
        "mesh.seq",
        "set seq=1 or pipe=1 in --mesh",
        _mesh_value(SEQ),
        _pair({"seq": 2, "pipe": 2, "data": 2}, {"seq": 2, "data": 4}),
        cells=_cells(_CONTEXT, _PIPELINES),
    ),
    Refusal(
        "context parallelism",
        "data without sequences",
        "only token sequences (lm data) can be split over seq",
        lambda run: _axis(run, SEQ) > 1 and _kind(run) != "lm",
        "mesh.seq",
        "set seq=1 in --mesh",
        _mesh_value(SEQ),
        lambda: (
            _run({"seq": 2, "data": 4}, model=None, data=_images()),
            _run({"data": 8}, model=None, data=_images()),
        ),
    ),
    Refusal(
        "cuDNN attention",
        "packed batches",
        "the cuDNN path takes no document masks",
        lambda run: _packed(run) and getattr(run.model, "attention_impl", None) == "cudnn",
        "{model}.attention_impl",
        "use pallas, auto or xla, or train on plain windows (--data.no-packing)",
        lambda run: "cudnn",
        lambda: (
            _run(
                {"data": 8},
                model=_gpt(attention_impl="cudnn", d_model=256)(),
                data=_lm(packed=True)(),
            ),
            _run({"data": 8}, model=_gpt(attention_impl="cudnn", d_model=256)()),
        ),
        cells=(("cudnn", "packed"),),
    ),
    Refusal(
        "cuDNN attention",
        "context parallelism",
        "cuDNN's attention takes no position mask and returns no log-sum-exp, so it cannot run "
        "a ring step",
        lambda run: _axis(run, SEQ) > 1 and getattr(run.model, "attention_impl", None) == "cudnn",
        "{model}.attention_impl",
        "use --{model}.attention-impl pallas, auto or xla, or set seq=1",
        lambda run: "cudnn",
        _pair({"seq": 2, "data": 4}, {"data": 8}, model=_gpt(attention_impl="cudnn", d_model=256)),
        cells=_cells(("cudnn",), _CONTEXT),
    ),
    Refusal(
        "cuDNN attention",
        "pipelines",
        "jax differentiates cuDNN's fused attention itself, which a stage's nested manual "
        "region cannot (the Pallas kernel's own backward can)",
        lambda run: _axis(run, PIPE) > 1 and getattr(run.model, "attention_impl", None) == "cudnn",
        "{model}.attention_impl",
        "use pallas (or auto) inside pipelines, or set pipe=1",
        lambda run: "cudnn",
        _pair({"pipe": 2, "data": 4}, {"data": 8}, model=_gpt(attention_impl="cudnn", d_model=256)),
        cells=_cells(("cudnn",), _PIPELINES),
    ),
    Refusal(
        "cuDNN attention",
        "the replicas' own step (gradient compression, local SGD, DiLoCo, gossip, federated "
        "averaging)",
        "jax differentiates cuDNN's fused attention itself, which a region manual over the "
        "replicas cannot (the Pallas kernel's own backward can)",
        lambda run: (
            (_compresses(run) or _local(run))
            and getattr(run.model, "attention_impl", None) == "cudnn"
        ),
        "{model}.attention_impl",
        "use pallas (or auto) with --grad-compression, --sync-every, --gossip or "
        "--client-fraction, or drop them",
        lambda run: "cudnn",
        _sync_example(
            {"grad_compression": "int8"},
            {},
            model=_gpt(attention_impl="cudnn", d_model=256),
        ),
        cells=_cells(("cudnn",), ("compression", *_LOCAL)),
    ),
    Refusal(
        "the replicas' own step (gradient compression, local SGD, DiLoCo, gossip, federated "
        "averaging)",
        "hsdp with tensor parallelism",
        "XLA's SPMD partitioner aborts compiling that step when fsdp and tensor both split the "
        "parameters inside it (a failed check in spmd_partitioner_util)",
        lambda run: (_compresses(run) or _local(run)) and _fsdp_and_tensor(run),
        "strategy",
        "use dp+tp or zero1+tp (or hsdp without tensor) with --grad-compression or --sync-every",
        lambda run: (run.rules or rules_for("auto", run.sizes)).name,
        _sync_example(
            {"grad_compression": "int8"},
            {},
            mesh={"data": 2, "fsdp": 2, "tensor": 2},
            rules="hsdp+tp",
        ),
    ),
    Refusal(
        "local SGD (and DiLoCo, gossip, federated averaging)",
        "pipelines with global-norm clipping",
        "the replicas' own optimizer runs inside the replicas' region, where each stage holds "
        "only its own layers, so the gradient's global norm would be one stage's",
        lambda run: _local(run) and _axis(run, PIPE) > 1 and run.optim.clip_norm > 0,
        "optim.clip_norm",
        "set --clip-norm 0 beside --sync-every on pipe > 1, or set pipe=1",
        lambda run: run.optim.clip_norm,
        _sync_example({"sync_every": 4}, {}, mesh={"pipe": 2, "data": 4}),
    ),
    *_own_step_rows(),
    Refusal(
        "fp16",
        "the Pallas or cuDNN kernels",
        "meshtrain's attention and norm kernels take float32 and bfloat16 only",
        lambda run: run.precision.resolved(run.model) == "fp16" and bool(_kernels(run)),
        "precision",
        "use --precision bf16, or --{model}.attention-impl xla and --{model}.norm-impl xla",
        lambda run: run.precision.policy,
        lambda: (
            _run(
                {"data": 8}, model=GPTConfig(norm_impl="pallas"), precision=Precision(policy="fp16")
            ),
            _run(
                {"data": 8}, model=GPTConfig(norm_impl="pallas"), precision=Precision(policy="bf16")
            ),
        ),
        cells=(("pallas", "fp16"), ("cudnn", "fp16")),
    ),
    Refusal(
        "fp16 loss scaling",
        "bounded staleness",
        "a gradient applied s steps later was scaled by the scale of its own step, which may "
        "have changed since",
        lambda run: run.loss_scaling and bool(run.sync.staleness),
        "precision",
        "use --precision bf16 (no loss scaling), or drop --staleness",
        lambda run: run.precision.policy,
        lambda: (
            _run({"data": 8}, sync=SyncConfig(staleness=1), precision=Precision(policy="fp16")),
            _run({"data": 8}, sync=SyncConfig(staleness=1)),
        ),
        cells=(("staleness", "fp16"),),
    ),
    Refusal(
        "an outer optimizer",
        "synchronous training",
        "the outer optimizer runs at local SGD's synchronisations",
        lambda run: not _local(run) and run.sync.outer_optimizer != "average",
        "outer_optimizer",
        "add --sync-every H, or drop --outer-optimizer",
        lambda run: run.sync.outer_optimizer,
        _sync_example(
            {"outer_optimizer": "nesterov"}, {"outer_optimizer": "nesterov", "sync_every": 4}
        ),
    ),
    Refusal(
        "gossip",
        "federated averaging",
        "they are two ways for the same replicas to synchronise",
        lambda run: _gossips(run) and _federates(run),
        "gossip",
        "drop one of --gossip and --client-fraction",
        _gossip,
        _sync_example(
            {"gossip": "ring", "client_fraction": 0.5, "sync_every": 4},
            {"gossip": "ring", "sync_every": 4},
        ),
    ),
    Refusal(
        "gossip",
        "no --sync-every",
        "gossip forms the model you evaluate and save, the replicas' mean, every H steps",
        lambda run: _gossips(run) and run.sync.sync_every is None,
        "sync_every",
        "add --sync-every H (e.g. 50)",
        _sync_every,
        _sync_example({"gossip": "ring"}, {"gossip": "ring", "sync_every": 50}),
    ),
    Refusal(
        "federated averaging",
        "no --sync-every",
        "a federated round is H local steps",
        lambda run: _federates(run) and run.sync.sync_every is None,
        "sync_every",
        "add --sync-every H (e.g. 8)",
        _sync_every,
        _sync_example({"client_fraction": 0.5}, {"client_fraction": 0.5, "sync_every": 8}),
    ),
    Refusal(
        "an outer optimizer",
        "gossip",
        "gossip's model is the replicas' mean, with no outer step to apply it through",
        lambda run: _gossips(run) and run.sync.outer_optimizer != "average",
        "outer_optimizer",
        "use --outer-optimizer average (the default), or drop --gossip",
        lambda run: run.sync.outer_optimizer,
        _sync_example(
            {"gossip": "ring", "sync_every": 4, "outer_optimizer": "nesterov"},
            {"gossip": "ring", "sync_every": 4},
        ),
    ),
    *_with_cells(
        _sync_axis_rows(
            "gradient compression",
            "grad_compression",
            _grad_compression,
            "--grad-compression",
            _compresses,
            {"grad_compression": "int8"},
        ),
        ("compression",),
    ),
    Refusal(
        "Mixtral's router loss",
        "a hand-scheduled schedule",
        "the loss pools every stage's blocks, and a hand-scheduled schedule (1f1b, "
        "interleaved-1f1b, zb-h1) runs each stage's backward with its own blocks only (gpipe "
        "and circular pool them exactly)",
        lambda run: (
            _pooled_router_loss(run)
            and _axis(run, PIPE) > 1
            and run.pipeline.schedule in HAND_SCHEDULED
        ),
        "moe.router_losses",
        "use --schedule gpipe or circular, or --moe.router-losses meshtrain, or set "
        "--moe.aux-loss-coef 0",
        _model_value("router_losses"),
        lambda: (
            _run(
                {"pipe": 2, "data": 4},
                model=MoEConfig(router_losses="mixtral"),
                pipeline=PipelineConfig(schedule="1f1b"),
            ),
            _run({"pipe": 2, "data": 4}, model=MoEConfig(router_losses="mixtral")),
        ),
    ),
    Refusal(
        "a custom loss_fn",
        "a loss kernel",
        "the kernel applies only to the built-in losses",
        lambda run: run.loss_fn is not None and run.train.loss_impl != "xla",
        "train.loss_impl",
        "set --loss-impl xla, or drop loss_fn",
        lambda run: run.train.loss_impl,
        lambda: (
            _run({"data": 8}, loss_fn=cross_entropy, train=TrainConfig(loss_impl="pallas")),
            _run({"data": 8}, train=TrainConfig(loss_impl="pallas")),
        ),
    ),
    Refusal(
        "a custom loss_fn",
        "a built-in loss",
        "train.loss picks a built-in loss, loss_fn replaces it",
        lambda run: run.loss_fn is not None and run.train.loss != "cross_entropy",
        "train.loss",
        "drop --loss, or drop loss_fn",
        lambda run: run.train.loss,
        lambda: (
            _run({"data": 8}, loss_fn=cross_entropy, train=TrainConfig(loss="mse")),
            _run({"data": 8}, loss_fn=cross_entropy),
        ),
    ),
)


def pair_problems(run: RunSpec) -> list[Problem]:
    """Every pair of features in `run` that `REFUSALS` refuses, one `Problem` each.

    Args:
        run: the run (`meshtrain.RunSpec`); its mesh may be axis sizes alone.

    Returns:
        The problems, in the table's order; an empty list when no refused pair is present.
    """
    return [refusal.problem(run) for refusal in REFUSALS if refusal.applies(run)]
