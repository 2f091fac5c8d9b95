"""Settings that only count while a feature is on, as one table (`NEEDS`), and the run
check's refusal of one changed while its feature is off (`no_effect_problems`).

A loss-scale setting under fp32, a host memory kind without offload or a pipeline schedule on
a mesh without ``pipe`` would train, exit 0 and leave the user believing it was used. Each row
names the setting, where the run holds it, the feature it belongs to, a test of whether the
feature is on, and the change that would make the setting count::

    loss_scale_init=1024.0: has no effect under --precision fp32: it belongs to fp16's loss
    scaling; drop --loss-scale-init or use --precision fp16 (with --loss-scale auto or dynamic)

A setting is refused only when its value differs from its default: a run cannot tell a
default that was typed from one that was left alone. Pairs of features that do not run
together are another table (`meshtrain.composition.REFUSALS`); the settings it already
refuses alone (an outer optimizer without ``--sync-every``, a loss kernel beside a custom
``loss_fn``) are not repeated here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from meshtrain.data.config import DataConfig
from meshtrain.layout import Rules
from meshtrain.mesh import PIPE, SEQ
from meshtrain.models import families
from meshtrain.offload import Offload
from meshtrain.optim import OptimConfig
from meshtrain.pipeline import PipelineConfig
from meshtrain.precision import Precision
from meshtrain.problem import Problem
from meshtrain.replicas import SyncConfig
from meshtrain.run import RunSpec, TrainConfig

__all__ = ["NEEDS", "Needs", "no_effect_problems"]


@dataclasses.dataclass(frozen=True)
class Needs:
    """A setting that has an effect only while `feature` is on.

    Args:
        field: the setting as the CLI names it without dashes (``loss_scale_init``,
            ``gpt.rope_theta``); its flag is ``--`` and the field with dashes (``--no-`` for a
            switch that is on by default).
        at: where a `RunSpec` holds it, as dotted attributes (``precision.loss_scale_init``;
            ``model.NAME`` for a field of the model config).
        feature: what the setting belongs to, in a few words (``fp16's loss scaling``).
        on: ``run → bool``: whether the feature is on in `run`.
        off: ``run → str``: the run's setting that leaves it off (``under --precision fp32``).
        fix: what would make the setting count (``use --precision fp16``).
        example: ``(value, turn_off, turn_on)``: a value other than the default, and two sets
            of changes (dotted `at` paths → values) that leave the feature off and turn it on
            in the smallest run of the table's test.
        family: for a model field, the model family whose config has it.
        quiet: values never refused: they ask for less of the feature, which its absence
            already gives (``--eval-every 0``, evaluating only at the end).
    """

    field: str
    at: str
    feature: str
    on: Callable[[RunSpec], bool]
    off: Callable[[RunSpec], str]
    fix: str
    example: tuple[object, dict, dict]
    family: str | None = None
    quiet: tuple = ()

    @property
    def default(self) -> object:
        """The setting's default: its config dataclass field's."""
        section, name = self.at.rsplit(".", 1)
        owner = families()[str(self.family)].config if section == "model" else _SECTIONS[section]
        return {f.name: f.default for f in dataclasses.fields(owner)}[name]

    @property
    def flag(self) -> str:
        """The flag that sets it: ``--loss-scale-init``, ``--no-error-feedback``."""
        name = self.field.replace("_", "-")
        if self.default is True:
            head, _, tail = name.rpartition(".")
            return f"--{head}{'.' if head else ''}no-{tail}"
        return f"--{name}"

    def value(self, run: RunSpec) -> object:
        """The setting's value in `run`; None where the run has no such setting (another
        model family)."""
        section, name = self.at.rsplit(".", 1)
        holder = getattr(run, section)
        if section == "model" and not isinstance(holder, families()[str(self.family)].config):
            return None
        return getattr(holder, name, None)

    def problem(self, run: RunSpec) -> Problem | None:
        """The `Problem` of `run` (resolved) when it changes the setting with the feature off."""
        value = self.value(run)
        if value is None or value == self.default or value in self.quiet or self.on(run):
            return None
        message = (
            f"has no effect {self.off(run)}: it belongs to {self.feature}; drop {self.flag} or "
            f"{self.fix}"
        )
        return Problem(self.field, value, message)


def no_effect_problems(run: RunSpec) -> list[Problem]:
    """One `Problem` per setting of `run` that differs from its default while the feature it
    belongs to is off (`NEEDS`).

    Args:
        run: the run; its mesh may be axis sizes alone.

    Returns:
        The problems, in the table's order; an empty list when every setting counts.
    """
    run = run.resolved()
    return [p for needs in NEEDS if (p := needs.problem(run)) is not None]


# The config class of each part of a `RunSpec` a row's `at` starts with (but the model's).
_SECTIONS: dict[str, type] = {
    "precision": Precision,
    "offload": Offload,
    "pipeline": PipelineConfig,
    "rules": Rules,
    "sync": SyncConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
}


def _model(field: str, *values: str) -> Callable[[RunSpec], bool]:
    """``run → the model config's field is one of values``."""
    return lambda run: getattr(run.model, field, None) in values


