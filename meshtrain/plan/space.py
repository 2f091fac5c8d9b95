"""The candidate layouts a planner searches: mesh factorisations, strategies, remat policies,
pipeline schedules and microbatches, whether a pipeline gathers its weights once, and what
lives in host memory."""

from __future__ import annotations

import dataclasses
import itertools

from meshtrain.mesh import AXES, DATA, EXPERT, FSDP, PIPE, TENSOR
from meshtrain.pipeline import PipelineConfig

REMATS = ("none", "save-dots", "full")
# Remat policies that move residuals to host memory → the policy whose residuals they are.
OFFLOAD_REMATS = {"offload-dots": "save-dots"}
# The pipeline schedules searched (gpipe and circular keep every microbatch's activations).
PIPELINE_SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1")
INTERLEAVED_REPEATS = 2  # chunks per stage tried for interleaved-1f1b


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout to model: axis sizes, a strategy preset, a remat policy, microbatches (and
    the ``expert`` axis of a mixture of experts); a pipeline's schedule, its chunks per stage
    (``repeats``, v) and whether it gathers its fsdp-split weights once per step; whether the
    optimizer state lives in host memory between steps (``offload``)."""

    pipe: int
    data: int
    fsdp: int
    tensor: int
    strategy: str
    remat: str = "none"
    microbatches: int = 0  # 0: no pipeline
    schedule: str = "1f1b"
    expert: int = 1
    repeats: int = 1
    gather_once: bool = False
    offload: bool = False

    @property
    def sizes(self) -> dict[str, int]:
        """Axis sizes in mesh order (every axis, size 1 where unused)."""
        named = {
            PIPE: self.pipe,
            DATA: self.data,
            FSDP: self.fsdp,
            EXPERT: self.expert,
            TENSOR: self.tensor,
        }
        return {a: named.get(a, 1) for a in AXES}

    @property
    def mesh(self) -> str:
        """``data=4,tensor=2`` (axes of size 1 left out; ``data=1`` for one device)."""
        parts = [f"{a}={s}" for a, s in self.sizes.items() if s > 1]
        return ",".join(parts) or "data=1"

    def describe(self) -> str:
        """``mesh · strategy · remat`` (and the schedule, its v, gather-once and optimizer
        offload when set)."""
        extra = ""
        if self.pipe > 1:
            extra += f" · {self.schedule} m={self.microbatches}"
            extra += f" v={self.repeats}" if self.repeats > 1 else ""
            extra += " · gather once" if self.gather_once else ""
        extra += " · optimizer on host" if self.offload else ""
        return f"{self.mesh} · {self.strategy} · remat {self.remat}{extra}"


def pipeline_config(cand: Candidate) -> PipelineConfig:
    """The `PipelineConfig` a candidate runs (the defaults while pipe = 1: the run check
    refuses pipeline settings on a mesh without pipe, `meshtrain.effect`)."""
    if cand.pipe == 1:
        return PipelineConfig()
    return PipelineConfig(
        schedule=cand.schedule,
        microbatches=cand.microbatches,
        repeats=cand.repeats,
        gather_once=cand.gather_once,
    )


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    n: int,
    *,
    max_pipe: int | None = None,
    max_tensor: int | None = None,
    remats: tuple[str, ...] = REMATS,
    microbatch_factors: tuple[int, ...] = (2, 4),
    experts: tuple[int, ...] = (1,),
    layers: int | None = None,
    schedules: tuple[str, ...] = PIPELINE_SCHEDULES,
) -> list[Candidate]:
    """Every layout of n devices over pipe × data × fsdp × expert × tensor.

    Strategies are not repeated where they coincide: dp and zero1 keep fsdp = 1, fsdp keeps
    data = 1 (it shards over both batch axes anyway), hsdp needs both; "+tp" is added
    whenever tensor > 1. A pipeline runs each of `schedules` with `microbatch_factors` × pipe
    microbatches: 1f1b and zb-h1 with one chunk per stage, interleaved-1f1b with v = 2 where
    the layers divide into pipe × 2 chunks (and the microbatches are a multiple of pipe); with
    fsdp > 1 each both gathering the weights per microbatch and once per step.

    Args:
        n: devices.
        max_pipe, max_tensor: largest pipe and tensor sizes to try (None: n).
        remats: remat policies to try.
        microbatch_factors: microbatches per stage to try when pipe > 1.
        experts: ``expert`` axis sizes to try (a mixture of experts: divisors of its
            experts); the expert axis splits the batch rows beside data and fsdp.
        layers: the model's stacked layers (None: interleaved-1f1b is not tried).
        schedules: the pipeline schedules to try when pipe > 1.

    Returns:
        The candidates.
    """
    micro_f = microbatch_factors
    pipelines = (tuple(schedules), layers)
    out: list[Candidate] = []
    for pipe in divisors(n):
        if max_pipe and pipe > max_pipe:
            continue
        for tensor in divisors(n // pipe):
            if max_tensor and tensor > max_tensor:
                continue
            for expert in experts:
                if (n // (pipe * tensor)) % expert:
                    continue
                rest = n // (pipe * tensor * expert)
                out += _splits(pipe, tensor, expert, rest, remats, micro_f, pipelines)
    return out


def _pipelines(pipe: int, fsdp: int, m: int, schedules, layers) -> list[dict]:
    """The pipeline settings to try for one layout: schedule, repeats and gather-once."""
    if pipe == 1:
        return [{}]
    out = []
    for schedule in schedules:
        if schedule == "interleaved-1f1b":
            v = INTERLEAVED_REPEATS
            if layers is None or layers % (pipe * v) or m % pipe:
                continue
        else:
            v = 1
        for once in (False, True) if fsdp > 1 else (False,):
            out.append({"schedule": schedule, "repeats": v, "gather_once": once})
    return out


def _splits(pipe, tensor, expert, rest, remats, micro_f, pipelines) -> list[Candidate]:
    """The candidates that split `rest` devices over data and fsdp."""
    splits = [("dp", rest, 1), ("zero1", rest, 1), ("fsdp", 1, rest)]
    splits += [("hsdp", d, rest // d) for d in divisors(rest) if 1 < d < rest]
    if rest == 1:
        splits = [("dp", 1, 1)]
    tp = "+tp" if tensor > 1 else ""
    micro = [f * pipe for f in micro_f] if pipe > 1 else [0]
    return [
        Candidate(pipe, data, fsdp, tensor, strategy + tp, remat, m, expert=expert, **pl)
        for (strategy, data, fsdp), remat, m in itertools.product(splits, remats, micro)
        for pl in _pipelines(pipe, fsdp, m, *pipelines)
    ]
