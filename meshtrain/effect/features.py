"""What the rows of `meshtrain.effect.NEEDS` read off a run (or the CLI's job): whether a
feature is on (``run → bool``) and the setting that leaves it off (``run → str``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshtrain.data.config import DataConfig
from meshtrain.mesh import PIPE
from meshtrain.run import RunSpec


def model(field: str, *values: str) -> Callable[[RunSpec], bool]:
    """``run → the model config's field is one of values``."""
    return lambda run: getattr(run.model, field, None) in values


def with_model(family: str, field: str, note: str = "") -> Callable[[RunSpec], str]:
    """``run → "with --gpt.style gpt2"``, the model field that leaves a feature off."""
    flag = f"--{family}.{field.replace('_', '-')}"
    return lambda run: f"with {flag} {getattr(run.model, field, None)}{note}"


def policy(run: RunSpec) -> str:
    """The run's precision policy, ``auto`` read from its model."""
    return run.precision.resolved(run.model)


def scales(run: RunSpec) -> bool:
    """Whether the step scales the loss."""
    return run.loss_scaling


def unscaled(run: RunSpec) -> str:
    """The setting that leaves the loss unscaled."""
    if policy(run) == "fp16":
        return "with --loss-scale off"
    return f"under --precision {policy(run)}"


def pipelined(run: RunSpec) -> bool:
    """Whether the mesh has ``pipe > 1``."""
    return run.sizes.get(PIPE, 1) > 1


def no_pipe(run: RunSpec) -> str:
    """The mesh that pipelines nothing."""
    return f"on a mesh with pipe={run.sizes.get(PIPE, 1)}"


def optimizer(*names: str) -> Callable[[RunSpec], bool]:
    """``run → the optimizer is one of names``."""
    return lambda run: run.optim.optimizer in names


def with_optimizer(run: RunSpec) -> str:
    """The optimizer that leaves a feature off."""
    return f"with --optimizer {run.optim.optimizer}"


def held_out(run: RunSpec) -> bool:
    """Whether the data holds evaluation examples (unknown for shapes alone: yes)."""
    data = run.data
    if isinstance(data, DataConfig):
        return data.val_fraction > 0 or bool(data.eval_path)
    return getattr(data, "num_val", 1) > 0


def packed(run: RunSpec) -> bool:
    """Whether batches are packed documents (a `DataConfig` of prepared tokens, or data whose
    batches carry segment ids)."""
    data = run.data
    if isinstance(data, DataConfig):
        return data.source == "tokens" and data.packing
    return run.data_spec.packed


def saves(job: Any) -> bool:
    """Whether the job keeps checkpoints (as ``meshtrain train`` decides it)."""
    return job.save and bool(job.train.run_dir or job.checkpoint.checkpoint_dir)


def unsaved(job: Any) -> str:
    """The job's setting that keeps no checkpoints."""
    return "with --no-save" if not job.save else "with an empty --run-dir"


def source(*names: str) -> Callable[[Any], bool]:
    """``job → its data source is one of names``."""
    return lambda job: job.data.source in names


def with_source(job: Any) -> str:
    """The data source that leaves a feature off."""
    return f"with --data.source {job.data.source}"


def tail_held_out(job: Any) -> bool:
    """Whether the job holds out the tail of its data (no ``--data.eval-path``)."""
    return not job.data.eval_path


def said(text: str) -> Callable[[RunSpec], str]:
    """``run → text``, for a feature whose off setting is always the same."""
    return lambda run: text