def _with_model(family: str, field: str, note: str = "") -> Callable[[RunSpec], str]:
    """``run → "with --gpt.style gpt2"``, the model field that leaves a feature off."""
    flag = f"--{family}.{field.replace('_', '-')}"
    return lambda run: f"with {flag} {getattr(run.model, field, None)}{note}"


def _policy(run: RunSpec) -> str:
    """The run's precision policy, ``auto`` read from its model."""
    return run.precision.resolved(run.model)


def _scales(run: RunSpec) -> bool:
    """Whether the step scales the loss."""
    return run.loss_scaling


def _unscaled(run: RunSpec) -> str:
    """The setting that leaves the loss unscaled."""
    if _policy(run) == "fp16":
        return "with --loss-scale off"
    return f"under --precision {_policy(run)}"


def _pipelined(run: RunSpec) -> bool:
    """Whether the mesh has ``pipe > 1``."""
    return run.sizes.get(PIPE, 1) > 1


def _no_pipe(run: RunSpec) -> str:
    """The mesh that pipelines nothing."""
    return f"on a mesh with pipe={run.sizes.get(PIPE, 1)}"


def _optimizer(*names: str) -> Callable[[RunSpec], bool]:
    """``run → the optimizer is one of names``."""
    return lambda run: run.optim.optimizer in names


def _with_optimizer(run: RunSpec) -> str:
    """The optimizer that leaves a feature off."""
    return f"with --optimizer {run.optim.optimizer}"


def _held_out(run: RunSpec) -> bool:
    """Whether the data holds evaluation examples (unknown for shapes alone: yes)."""
    data = run.data
    if isinstance(data, DataConfig):
        return data.val_fraction > 0 or bool(data.eval_path)
    return getattr(data, "num_val", 1) > 0


def _packed(run: RunSpec) -> bool:
    """Whether batches are packed documents (a `DataConfig` of prepared tokens, or data whose
    batches carry segment ids)."""
    data = run.data
    if isinstance(data, DataConfig):
        return data.source == "tokens" and data.packing
    return run.data_spec.packed


def _said(text: str) -> Callable[[RunSpec], str]:
    """``run → text``, for a feature whose off setting is always the same."""
    return lambda run: text


_FP16 = {"precision.policy": "fp16"}
_PIPE = {"mesh": {PIPE: 2, "data": 4}}
_NOT_ADAM = {"optim.optimizer": "sgd"}

