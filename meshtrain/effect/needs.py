"""`Needs`: one row of the table of settings without effect (`meshtrain.effect.NEEDS`): a
setting, the feature it belongs to, and the one-line `Problem` for a run that changes it
while the feature is off."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from meshtrain.checkpoint import CheckpointConfig
from meshtrain.data.config import DataConfig
from meshtrain.layout import Rules
from meshtrain.models import families
from meshtrain.offload import Offload
from meshtrain.optim import OptimConfig
from meshtrain.pipeline import PipelineConfig
from meshtrain.precision import Precision
from meshtrain.problem import Problem
from meshtrain.replicas import SyncConfig
from meshtrain.run import RunSpec, TrainConfig

__all__ = ["Needs"]

# The config class of each part of a `RunSpec` a row's `at` starts with (but the model's).
_SECTIONS: dict[str, type] = {
    "precision": Precision,
    "offload": Offload,
    "pipeline": PipelineConfig,
    "rules": Rules,
    "sync": SyncConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "data": DataConfig,
}


@dataclasses.dataclass(frozen=True)
class Needs:
    """A setting that has an effect only while `feature` is on.

    Args:
        field: the setting as the CLI names it without dashes (``loss_scale_init``,
            ``gpt.rope_theta``); its flag is ``--`` and the field with dashes (``--no-`` for a
            switch that is on by default).
        at: where a `RunSpec` holds it, as dotted attributes (``precision.loss_scale_init``;
            ``model.NAME`` for a field of the model config); for scope ``job``, where the
            settings of ``meshtrain train`` (`meshtrain.cli.train.TrainJob`) hold it.
        feature: what the setting belongs to, in a few words (``fp16's loss scaling``).
        on: ``run → bool``: whether the feature is on in `run` (the job, for scope ``job``).
        off: ``run → str``: the run's setting that leaves it off (``under --precision fp32``).
        fix: what would make the setting count (``use --precision fp16``).
        example: ``(value, turn_off, turn_on)``: a value other than the default, and two sets
            of changes (dotted `at` paths → values) that leave the feature off and turn it on
            in the smallest run of the table's test.
        family: for a model field, the model family whose config has it.
        quiet: values never refused: they ask for less of the feature, which its absence
            already gives (``--eval-every 0``, evaluating only at the end).
        scope: ``run`` (read from a `RunSpec` by the run check) or ``job`` (read from the
            CLI's settings: what a `RunSpec` does not hold).
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
    scope: str = "run"

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

    def value(self, run) -> object:
        """The setting's value in `run` (the job, for scope ``job``); None where the run has
        no such setting (another model family)."""
        section, name = self.at.rsplit(".", 1)
        holder = getattr(run, section)
        if section == "model" and not isinstance(holder, families()[str(self.family)].config):
            return None
        return getattr(holder, name, None)

    def problem(self, run) -> Problem | None:
        """The `Problem` of `run` (resolved; the job, for scope ``job``) when it changes the
        setting with the feature off."""
        value = self.value(run)
        if value is None or value == self.default or value in self.quiet or self.on(run):
            return None
        message = (
            f"has no effect {self.off(run)}: it belongs to {self.feature}; drop {self.flag} or "
            f"{self.fix}"
        )
        return Problem(self.field, value, message)
