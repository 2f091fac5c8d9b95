"""Scaling projections: modelled throughput and scaling efficiency from 8 to 1024 devices.

Two regimes, the curves the surveys draw: **weak scaling** keeps the batch per device fixed
(the global batch grows with the devices), **strong scaling** keeps the global batch fixed
(each device gets less). For each device count three layouts are modelled: DP (``data=N``),
FSDP (``fsdp=N``) and the planner's pick; each takes the faster of no remat and full remat
that fits the memory; a layout that fits under neither, or cannot split the batch (strong
scaling past 512 devices for DP and FSDP), is left out (None). Efficiency is throughput per
device relative to the smallest device count at which the same layout has a result.

Everything is modelled (`analytic.model_candidate` on a `DeviceProfile`): no GPU step time has
been measured for this project, so the compute term is the roofline of the model's FLOPs and
memory traffic, not a measurement.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from meshtrain.comm.expect import param_layouts
from meshtrain.costmodel import DeviceProfile
from meshtrain.layout import rules_for
from meshtrain.plan.analytic import model_candidate
from meshtrain.plan.search import PlanError, plan
from meshtrain.plan.space import Candidate
from meshtrain.state import abstract_model

DEVICE_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
LAYOUTS = ("dp", "fsdp", "planner")
COLORS = {"dp": "C0", "fsdp": "C1", "planner": "C2"}
SCALING_REMATS = ("none", "full")  # the same policies for every layout (and a faster search)


def _fixed(cfg, param_vars, n, strategy, *, batch, seq_len, device, cap):
    """The fastest fitting remat of DP (data=n) or FSDP (fsdp=n); None if none fits."""
    data, fsdp = (n, 1) if strategy == "dp" else (1, n)
    if batch % n:
        return None  # the batch does not split over n devices
    best = None
    for remat in SCALING_REMATS:
        cand = Candidate(1, data, fsdp, 1, strategy, remat)
        layouts = param_layouts(param_vars, rules_for(strategy), cand.sizes)
        m = model_candidate(
            cand,
            layouts,
            dataclasses.replace(cfg, remat=remat),
            batch=batch,
            seq_len=seq_len,
            device=device,
        )
        if m.peak <= cap and (best is None or m.estimate.total_s < best.estimate.total_s):
            best = m
    return best


def project(
    cfg,
    *,
    device: DeviceProfile,
    seq_len: int,
    per_device_batch: int = 2,
    global_batch: int = 512,
    counts: tuple[int, ...] = DEVICE_COUNTS,
    memory_cap: float | None = None,
) -> list[dict]:
    """Modelled throughput of DP, FSDP and the planner's pick at each device count.

    Args:
        cfg: the `GPTConfig`.
        device: the device profile.
        seq_len: tokens per sequence.
        per_device_batch: sequences per device (weak scaling).
        global_batch: sequences per step (strong scaling).
        counts: device counts.
        memory_cap: bytes per device (default: the profile's memory).

    Returns:
        One dict per (regime, layout, devices): ``tokens_per_s``, ``step_s``, ``efficiency``
        (throughput per device relative to the smallest count's, same layout and regime),
        ``layout`` (the mesh and strategy), or ``tokens_per_s`` None where nothing fits.
    """
    cap = memory_cap or device.memory
    graphdef, abstract = abstract_model(lambda: cfg.build(rngs=nnx.Rngs(0)))
    _, param_vars, _ = nnx.split(nnx.merge(graphdef, abstract), nnx.Param, ...)
    rows = []
    for regime in ("weak", "strong"):
        base: dict[str, float] = {}
        for n in counts:
            batch = per_device_batch * n if regime == "weak" else global_batch
            for name in LAYOUTS:
                if name == "planner":
                    try:
                        p = plan(
                            cfg,
                            devices=n,
                            batch=batch,
                            seq_len=seq_len,
                            device=device,
                            memory_cap=cap,
                            confirm=0,
                            remats=SCALING_REMATS,
                            microbatch_factors=(4,),
                        )
                        m = p.best.modelled
                    except PlanError:
                        m = None
                else:
                    m = _fixed(
                        cfg,
                        param_vars,
                        n,
                        name,
                        batch=batch,
                        seq_len=seq_len,
                        device=device,
                        cap=cap,
                    )
                row = {"regime": regime, "layout": name, "devices": n, "batch": batch}
                if m is None:
                    row.update(tokens_per_s=None, step_s=None, efficiency=None, mesh=None)
                else:
                    tps = batch * seq_len / m.estimate.total_s
                    base.setdefault(name, tps / n)
                    row.update(
                        tokens_per_s=tps,
                        step_s=m.estimate.total_s,
                        efficiency=tps / n / base[name],
                        mesh=m.candidate.describe(),
                    )
                rows.append(row)
    return rows


def plot(rows: list[dict], path: str, title: str = "") -> str | None:
    """Draws throughput and efficiency per regime; returns the path, or None without
    matplotlib (a dev dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    models = list(dict.fromkeys(r["model"] for r in rows)) if "model" in rows[0] else [""]
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.6 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, regime in enumerate(("weak", "strong")):
            ax = axes[i][j]
            for name in LAYOUTS:
                pts = [
                    (r["devices"], r["tokens_per_s"])
                    for r in rows
                    if r["regime"] == regime
                    and r["layout"] == name
                    and r.get("model", "") == model
                    and r["tokens_per_s"]
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=name, color=COLORS[name])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("devices")
            ax.set_ylabel("modelled tokens/s")
            ax.set_title(f"{model} {regime} scaling".strip())
            ax.grid(True, alpha=0.3)
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
