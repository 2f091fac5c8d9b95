"""`PipelineConfig`, and what makes a pipeline unable to run on a model, mesh and batch."""

from __future__ import annotations

import dataclasses

from meshtrain import validate
from meshtrain._units import fmt_bytes
from meshtrain.pipeline.schedules import CHUNKED, SCHEDULES, schedule_problems
from meshtrain.problem import Problem


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig(validate.Checked):
    """How to pipeline over the mesh's ``pipe`` axis (while pipe = 1 each setting has no
    effect, and the run check refuses one changed from its default: `meshtrain.effect`).

    Args:
        schedule: ``gpipe``, ``circular`` (a gpipe loop round the stages v times), ``1f1b``,
            ``interleaved-1f1b`` (1F1B over v chunks per stage) or ``zb-h1`` (1F1B with the
            weight gradients deferred into the bubbles).
        microbatches: microbatches per step; 0 means 2 × pipe.
        repeats: chunks of layers per stage, v (circular and interleaved-1f1b).
        gather_once: gather each stage's weights split over ``fsdp`` once per step, before
            its first microbatch, and reduce-scatter their gradient once, after its last
            (ZeRO-2 style), instead of once per microbatch; costs the stage's whole weights
            (and their gradient) in memory on every device.
    """

    schedule: str = "gpipe"
    microbatches: int = 0
    repeats: int = 1
    gather_once: bool = False

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        v = validate
        return (
            v.one_of("schedule", self.schedule, SCHEDULES, example="1f1b")
            + v.non_negative("microbatches", self.microbatches, example=8, note="0 = 2 × pipe")
            + v.positive("repeats", self.repeats, example=2)
        )

    def describe(self, stages: int, gathered_bytes: float | None = None) -> str:
        """One line saying how the job pipelines (the CLI's run summary).

        Args:
            stages: the ``pipe`` axis size.
            gathered_bytes: with ``gather_once``, the bytes per device of a stage's weights
                gathered whole (`meshtrain.comm.expect.stage_weight_bytes`).

        Returns:
            e.g. "pipeline interleaved-1f1b · 4 stages · 16 microbatches · v=2 chunks per
            stage · gather once per step (+12.6 MB of weights per device)".
        """
        parts = [f"pipeline {self.schedule}", f"{stages} stages"]
        parts.append(f"{self.num_microbatches(stages)} microbatches")
        if self.schedule in CHUNKED:
            parts.append(f"v={self.repeats} chunks per stage")
        if self.gather_once:
            parts.append(
                f"gather once per step (+{fmt_bytes(gathered_bytes)} of weights per device)"
                if gathered_bytes
                else "stage weights gathered once per step (none is split over fsdp)"
            )
        return " · ".join(parts)

    def num_microbatches(self, pipe: int) -> int:
        """Microbatches per step on a mesh with `pipe` stages."""
        return self.microbatches or 2 * pipe

    def chunks_per_stage(self) -> int:
        """v: chunks of layers each stage holds (``repeats`` for the chunked schedules, else 1)."""
        return self.repeats if self.schedule in CHUNKED else 1


def pipeline_problems(
    config: PipelineConfig,
    *,
    pipe: int,
    batch_size: int,
    batch_ways: int,
    batch_axes: str = "data × fsdp",
    layers: int | None = None,
    layers_field: str = "layers",
    accum_steps: int = 1,
) -> list[Problem]:
    """What keeps a pipeline from running, before anything compiles.

    Args:
        config: the pipeline settings.
        pipe: stages (the mesh's pipe size).
        batch_size: rows the pipeline splits into microbatches (the batch of one
            accumulation step).
        batch_ways: devices each microbatch is split over (data × fsdp for the presets).
        batch_axes: the names of those axes, for messages.
        layers: the model's stacked layers, when known.
        layers_field: the config field that sets them (``gpt.n_layers``), named with its flag.
        accum_steps: the accumulation steps `batch_size` is one of: the lines name the batch
            the user gave (``batch_size × accum_steps``) and a multiple of it that splits.

    Returns:
        One `Problem` per thing wrong, each naming the field, the value and the fix.
    """
    m, v = config.num_microbatches(pipe), config.repeats
    problems = schedule_problems(config.schedule, pipe, m, v)
    if problems:
        return problems
    if layers is not None and layers % (pipe * v):
        k = pipe * v
        fix = f"use a multiple of {k} layers"
        if layers_field != "layers":
            flag = "--" + layers_field.replace("_", "-")
            fix = f"use {flag} {-(-layers // k) * k} (a multiple of {k}), or fewer stages"
        problems.append(
            Problem(
                layers_field,
                layers,
                f"not divisible by pipe × repeats = {pipe} × {v} = {k}: each stage needs "
                f"whole layers; {fix}",
            )
        )
    k = accum_steps
    given = batch_size * k  # the batch the user set
    per_step = f"/ accum_steps={k} = {batch_size} rows per accumulation step, " if k > 1 else ""
    if batch_size % m:
        problems.append(
            Problem(
                "data.batch_size",
                given,
                f"{per_step}not divisible by microbatches={m}; use a batch that is a multiple "
                f"of {m * k}",
            )
        )
    elif (batch_size // m) % batch_ways:
        problems.append(
            Problem(
                "data.batch_size",
                given,
                f"{per_step}/ microbatches={m} = {batch_size // m} rows per microbatch, not "
                f"divisible by {batch_axes} = {batch_ways} devices; use a batch that is a "
                f"multiple of {m * batch_ways * k}",
            )
        )
    return problems