NEEDS: tuple[Needs, ...] = (
    Needs(
        "loss_scale",
        "precision.loss_scale",
        "fp16's loss scaling",
        lambda run: _scales(run) or _policy(run) == "fp16",
        lambda run: f"under --precision {_policy(run)}",
        "use --precision fp16",
        ("off", {}, _FP16),
    ),
    Needs(
        "loss_scale_init",
        "precision.loss_scale_init",
        "fp16's loss scaling",
        _scales,
        _unscaled,
        "use --precision fp16 (with --loss-scale auto or dynamic)",
        (1024.0, {}, _FP16),
    ),
    Needs(
        "loss_scale_period",
        "precision.loss_scale_period",
        "fp16's loss scaling",
        _scales,
        _unscaled,
        "use --precision fp16 (with --loss-scale auto or dynamic)",
        (100, {"precision.policy": "fp16", "precision.loss_scale": "off"}, _FP16),
    ),
    Needs(
        "offload_memory_kind",
        "offload.memory_kind",
        "optimizer offload",
        lambda run: run.offload.active,
        _said("with --offload none"),
        "add --offload optimizer",
        ("unpinned_host", {}, {"offload.optimizer": True}),
    ),
    Needs(
        "schedule",
        "pipeline.schedule",
        "pipelines",
        _pipelined,
        _no_pipe,
        "add pipe=N to --mesh (e.g. --mesh pipe=2,data=4)",
        ("1f1b", {}, _PIPE),
    ),
    Needs(
        "microbatches",
        "pipeline.microbatches",
        "pipelines",
        _pipelined,
        _no_pipe,
        "add pipe=N to --mesh (gradient accumulation is --accum-steps)",
        (8, {}, _PIPE),
    ),
    Needs(
        "repeats",
        "pipeline.repeats",
        "pipelines with several chunks per stage",
        _pipelined,
        _no_pipe,
        "add pipe=N to --mesh with --schedule interleaved-1f1b or circular",
        (2, {}, {**_PIPE, "pipeline.schedule": "circular"}),
    ),
    Needs(
        "gather_once",
        "pipeline.gather_once",
        "pipelines",
        _pipelined,
        _no_pipe,
        "add pipe=N to --mesh (e.g. --mesh pipe=2,fsdp=4)",
        (True, {}, _PIPE),
    ),
    Needs(
        "context_parallel",
        "rules.context_parallel",
        "context parallelism",
        lambda run: run.sizes.get(SEQ, 1) > 1,
        lambda run: f"on a mesh with seq={run.sizes.get(SEQ, 1)}",
        "add seq=N to --mesh (e.g. --mesh data=4,seq=2)",
        ("allgather", {}, {"mesh": {"data": 4, SEQ: 2}}),
    ),
    Needs(
        "error_feedback",
        "sync.error_feedback",
        "gradient compression",
        lambda run: run.sync.compresses,
        _said("with --grad-compression none"),
        "add --grad-compression (e.g. int8)",
        (False, {}, {"sync.grad_compression": "int8"}),
    ),
    Needs(
        "outer_lr",
        "sync.outer_lr",
        "the outer optimizers nesterov and adam",
        lambda run: run.sync.outer_optimizer != "average",
        _said("with --outer-optimizer average"),
        "use --outer-optimizer nesterov or adam (with --sync-every H)",
        (0.5, {}, {"sync.outer_optimizer": "nesterov", "sync.sync_every": 4}),
    ),
    Needs(
        "outer_momentum",
        "sync.outer_momentum",
        "the outer optimizers nesterov and adam",
        lambda run: run.sync.outer_optimizer != "average",
        _said("with --outer-optimizer average"),
        "use --outer-optimizer nesterov or adam (with --sync-every H)",
        (0.5, {}, {"sync.outer_optimizer": "adam", "sync.sync_every": 4}),
    ),
    Needs(
        "client_seed",
        "sync.client_seed",
        "federated averaging",
        lambda run: run.sync.federates,
        _said("without --client-fraction"),
        "add --client-fraction F (with --sync-every H)",
        (7, {}, {"sync.client_fraction": 0.5, "sync.sync_every": 4}),
    ),
    Needs(
        "b1",
        "optim.b1",
        "adamw and lamb",
        _optimizer("adamw", "lamb"),
        _with_optimizer,
        "use --optimizer adamw or lamb",
        (0.8, _NOT_ADAM, {}),
    ),
    Needs(
        "b2",
        "optim.b2",
        "adamw and lamb",
        _optimizer("adamw", "lamb"),
        _with_optimizer,
        "use --optimizer adamw or lamb",
        (0.99, {"optim.optimizer": "lars"}, {"optim.optimizer": "lamb"}),
    ),
    Needs(
        "eps",
        "optim.eps",
        "adamw and lamb",
        _optimizer("adamw", "lamb"),
        _with_optimizer,
        "use --optimizer adamw or lamb",
        (1e-6, _NOT_ADAM, {}),
    ),
    Needs(
        "momentum",
        "optim.momentum",
        "sgd and lars",
        _optimizer("sgd", "lars"),
        _with_optimizer,
        "use --optimizer sgd or lars",
        (0.5, {}, _NOT_ADAM),
    ),
    Needs(
        "tensorboard",
        "train.tensorboard",
        "the run directory's files",
        lambda run: bool(run.train.run_dir),
        _said("with an empty --run-dir"),
        "give --run-dir",
        (True, {"train.run_dir": ""}, {}),
    ),
    Needs(
        "hang_factor",
        "train.hang_factor",
        "the hang watchdog",
        lambda run: run.train.hang_floor_s > 0,
        _said("with --hang-floor-s 0 (the watchdog off)"),
        "set --hang-floor-s above 0",
        (10.0, {"train.hang_floor_s": 0.0}, {}),
    ),
    Needs(
        "eval_every",
        "train.eval_every",
        "evaluation",
        _held_out,
        _said("on data without held-out examples"),
        "hold some out (--data.val-fraction, --data.eval-path)",
        (50, {"data": DataConfig(val_fraction=0.0)}, {}),
        quiet=(0,),
    ),
    Needs(
        "eval_batches",
        "train.eval_batches",
        "evaluation",
        _held_out,
        _said("on data without held-out examples"),
        "hold some out (--data.val-fraction, --data.eval-path)",
        (2, {"data": DataConfig(val_fraction=0.0)}, {}),
    ),
    Needs(
        "gpt.rope_theta",
        "model.rope_theta",
        "rotary positions (llama style)",
        _model("style", "llama"),
        _with_model("gpt", "style", " (learned positions)"),
        "use --gpt.style llama",
        (500_000.0, {"model.style": "gpt2"}, {}),
        family="gpt",
    ),
    Needs(
        "gpt.restart_positions",
        "model.restart_positions",
        "packed batches",
        _packed,
        _said("on batches of plain windows"),
        "train on packed documents (--data.source tokens)",
        (False, {}, {"data": DataConfig(source="tokens", path="corpus")}),
        family="gpt",
    ),
    Needs(
        "moe.grouped_impl",
        "model.grouped_impl",
        "dropless dispatch",
        _model("dispatch", "dropless"),
        _with_model("moe", "dispatch"),
        "use --moe.dispatch dropless",
        ("tiled", {}, {"model.dispatch": "dropless"}),
        family="moe",
    ),
    Needs(
        "moe.capacity_factor",
        "model.capacity_factor",
        "capacity dispatch",
        _model("dispatch", "capacity"),
        _with_model("moe", "dispatch"),
        "use --moe.dispatch capacity",
        (2.0, {"model.dispatch": "dropless"}, {}),
        family="moe",
    ),
)
