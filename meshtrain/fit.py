"""Will this run fit: its memory per device, as the planner models it, against the devices'.

The estimate is the planner's (`meshtrain.plan.analytic.model_candidate`): parameters,
gradients and optimizer state at their layouts, the activations kept under the remat policy
and pipeline schedule, and the logits, per device; context parallelism divides the last two
over ``seq``. Every size is a Python int or float, so no width overflows.

The capacity is, in this order: ``MESHTRAIN_DEVICE_MEMORY`` (a size such as ``16GB``; for
tests, or a device that reports nothing), the device's ``memory_stats()["bytes_limit"]`` (GPUs),
or on CPU the host's available memory (``MemAvailable``) shared by this process's devices.
A run over it is refused with the settings that would bring it under; one above
`CLOSE` of it gets a warning. `meshtrain.check.check_run` runs the check (this module adds
`fit_problems` to its ``DEVICE_CHECKS`` when meshtrain is imported).
"""

from __future__ import annotations

import dataclasses
import os

from meshtrain._log import LOG
from meshtrain._units import fmt_bytes
from meshtrain.check import DEVICE_CHECKS
from meshtrain.composition import model_name
from meshtrain.mesh import DATA, EXPERT, FSDP, PIPE, SEQ, TENSOR
from meshtrain.problem import Problem

__all__ = ["CLOSE", "ENV", "Capacity", "capacity", "estimate", "fit_problems"]

ENV = "MESHTRAIN_DEVICE_MEMORY"
CLOSE = 0.75  # above this share of the capacity a run is warned about (the estimate runs low)
_REMATS = ("none", "full", "save-dots", "offload-dots")  # the presets the planner models
_PROFILES = {"gpu": "h100", "tpu": "tpu-v5e"}  # whose dispatch rules an MoE estimate uses


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Bytes one device can hold, and where the figure comes from."""

    bytes: float
    source: str


def capacity(devices) -> Capacity | None:
    """The memory of one of `devices` (see the module docstring); None where nothing says.

    Args:
        devices: the run's devices (a mesh's ``devices.flat``).

    Returns:
        A `Capacity`, or None.

    Raises:
        ValueError: ``MESHTRAIN_DEVICE_MEMORY`` is not a size.
    """
    given = os.environ.get(ENV, "").strip()
    if given:
        from meshtrain.plan.command import parse_bytes

        try:
            return Capacity(parse_bytes(given), ENV)
        except ValueError:
            raise ValueError(
                f"{ENV}={given!r}: not a size; write a number with a unit, e.g. 16GB or 512MiB"
            ) from None
    device = devices[0]
    if device.platform != "cpu":
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        limit = (stats or {}).get("bytes_limit")
        return Capacity(float(limit), "the device's bytes_limit") if limit else None
    free = _host_available()
    if free is None:
        return None
    shared = sum(d.process_index == device.process_index for d in devices)
    return Capacity(free / shared, f"{fmt_bytes(free)} of host memory available / {shared}")


def _host_available() -> int | None:
    """The host's available memory in bytes (``MemAvailable``; free pages where unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def estimate(run, abstract, platform: str = "cpu", **change):
    """The planner's model of a run's memory per device.

    Args:
        run: the resolved `RunSpec`.
        abstract: its abstract model, ``(graphdef, state)``.
        platform: the devices' platform (an MoE dispatch is priced as they run it).
        change: `Candidate` fields to change (``remat``, ``offload``, ...) and ``sizes``,
            ``strategy`` or ``accum_steps`` (what-ifs for the suggestions).

    Returns:
        A `meshtrain.plan.Modelled` (``peak`` is the bytes per device), or None for a model
        the planner does not describe (not a GPT or mixture of experts).
    """
    from flax import nnx

    from meshtrain.comm.expect import param_layouts
    from meshtrain.costmodel import profile
    from meshtrain.layout import rules_for
    from meshtrain.plan.analytic import model_candidate
    from meshtrain.plan.space import Candidate

    cfg = run.model_config
    backbone = getattr(cfg, "backbone", cfg)  # a mixture of experts' dense transformer
    if not all(hasattr(backbone, a) for a in ("d_model", "n_heads", "n_layers", "padded_vocab")):
        return None
    sizes = change.pop("sizes", run.sizes)
    strategy = change.pop("strategy", None)
    k = change.pop("accum_steps", run.train.accum_steps)
    rules = run.rules if strategy is None else rules_for(strategy)
    pipe, pipeline = sizes.get(PIPE, 1), run.pipeline
    cand = Candidate(
        pipe=pipe,
        data=sizes.get(DATA, 1),
        fsdp=sizes.get(FSDP, 1),
        tensor=sizes.get(TENSOR, 1),
        strategy=strategy or _preset(rules.name, sizes),
        remat=_remat(getattr(cfg, "remat", "none")),
        microbatches=(pipeline.microbatches or 2 * pipe) if pipe > 1 else 0,
        schedule=pipeline.schedule,
        expert=sizes.get(EXPERT, 1),
        repeats=pipeline.repeats,
        gather_once=pipeline.gather_once,
        offload=run.offload.optimizer,
    )
    cand = dataclasses.replace(cand, **change)
    params = nnx.split(nnx.merge(*abstract), nnx.Param, ...)[1]
    spec = run.data_spec
    m = model_candidate(
        cand,
        param_layouts(params, rules, sizes),
        cfg,
        batch=max(1, spec.batch_size // k),
        seq_len=spec.seq_len,
        device=profile(_PROFILES.get(platform, "cpu-sim")),
        optimizer=run.optim.optimizer,
        sync=run.sync if run.sync.local else None,
    )
    seq = sizes.get(SEQ, 1)  # the planner's candidates keep whole sequences on each device
    if seq > 1:
        split = {"activations": m.memory["activations"] / seq, "logits": m.memory["logits"] / seq}
        m = dataclasses.replace(m, memory={**m.memory, **split})
    return m


def _preset(name: str, sizes) -> str:
    """A preset strategy with the run's batch axes (every preset has the same ones)."""
    if name.split("+")[0] in ("dp", "fsdp", "hsdp", "zero1"):
        return name
    return "dp+tp" if sizes.get(TENSOR, 1) > 1 else "dp"


def _remat(policy: str) -> str:
    """The planner's nearest policy: named selections keep little more than ``full``."""
    return policy if policy in _REMATS else "full"


def fit_problems(run, abstract, cap: Capacity | None = None) -> list[Problem]:
    """A run whose memory per device exceeds the devices', as one `Problem` naming the
    estimate, the capacity and what would bring it under; a warning when it is close.

    Args:
        run: the resolved `RunSpec`; nothing is said for a mesh of axis sizes alone.
        abstract: its abstract model, ``(graphdef, state)``.
        cap: the capacity per device (None: `capacity` of the mesh's devices).

    Returns:
        The problems (at most one); an empty list when the run fits or nothing is known.
    """
    if not hasattr(run.mesh, "devices"):
        return []  # axis sizes alone (a planner's candidate): no devices to ask
    devices = list(run.mesh.devices.flat)
    try:
        cap = cap or capacity(devices)
    except ValueError as e:
        return [Problem(ENV, os.environ.get(ENV), str(e).split(": ", 1)[1])]
    if cap is None:
        return []
    platform = devices[0].platform
    try:
        m = estimate(run, abstract, platform)
    except (ValueError, NotImplementedError):
        return []  # a layout the planner cannot price (say, a schedule without its table)
    if m is None:
        return []
    need = m.peak
    held = f"{fmt_bytes(cap.bytes)} ({cap.source})"
    if need <= CLOSE * cap.bytes:
        return []
    if need <= cap.bytes:
        LOG.warning(
            f"memory: the run needs about {fmt_bytes(need)} per device, {need / cap.bytes:.0%} "
            f"of the {held} a device holds; it may not fit (the estimate is approximate)"
        )
        return []
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in m.memory.items() if v)
    cfg = run.model_config
    state = sum(v for k, v in m.memory.items() if k not in ("activations", "logits"))
    if state >= m.memory["activations"] + m.memory["logits"]:
        field, value = f"{model_name(cfg)}.d_model", getattr(cfg, "d_model", None)
    else:
        field, value = "data.batch_size", run.data_spec.batch_size
    fix = _fixes(run, abstract, platform, cap.bytes)
    message = (
        f"the run needs about {fmt_bytes(need)} per device ({parts}) but a device holds "
        f"{held}; {fix}"
    )
    return [Problem(field, value, message)]


