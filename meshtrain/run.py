"""`RunSpec`: one frozen description of a training run, read by everything that runs one,
and `TrainConfig`, the training loop's settings it holds.

The run check, the ahead-of-time compiler, the inspector, the train step and the `Trainer`
all take the same `RunSpec` instead of a dozen separate settings::

    run = RunSpec(model=GPTConfig(), data=data, mesh=mesh, rules=rules_for("fsdp", mesh))
    problems = check_run(run)
    report = inspect(run)
    trainer = Trainer(run=run)

The older spellings (``check_run(mesh=..., rules=...)``, ``train_step(..., accum_steps=...)``
and the like) are gone; ``CHANGELOG.md`` gives the new spelling of each.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from meshtrain import validate
from meshtrain.checkpoint import CheckpointConfig
from meshtrain.layout import Rules, rules_for
from meshtrain.loss import LOSS_IMPLS, LOSSES, LossFn, loss_with
from meshtrain.mesh import SEQ, make_mesh, mesh_sizes
from meshtrain.models.base import DataSpec
from meshtrain.offload import Offload
from meshtrain.optim import OptimConfig, make_optimizer
from meshtrain.pipeline import PipelineConfig
from meshtrain.precision import Precision, with_loss_scale
from meshtrain.problem import Problem
from meshtrain.replicas import SyncConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(validate.Checked):
    """The training loop.

    Args:
        steps: optimizer steps to run.
        accum_steps: microbatches per step (gradient accumulation).
        eval_every: evaluate every this many steps (0: only at the end).
        eval_batches: held-out batches per evaluation.
        log_every: write metrics every this many steps.
        seed: seed of the parameter initialisers (a model config, or a constructor that
            takes an ``nnx.Rngs``).
        run_dir: where metrics.jsonl (and checkpoints) go; empty: write no files.
        tensorboard: also write TensorBoard event files to run_dir (none without one).
        progress: show a progress bar.
        max_bad_steps: stop after this many consecutive steps whose update was skipped for a
            non-finite loss or gradient.
        loss_impl: the cross-entropy kernel: xla (optax), pallas or auto (as measured on a GPU);
            see kernels/README.md. With ``loss=mse``: the MSE kernels' switch.
        loss: ``cross_entropy`` or ``mse`` (squared error to the one-hot targets, for
            classifiers; the surveys' proof of concept).
        hang_factor: the hang watchdog declares a hang after this many median step times
            without a completed step (`meshtrain.train.watchdog`).
        hang_floor_s: ... and never before this many seconds; 0 turns the watchdog off.
    """

    steps: int = 300
    accum_steps: int = 1
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    seed: int = 0
    run_dir: str = "runs/default"
    tensorboard: bool = False
    progress: bool = True
    max_bad_steps: int = 5
    loss_impl: str = "xla"
    loss: str = "cross_entropy"
    hang_factor: float = 20.0
    hang_floor_s: float = 300.0

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        v = validate
        problems = v.positive("steps", self.steps, example=300)
        for name in ("accum_steps", "eval_batches", "log_every", "max_bad_steps"):
            problems += v.positive(name, getattr(self, name), example=getattr(TrainConfig, name))
        problems += v.non_negative("eval_every", self.eval_every, note="0 = only at the end")
        problems += v.one_of("loss_impl", self.loss_impl, LOSS_IMPLS, example="pallas")
        problems += v.at_least("hang_factor", self.hang_factor, 1, integer=False, example=20)
        problems += v.non_negative(
            "hang_floor_s", self.hang_floor_s, integer=False, example=300, note="0 = no watchdog"
        )
        return problems + v.one_of("loss", self.loss, LOSSES, example="mse")

    def describe(self, batch_size: int) -> str:
        """The run summary's part for a global batch of `batch_size`, e.g. ``300 steps ·
        gradient accumulation: 2 microbatches of 8 per step``."""
        k = self.accum_steps
        accumulation = (
            f"gradient accumulation: {k} microbatches of {batch_size // k} per step"
            if k > 1
            else "no gradient accumulation"
        )
        return f"{self.steps} steps · {accumulation}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec(validate.Checked):
    """Everything that decides what a training run computes and where.

    Args:
        model: a model config (`GPTConfig()`, any `meshtrain.models.ModelConfig`), or a
            constructor of an NNX model: a function of one ``nnx.Rngs`` (such as the module
            class; it gets ``train.seed``), or of none.
        data: a `meshtrain.data.Dataset`, a `DataSpec` (shapes only: enough to check, compile
            and inspect), or a `DataConfig` of the byte-level sources.
        mesh: the device mesh, or its axis sizes (a planner's candidate: checks and models
            only); None: the default mesh over all devices (`make_mesh()`).
        rules: the layout rules (`rules_for`); None: ``rules_for("auto", mesh)``.
        train: the loop: steps, accumulation, loss, seed, run directory (`TrainConfig`).
        optim: optimizer, schedule and clipping (`OptimConfig`).
        pipeline: schedule and microbatches, used where the mesh has ``pipe > 1``.
        sync: how the data-parallel replicas synchronise (`meshtrain.replicas.SyncConfig`).
        precision: dtypes, fp8 and loss scaling (`meshtrain.precision.Precision`); a model
            config computes by it (see `model_config`).
        offload: what lives in host memory between steps (`meshtrain.offload.Offload`).
        checkpoint: checkpoint settings; None keeps no checkpoints.
        loss_fn: a custom ``(logits, targets) -> mean loss``; None: ``train.loss`` with
            ``train.loss_impl``.
    """

    model: object = None
    data: object = None
    mesh: Mesh | Mapping[str, int] | None = None
    rules: Rules | None = None
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    pipeline: PipelineConfig = PipelineConfig()
    sync: SyncConfig = SyncConfig()
    precision: Precision = Precision()
    offload: Offload = Offload()
    checkpoint: CheckpointConfig | None = None
    loss_fn: Callable | None = None

    def problems(self) -> list[Problem]:
        """Fields of the wrong kind (each config checks its own values when it is built)."""
        kinds: dict[str, tuple[type | tuple[type, ...], str]] = {
            "train": (TrainConfig, "a TrainConfig(...)"),
            "optim": (OptimConfig, "an OptimConfig(...)"),
            "pipeline": (PipelineConfig, "a PipelineConfig(...)"),
            "sync": (SyncConfig, "a SyncConfig(...)"),
            "precision": (Precision, "a Precision(...)"),
            "offload": (Offload, "an Offload(...)"),
            "checkpoint": ((CheckpointConfig, type(None)), "a CheckpointConfig(...) or None"),
            "rules": ((Rules, type(None)), "rules_for(...) or None"),
            "mesh": ((Mesh, Mapping, type(None)), "make_mesh(...), axis sizes, or None"),
        }
        found = [
            p
            for name, (kind, fix) in kinds.items()
            for p in validate.require(
                isinstance(getattr(self, name), kind),
                f"run.{name}",
                _shown(getattr(self, name)),
                f"give {fix}",
            )
        ]
        found += validate.require(
            self.loss_fn is None or callable(self.loss_fn),
            "run.loss_fn",
            _shown(self.loss_fn),
            "give a function (logits, targets) -> mean loss, or None",
        )
        return found + validate.require(
            self.data is None or hasattr(self.data, "batch_size"),
            "run.data",
            _shown(self.data),
            "give a Dataset (make_dataset(DataConfig())), a DataSpec or a DataConfig",
        )

    def replace(self, **changes) -> RunSpec:
        """A copy with `changes` (field name → value), like `dataclasses.replace`."""
        return dataclasses.replace(self, **changes)

    def resolved(self) -> RunSpec:
        """The same run with the defaults filled in: the default mesh where `mesh` is None,
        ``rules_for("auto", mesh)`` where `rules` is None."""
        mesh = make_mesh() if self.mesh is None else self.mesh
        rules = rules_for("auto", mesh) if self.rules is None else self.rules
        if mesh is self.mesh and rules is self.rules:
            return self
        return dataclasses.replace(self, mesh=mesh, rules=rules)

    @property
    def sizes(self) -> dict[str, int]:
        """The mesh's axis sizes (those of the default mesh when `mesh` is None)."""
        if isinstance(self.mesh, Mapping):
            return dict(self.mesh)
        return mesh_sizes(make_mesh() if self.mesh is None else self.mesh)

    @property
    def data_spec(self) -> DataSpec:
        """The data's shapes (`DataSpec`), from a `Dataset`, a `DataSpec` or a `DataConfig`."""
        if self.data is None:
            raise ValueError(
                "RunSpec.data is None: give a Dataset (make_dataset(DataConfig())) or a DataSpec"
            )
        return data_spec(self.data)

    @property
    def model_config(self):
        """`model` when it is a model config (it has ``build``), with its dtypes set by
        `precision` (`Precision.applied`); else None."""
        if not callable(getattr(self.model, "build", None)):
            return None
        return self.precision.applied(self.model)

    @property
    def loss_scaling(self) -> bool:
        """Whether the step scales the loss (`meshtrain.precision.loss_scale`)."""
        return self.precision.loss_scaling(self.model)

    @property
    def step_loss(self) -> LossFn:
        """The loss the step minimises: `loss_fn`, or ``train.loss`` with ``train.loss_impl``."""
        return self.loss_fn or loss_with(self.train.loss, self.train.loss_impl)

    def optimizer(self, total_steps: int):
        """The run's optax transformation: `optim`'s (`make_optimizer`), holding the loss
        scale in its state when `loss_scaling` (`meshtrain.precision.with_loss_scale`)."""
        tx = make_optimizer(self.optim, total_steps)
        return with_loss_scale(tx, self.precision.loss_scale_init) if self.loss_scaling else tx

    def kernels(self) -> str:
        """The run summary's kernel line: what each kernel setting runs here (``auto``
        resolved for this GPU, sequence, packing and layout); empty for a model without any."""
        from meshtrain.kernels import select

        spec, cfg = self.data_spec, self.model_config
        plain = self.loss_fn is None and self.train.loss == "cross_entropy"
        loss_impl = self.train.loss_impl if plain else None
        algorithm: str = getattr(self.rules, "context_parallel", "ring")
        context = algorithm if self.sizes.get(SEQ, 1) > 1 else False  # its algorithm, if any
        choices = select.chosen(
            cfg, seq_len=spec.seq_len or 0, packed=spec.packed, context=context,
            loss_impl=loss_impl,
        )  # fmt: skip
        return select.describe(choices) if choices else ""

    def summary(
        self,
        *,
        n_params: int | None = None,
        host_bytes: float | None = None,
        gathered_bytes: float | None = None,
    ) -> list[str]:
        """The run summary, one line per part, each written by the config that owns it: the
        layout (`Rules.describe`), the pipeline, the replicas, the model, the precision of each
        part (`Precision.describe`), the kernels each op runs (`kernels`), memory (remat and
        `Offload.describe`), and data and steps (`DataSpec.describe`, `TrainConfig.describe`).
        The `Trainer` logs it; ``meshtrain train`` prints it.

        Args:
            n_params: the parameter count, where the state is built.
            host_bytes: the optimizer state's bytes per device in host memory, where known.
            gathered_bytes: with ``pipeline.gather_once``, a stage's gathered weights' bytes
                per device (`meshtrain.comm.expect.stage_weight_bytes`), where known.
        """
        from meshtrain.mesh import PIPE, describe, describe_sizes
        from meshtrain.models.remat import describe as remat

        run = self.resolved()
        sizes, cfg, rules = run.sizes, run.model_config, run.rules
        assert rules is not None  # resolved
        where = describe(run.mesh) if isinstance(run.mesh, Mesh) else describe_sizes(sizes)
        lines = [f"meshtrain · mesh {where} · {rules.describe(sizes)}"]
        if (stages := sizes.get(PIPE, 1)) > 1:
            lines.append(_pipeline_line(run.pipeline, stages, gathered_bytes))
        if run.sync != SyncConfig():
            lines.append(run.sync.describe(rules, sizes))
        model = "model " + (cfg.describe() if cfg is not None else _named(run.model))
        count = f" · {n_params / 1e6:.2f}M parameters" if n_params is not None else ""
        lines += [model + count, run.precision.describe(self.model)]
        if kernels := run.kernels():
            lines.append(kernels)
        memory = [remat(cfg.remat)] if hasattr(cfg, "remat") else []
        lines.append("memory: " + " · ".join([*memory, run.offload.describe(host_bytes)]))
        spec = run.data_spec
        lines.append(f"{spec.describe()} · {run.train.describe(spec.batch_size)}")
        return lines

    def constructor(self) -> tuple[Callable[[], nnx.Module], list[Problem]]:
        """A zero-argument constructor of the model, and a problem if ``train.seed`` cannot
        reach it."""
        return model_constructor(self.model_config or self.model, self.train.seed)


def _named(model) -> str:
    """A constructor's name, for a model given as one."""
    return getattr(model, "__name__", type(model).__name__)


def _pipeline_line(pipeline: PipelineConfig, stages: int, gathered: float | None) -> str:
    """`PipelineConfig.describe`; with ``gather_once`` and no byte count known, without one."""
    if pipeline.gather_once and gathered is None:
        plain = dataclasses.replace(pipeline, gather_once=False).describe(stages)
        return f"{plain} · stage weights gathered once per step"
    return pipeline.describe(stages, gathered)


def _shown(value) -> object:
    """A value as a problem shows it: itself when short and plain, else its type's name."""
    plain = isinstance(value, (str, int, float, bool)) and len(repr(value)) <= 40
    return value if plain else type(value).__name__


def data_spec(data) -> DataSpec:
    """A `DataSpec` from a `Dataset`, a `DataSpec` (returned as is) or a `DataConfig`."""
    if isinstance(data, DataSpec):
        return data
    if not hasattr(data, "kind"):  # a DataConfig
        if getattr(data, "source", None) == "arrays":
            from meshtrain.data import make_dataset

            return data_spec(make_dataset(data))
        return DataSpec("lm", data.batch_size, data.seq_len, 256, None)
    return DataSpec(
        data.kind,
        data.batch_size,
        data.seq_len,
        data.vocab_size,
        data.num_features,
        getattr(data, "image_shape", None),
        "segment_ids" in getattr(data, "batch_keys", ()),  # packed (meshtrain.data.packing)
    )


def model_constructor(model: Any, seed: int) -> tuple[Callable[[], nnx.Module], list[Problem]]:
    """A zero-argument constructor for `model`, and a problem if `seed` cannot reach it."""
    if callable(getattr(model, "build", None)):  # a model config
        return (lambda: model.build(rngs=nnx.Rngs(params=seed))), []
    if not callable(model):
        raise ValueError(
            f"model={type(model).__name__}: give a model config (e.g. GPTConfig()) or a "
            "function that builds an nnx.Module"
        )
    # A class's own signature may be hidden by its metaclass (nnx.Module's is): read __init__.
    is_class = isinstance(model, type)
    function = model.__init__ if is_class else model
    try:
        wanted = [
            p
            for p in inspect.signature(function).parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        wanted = []
    if is_class:
        wanted = wanted[1:]  # self
    if len(wanted) == 1:  # e.g. a module class whose __init__ takes rngs
        return (lambda: model(nnx.Rngs(params=seed))), []
    problems = []
    if seed != 0:
        problems.append(
            Problem(
                "train.seed",
                seed,
                "a zero-argument model constructor fixes its own seed, so this one would be "
                "ignored; pass a constructor that takes an nnx.Rngs (e.g. the module class), "
                "or leave seed at 0",
            )
        )
    return model, problems
