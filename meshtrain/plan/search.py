"""The planner: search layouts, prune, model, confirm by compiling, rank.

1. Enumerate candidates (`space.candidates`; for a mixture of experts the ``expert`` axis too).
2. Prune with the run check (`check_run` on the axis sizes and the abstract model: nothing is
   allocated) and with the analytic memory model against the cap.
   With offload allowed (and a host-link figure in the device profile), ``offload-dots`` is
   among the remat policies, and a candidate over the cap is modelled again with its
   optimizer state in host memory; host memory must hold what either moves there.
3. Rank the survivors by modelled step time (`analytic.model_candidate`); note the best
   without offload, so the reasoning can say what offload bought.
4. Confirm by compiling, best first, until `confirm` candidates compile within the cap. This
   needs as many devices as the plan: with fewer (say, 64 devices planned on a machine that
   simulates 8) memory stays analytic, and the plan says so. Compiling a scaled proxy instead
   was rejected: its memory would not be the plan's.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from flax import nnx

from meshtrain.check import check_run
from meshtrain.comm.expect import ParamLayout, param_layouts
from meshtrain.costmodel import DeviceProfile, lockstep_bubble
from meshtrain.layout import rules_for
from meshtrain.models.base import DataSpec
from meshtrain.models.moe_config import MoEConfig
from meshtrain.plan.analytic import Modelled, model_candidate
from meshtrain.plan.space import (
    OFFLOAD_REMATS,
    PIPELINE_SCHEDULES,
    REMATS,
    Candidate,
    candidates,
    divisors,
    pipeline_config,
)
from meshtrain.problem import Problem
from meshtrain.replicas import SyncConfig
from meshtrain.run import RunSpec
from meshtrain.state import abstract_model
from meshtrain.train import TrainConfig


class PlanError(ValueError):
    """No layout can work; the message says why and what would."""


@dataclasses.dataclass
class Choice:
    """A ranked candidate: its model and, where compiled, the compiled peak memory."""

    modelled: Modelled
    compiled_peak: float | None = None

    @property
    def candidate(self) -> Candidate:
        """The layout."""
        return self.modelled.candidate


@dataclasses.dataclass
class Plan:
    """The planner's answer.

    Attributes:
        ranked: survivors, best first (compiled ones confirmed within the cap).
        considered: candidates enumerated.
        failed_check: how many the run check rejected.
        over_memory: how many the analytic memory model rejected.
        over_memory_compiled: how many compiled above the cap.
        compiled: whether memory was confirmed by compiling.
        wall_s: planning time.
        offload: whether host offload was searched.
        sync: the replicas' synchronisation every layout was priced with (None: the
            gradient's all-reduce every step).
        without_offload: the fastest layout that fits keeping everything on the device
            (modelled); None when none does.
        smallest_without_offload: the layout needing the least device memory without
            offload (modelled).
    """

    ranked: list[Choice]
    considered: int
    failed_check: int
    over_memory: int
    over_memory_compiled: int
    compiled: bool
    wall_s: float
    offload: bool = False
    sync: SyncConfig | None = None
    without_offload: Modelled | None = None
    smallest_without_offload: Modelled | None = None

    @property
    def best(self) -> Choice:
        """The fastest layout that fits."""
        return self.ranked[0]

    @property
    def confirmed(self) -> list[Choice]:
        """The ranked choices whose memory was confirmed by compiling."""
        return [c for c in self.ranked if c.compiled_peak is not None]


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB" if x >= 1e8 else f"{x / 1e6:.3g} MB"


def plan(
    cfg,
    *,
    devices: int,
    batch: int,
    seq_len: int,
    device: DeviceProfile,
    memory_cap: float,
    hosts: int = 1,
    optimizer: str = "adamw",
    confirm: int = 2,
    max_compiles: int = 4,
    compile_fn: Callable | None = None,
    max_pipe: int | None = 8,
    max_tensor: int | None = None,
    remats: tuple[str, ...] = REMATS,
    microbatch_factors: tuple[int, ...] = (2, 4),
    schedules: tuple[str, ...] = PIPELINE_SCHEDULES,
    offload: bool = True,
    sync: SyncConfig | None = None,
) -> Plan:
    """Searches layouts of a GPT or a mixture of experts on `devices` devices (see the module
    docstring).

    Args:
        cfg: the `GPTConfig`, or a `MoEConfig` (whose ``expert`` axis is searched too, over
            the divisors of its experts).
        devices: devices to plan for.
        batch: global batch (sequences).
        seq_len: tokens per sequence.
        device: the device profile.
        memory_cap: bytes per device.
        hosts: hosts the devices are spread over (must divide `devices`).
        optimizer: the optimizer's name (its moments count in memory).
        confirm: compile this many of the best candidates (0: none).
        max_compiles: compile at most this many in all (those over the cap included).
        compile_fn: ``(candidate) -> compiled peak bytes``; None compiles the real train step
            when this process has `devices` devices, and otherwise confirms nothing.
        max_pipe, max_tensor: largest pipe and tensor sizes (tensor defaults to one node).
        remats: remat policies to try.
        microbatch_factors: pipeline microbatches per stage to try.
        schedules: pipeline schedules to try (interleaved-1f1b with v = 2 where the layers
            allow; with fsdp > 1 each also gathering the stage's weights once per step).
        offload: also try host offload (``offload-dots``, and the optimizer state of a
            layout over the cap) where the profile has a host-link figure.
        sync: price every layout with these replicas stepping apart (gossip, federated
            averaging, local SGD) instead of the gradient's all-reduce; layouts the run check
            refuses with it (no replicas, a graph the replicas cannot form) are dropped. It
            changes the optimisation, so the planner never picks one itself.

    Returns:
        A `Plan`.

    Raises:
        PlanError: bad input, no layout passing the run check, or none fitting the cap (the
            message names the smallest memory that would fit).
    """
    t0 = time.perf_counter()
    _check_inputs(devices, hosts, memory_cap, batch, seq_len)
    offload = offload and device.host is not None
    search = _Search(cfg, devices, batch, seq_len, device, memory_cap, optimizer, sync, offload)
    cands = _candidates(search, max_pipe, max_tensor, remats, microbatch_factors, schedules)
    survey = _survey(search, cands)
    compile_fn = compile_fn or _default_compile(cfg, search.spec, devices, sync)
    return _ranked(search, survey, compile_fn, confirm, max_compiles, started=t0)


@dataclasses.dataclass(frozen=True)
class _Search:
    """One search's fixed inputs: the model, the workload, the device and its memory cap."""

    cfg: Any
    devices: int
    batch: int
    seq_len: int
    device: DeviceProfile
    memory_cap: float
    optimizer: str
    sync: SyncConfig | None
    offload: bool  # host offload searched (asked for, and the profile has a host link)

    @property
    def spec(self) -> DataSpec:
        """The language-model data every layout is checked and compiled with."""
        return DataSpec("lm", self.batch, self.seq_len, self.cfg.vocab_size, None)


@dataclasses.dataclass(frozen=True)
class _Survey:
    """What the run check and the analytic model made of the candidates."""

    considered: int
    failed_check: int
    over_memory: int
    modelled: list[Modelled]


def _check_inputs(devices: int, hosts: int, memory_cap: float, batch: int, seq_len: int) -> None:
    """Raises a `PlanError` for a device or host count, cap or workload that cannot be planned."""
    if not isinstance(devices, int) or devices < 1:
        raise PlanError(f"devices={devices!r}: must be a positive integer")
    if hosts < 1 or devices % hosts:
        raise PlanError(
            f"hosts={hosts}: does not divide devices={devices}; give a host count that divides "
            "the devices (each host holds the same number)"
        )
    if memory_cap <= 0:
        raise PlanError(f"device_memory={memory_cap}: must be positive, e.g. 80GB")
    if batch < 1 or seq_len < 1:
        raise PlanError(f"batch={batch}, seq_len={seq_len}: must be positive")


def _candidates(
    search: _Search,
    max_pipe: int | None,
    max_tensor: int | None,
    remats: tuple[str, ...],
    microbatch_factors: tuple[int, ...],
    schedules: tuple[str, ...],
) -> list[Candidate]:
    """The layouts to search (with the offload remat policies where offload is searched)."""
    cfg = search.cfg
    if search.offload:
        remats = (*remats, *(r for r in OFFLOAD_REMATS if r not in remats))
    return candidates(
        search.devices,
        max_pipe=max_pipe,
        max_tensor=max_tensor or search.device.devices_per_node,
        remats=remats,
        microbatch_factors=microbatch_factors,
        experts=tuple(divisors(cfg.n_experts)) if isinstance(cfg, MoEConfig) else (1,),
        layers=getattr(cfg, "n_layers", None),
        schedules=schedules,
    )


def _survey(search: _Search, cands: list[Candidate]) -> _Survey:
    """Runs the check on every candidate and models those that pass; a `PlanError` when none
    does."""
    passed, reasons = _run_check(search, cands)
    if not passed:
        why, _ = reasons.most_common(1)[0] if reasons else ("no candidates", 0)
        raise PlanError(
            f"devices={search.devices}: none of {len(cands)} layouts passes the run check; the "
            f"most common problem: {why}"
        )
    modelled, over = _model_passed(search, passed)
    failed = sum(reasons.values())
    return _Survey(len(cands), failed, over, modelled)


def _run_check(
    search: _Search, cands: list[Candidate]
) -> tuple[list[tuple[Candidate, list[ParamLayout]]], collections.Counter]:
    """The candidates the run check passes, each with its parameters' layouts (checked on the
    abstract model: nothing is allocated), and how often each first problem failed the rest."""
    cfg = search.cfg
    graphdef, abstract = abstract_model(lambda: cfg.build(rngs=nnx.Rngs(0)))
    param_vars = nnx.split(nnx.merge(graphdef, abstract), nnx.Param, ...)[1]
    checked_only = RunSpec(
        model=cfg, data=search.spec, train=TrainConfig(run_dir=""), sync=search.sync or SyncConfig()
    )  # writes nothing
    reasons: collections.Counter = collections.Counter()
    layouts_cache: dict = {}
    checked: dict = {}
    passed = []
    for cand in cands:
        rules = rules_for(cand.strategy)
        pc = pipeline_config(cand)
        key = (cand.mesh, cand.strategy, pc)
        if key not in checked:
            run = checked_only.replace(mesh=cand.sizes, rules=rules, pipeline=pc)
            problems = check_run(run, abstract=(graphdef, abstract))
            checked[key] = problems or _schedule_problems(cand)
        if checked[key]:
            p = checked[key][0]
            reasons[f"{p.field}={p.value!r}: {p.message}"] += 1
            continue
        lk = (cand.mesh, cand.strategy)
        if lk not in layouts_cache:
            layouts_cache[lk] = param_layouts(param_vars, rules, cand.sizes)
        passed.append((cand, layouts_cache[lk]))
    return passed, reasons


def _model_passed(
    search: _Search, passed: list[tuple[Candidate, list[ParamLayout]]]
) -> tuple[list[Modelled], int]:
    """Every passing candidate modelled (again with its optimizer state on host where offload
    is searched and it does not fit without), and how many fit in neither way."""
    modelled: list[Modelled] = []
    over = 0
    for cand, layouts in passed:
        variants = [cand, dataclasses.replace(cand, offload=True)] if search.offload else [cand]
        for c in variants:
            m = model_candidate(
                c,
                layouts,
                dataclasses.replace(search.cfg, remat=c.remat),
                batch=search.batch,
                seq_len=search.seq_len,
                device=search.device,
                optimizer=search.optimizer,
                sync=search.sync,
            )
            modelled.append(m)
            if _fits(m, search.memory_cap, search.device):
                break  # the optimizer state moves to host only where the layout needs it
        else:
            over += 1
    return modelled, over


def _ranked(
    search: _Search,
    survey: _Survey,
    compile_fn: Callable | None,
    confirm: int,
    max_compiles: int,
    started: float,
) -> Plan:
    """The plan: the layouts that fit, fastest first, the best confirmed by compiling."""
    fits = _fitting(search, survey.modelled)
    ranked, over_compiled = _confirm(fits, compile_fn, confirm, max_compiles, search.memory_cap)
    return Plan(
        ranked=ranked,
        considered=survey.considered,
        failed_check=survey.failed_check,
        over_memory=survey.over_memory,
        over_memory_compiled=over_compiled,
        compiled=compile_fn is not None and confirm > 0,
        wall_s=time.perf_counter() - started,
        offload=search.offload,
        sync=search.sync,
        without_offload=next((m for m in fits if not m.offloads), None),
        smallest_without_offload=min(
            (m for m in survey.modelled if not m.offloads), key=lambda m: m.peak, default=None
        ),
    )


def _fitting(search: _Search, modelled: list[Modelled]) -> list[Modelled]:
    """The modelled layouts that fit, fastest first; a `PlanError` naming the smallest when
    none does."""
    fits = [m for m in modelled if _fits(m, search.memory_cap, search.device)]
    if not fits:
        small = min(modelled, key=lambda m: m.peak)
        raise PlanError(
            f"device_memory={_gb(search.memory_cap)}: no layout of {search.devices} devices "
            f"fits; the smallest needs {_gb(small.peak)} per device "
            f"({small.candidate.describe()}); give at least "
            f"--device-memory {_gb(small.peak).replace(' ', '')} or more devices"
        )
    fits.sort(key=lambda m: m.estimate.total_s)
    return fits


def _confirm(
    fits: list[Modelled],
    compile_fn: Callable | None,
    confirm: int,
    max_compiles: int,
    memory_cap: float,
) -> tuple[list[Choice], int]:
    """Compiles the best layouts until `confirm` fit the cap (at most `max_compiles` tries):
    the choices, confirmed ones first, and how many compiled above the cap."""
    ranked: list[Choice] = []
    over_compiled = confirmed = tries = 0
    smallest: tuple[float, str] | None = None
    for m in fits:
        choice = Choice(m)
        if compile_fn is not None and confirmed < confirm and tries < max_compiles:
            tries += 1
            peak = compile_fn(m.candidate)
            choice.compiled_peak = peak
            if smallest is None or peak < smallest[0]:
                smallest = (peak, m.candidate.describe())
            if peak > memory_cap:
                over_compiled += 1
                continue
            confirmed += 1
        elif compile_fn is not None and confirm and not confirmed:
            continue  # no compiled proof left to give: keep only confirmed layouts
        ranked.append(choice)
    if compile_fn is not None and confirm and not confirmed:
        assert smallest is not None  # a compile ran: confirm > 0 and no layout confirmed
        peak, where = smallest
        raise PlanError(
            f"device_memory={_gb(memory_cap)}: the {tries} best layouts the model admitted "
            f"compiled above the cap; the smallest needs {_gb(peak)} per device ({where}); "
            f"give at least --device-memory {_gb(peak).replace(' ', '')}"
        )
    if compile_fn is not None:
        ranked = [c for c in ranked if c.compiled_peak is not None] + [
            c for c in ranked if c.compiled_peak is None
        ]
    return ranked, over_compiled


def _fits(m: Modelled, memory_cap: float, device: DeviceProfile) -> bool:
    """Whether a modelled candidate fits the device memory cap and its host's memory."""
    return m.peak <= memory_cap and m.host_peak <= device.host_memory


def _schedule_problems(cand: Candidate) -> list[Problem]:
    """What keeps the cost model from timing a candidate's schedule (no table for it)."""
    if cand.pipe == 1:
        return []
    try:
        lockstep_bubble(cand.schedule, cand.pipe, cand.microbatches, cand.repeats)
    except (ValueError, NotImplementedError) as e:
        why = str(e).removeprefix(f"schedule={cand.schedule!r}: ")
        return [Problem("schedule", cand.schedule, why)]
    return []


def _default_compile(
    cfg, spec: DataSpec, devices: int, sync: SyncConfig | None = None
) -> Callable | None:
    """Compiles a candidate's real train step (with `sync`) when this process has exactly
    `devices` devices; None otherwise (memory then stays analytic)."""
    import jax

    if jax.device_count() != devices:
        return None

    def compile_peak(cand: Candidate) -> float:
        from meshtrain.comm.compile import compile_step
        from meshtrain.comm.inspector import compiled_memory
        from meshtrain.mesh import make_mesh
        from meshtrain.offload import Offload

        mesh = make_mesh(cand.mesh)
        model = dataclasses.replace(cfg, remat=cand.remat)
        pc = pipeline_config(cand)
        rules = rules_for(cand.strategy, mesh)
        run = RunSpec(
            model=model,
            data=spec,
            mesh=mesh,
            rules=rules,
            pipeline=pc,
            offload=Offload(optimizer=cand.offload),
            sync=sync or SyncConfig(),
        )
        compiled, _ = compile_step(run)
        return float(compiled_memory(compiled)["peak"])  # device bytes (host ones apart)

    return compile_peak