def _fixes(run, abstract, platform: str, cap: float) -> str:
    """The settings that would bring the run under `cap`, each alone or all together."""
    name, sizes = model_name(run.model_config), run.sizes
    tried: list[tuple[str, dict]] = []
    if _remat(getattr(run.model_config, "remat", "none")) != "full":
        tried.append((f"--{name}.remat full", {"remat": "full"}))
    k = _accum(run, abstract, platform, cap)
    if k:
        tried.append((f"--accum-steps {k}", {"accum_steps": k}))
    ways = sizes.get(DATA, 1) * sizes.get(FSDP, 1)
    if ways > 1 and not run.rules.name.startswith("fsdp"):
        whole = {**sizes, DATA: 1, FSDP: ways}
        tp = "+tp" if sizes.get(TENSOR, 1) > 1 else ""
        mesh = ",".join(f"{a}={s}" for a, s in whole.items() if s > 1)
        tried.append(
            (f"--mesh {mesh} --strategy fsdp{tp}", {"sizes": whole, "strategy": "fsdp" + tp})
        )
    if platform != "cpu" and not run.offload.optimizer:  # on CPU the host is the device
        tried.append(("--offload optimizer", {"offload": True}))
    alone = [s for s, c in tried if _peak(run, abstract, platform, **c) <= cap]
    if alone:
        return "any of these brings it under: " + "; ".join(alone)
    if not tried:
        return "no setting of this model fits: use a smaller model or more devices"
    flags = " ".join(s for s, _ in tried)
    best = _peak(run, abstract, platform, **{k: v for _, c in tried for k, v in c.items()})
    if best <= cap:
        return f"together these bring it under: {flags}"
    still = f" (with {flags} still {fmt_bytes(best)})" if best < float("inf") else ""
    return f"no setting of this model fits{still}: use a smaller model or more devices"


def _peak(run, abstract, platform: str, **change) -> float:
    """The estimate's bytes per device with `change` (infinite where it cannot be priced)."""
    try:
        m = estimate(run, abstract, platform, **change)
    except (ValueError, NotImplementedError):
        m = None
    return float("inf") if m is None else m.peak


def _accum(run, abstract, platform: str, cap: float) -> int:
    """The fewest accumulation steps beyond the run's that fit, else the most the batch
    allows (0: the batch allows no more)."""
    k, b = run.train.accum_steps, run.data_spec.batch_size
    ways = run.rules.batch_ways(run.sizes)
    more = 0
    while b % (ways * k * 2) == 0:
        k = more = k * 2
        if _peak(run, abstract, platform, accum_steps=k) <= cap:
            break
    return more


if fit_problems not in DEVICE_CHECKS:
    DEVICE_CHECKS.append(fit_problems)
