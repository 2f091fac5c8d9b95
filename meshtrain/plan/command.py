"""``meshtrain plan``: pick a mesh for a GPT or a mixture of experts, print the reasoning,
optionally write it out.

    meshtrain plan --model 1.3b --devices 64 --device h100 --device-memory 80GB
    meshtrain plan --model mixtral-8x7b --devices 64 --device h100
    meshtrain plan --model tiny --devices 8 --device cpu-sim --device-memory 4MB --write plan.json
    meshtrain train --config plan.json --steps 2
    meshtrain plan --scaling --plot docs/scaling.png

Its flags are `meshtrain.cli.plan.PlanSettings`; this module does the work.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time

from meshtrain.plan.search import Plan, PlanError
from meshtrain.problem import RunCheckError
from meshtrain.replicas import SyncConfig

SEVEN_B = dict(d_model=4096, n_layers=32, n_heads=32, vocab_size=32000, seq_len=2048, batch=8)
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def sizes() -> dict[str, dict[str, int]]:
    """The model sizes the planner knows: the bench's and a Llama-2-7B shape."""
    from meshtrain.bench import SIZES

    return {**SIZES, "7b": SEVEN_B}


def moe_presets() -> dict:
    """The mixture-of-experts presets the planner knows (`meshtrain.models.moe_config`)."""
    from meshtrain.models.moe_config import PRESETS

    return PRESETS


def model_names() -> list[str]:
    """Every ``--model`` the planner takes: the GPT sizes, then the MoE presets."""
    return [*sizes(), *moe_presets()]


def defaults(name: str) -> dict[str, int]:
    """The default sequence length and batch of a named model."""
    if name in sizes():
        return sizes()[name]
    return {"seq_len": min(moe_presets()[name].max_seq_len, 4096), "batch": 8}


def parse_bytes(text: str) -> float:
    """``80GB`` → 8e10; ``512MiB`` → 2**29. A ValueError naming the fix otherwise."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"device_memory={text!r}: not a size; write a number with a unit, e.g. 80GB or 512MiB"
        )
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def gpt_config(name: str, seq_len: int, dtype: str):
    """The `GPTConfig` of a named size."""
    from meshtrain.models import GPTConfig

    s = sizes()[name]
    return GPTConfig(
        vocab_size=s["vocab_size"],
        max_seq_len=seq_len,
        d_model=s["d_model"],
        n_layers=s["n_layers"],
        n_heads=s["n_heads"],
        dtype=dtype,
        d_ff=11008 if name == "7b" else 0,
    )


def model_config(name: str, seq_len: int, dtype: str, dispatch: str = ""):
    """The `GPTConfig` of a size, or the `MoEConfig` of a preset at `seq_len` and `dtype`
    (with its ``dispatch`` replaced when given)."""
    if name not in moe_presets():
        if dispatch:
            raise PlanError(
                f"dispatch={dispatch!r}: only a mixture of experts dispatches; drop --dispatch "
                f"or choose an MoE model ({', '.join(moe_presets())})"
            )
        return gpt_config(name, seq_len, dtype)
    from meshtrain import validate
    from meshtrain.models.moe_dispatch import DISPATCH
    from meshtrain.problem import raise_if

    if dispatch:
        raise_if(validate.one_of("dispatch", dispatch, DISPATCH, example="capacity"))
    cfg = moe_presets()[name]
    return dataclasses.replace(
        cfg, max_seq_len=seq_len, dtype=dtype, dispatch=dispatch or cfg.dispatch
    )


def _profile(args):
    """The device profile, with ``--hosts`` setting the devices per node."""
    from meshtrain.costmodel import profile

    device = profile(args.device)
    if args.hosts:
        if args.hosts < 1 or args.devices % args.hosts:
            raise PlanError(
                f"hosts={args.hosts}: does not divide devices={args.devices}; give a host count "
                "that divides the devices"
            )
        device = dataclasses.replace(device, devices_per_node=args.devices // args.hosts)
    return device


def _size(x: float) -> str:
    """``27.4 GB`` / ``3.1 MB``."""
    return f"{x / 1e9:.3g} GB" if x >= 1e8 else f"{x / 1e6:.3g} MB"


def reasoning(plan: Plan, top: int) -> list[str]:
    """Lines explaining the best `top` candidates."""
    lines = [
        f"{plan.considered} layouts · {plan.failed_check} fail the run check · "
        f"{plan.over_memory} over the memory cap (modelled)"
        + (f" · {plan.over_memory_compiled} over it compiled" if plan.over_memory_compiled else "")
        + (" · offload not needed" if plan.offload and not plan.best.modelled.offloads else "")
        + f" · {plan.wall_s:.1f} s"
    ]
    if plan.offload and plan.best.modelled.offloads:
        lines.append(_offload_reason(plan))
    if plan.sync is not None:
        lines.append(
            "exchange, as asked: " + "; ".join(plan.sync.summary()) + ", priced instead of the "
            "gradient's all-reduce (the planner never picks it: it changes the optimisation)"
        )
    for i, c in enumerate(plan.ranked[:top], 1):
        m, e = c.modelled, c.modelled.estimate
        comm = (
            ", ".join(f"{b} {t * 1e3:.2f} ms ({e.algorithms[b]})" for b, t in e.comm_s.items() if t)
            or "none"
        )
        mem = f"{_size(m.peak)} modelled"
        if c.compiled_peak is not None:
            mem += f", {_size(c.compiled_peak)} compiled"
        lines.append(f"{i}. {m.candidate.describe()}: {e.total_s * 1e3:.2f} ms/step modelled")
        lines.append(
            f"   compute {e.compute_s * 1e3:.2f} ms · bubble {e.bubble:.0%} · exposed comm "
            f"{e.exposed_s * 1e3:.2f} ms · {comm}"
        )
        state = m.memory["parameters"] + m.memory["gradients"]
        parts = f"parameters, gradients and optimizer {_size(state + m.memory['optimizer'])}"
        if m.candidate.offload:
            parts = f"parameters and gradients {_size(state)}"
        act = f"activations {_size(m.memory['activations'])}, logits {_size(m.memory['logits'])}"
        update = (
            f"; the update holds the optimizer's {_size(m.memory['optimizer'])} in their place"
            if m.candidate.offload
            else ""
        )
        lines.append(f"   memory {mem} ({parts}, {act}{update})")
        if m.moe is not None:
            lines.append("   " + m.moe.describe(m.candidate.expert))
        if m.gather_once_bytes:
            lines.append("   " + _gathering(m))
        if m.host:
            lines.append("   " + _host(m))
    return lines


def _offload_reason(plan: Plan) -> str:
    """Why the best layout keeps state in host memory: nothing fits without it, or what it
    gains over the best layout that does not."""
    best = plan.best.modelled
    what = " and ".join(_HOST_PARTS[k] for k in best.host)
    if plan.without_offload is None:
        small = plan.smallest_without_offload
        need = (
            f"; the smallest needs {_size(small.peak)} per device ({small.candidate.describe()})"
            if small is not None
            else ""
        )
        return (
            f"offload: no layout fits in device memory without it{need}; the best keeps "
            f"{what} in host memory"
        )
    other = plan.without_offload
    gain = other.estimate.total_s / best.estimate.total_s - 1
    return (
        f"offload: keeping {what} in host memory is {gain:.0%} faster than the best layout "
        f"without it ({other.candidate.describe()}: {other.estimate.total_s * 1e3:.2f} ms/step)"
    )


_HOST_PARTS = {"optimizer": "the optimizer state", "activations": "the remat residuals"}


def _host(m) -> str:
    """What a candidate keeps in host memory and what moving it costs."""
    e = m.estimate
    parts = []
    if "activations" in m.host:
        moved = e.host_s.get("residuals to host", 0.0) + e.host_s.get("residuals to device", 0.0)
        parts.append(
            f"residuals {_size(m.host['activations'])} (written in the forward, fetched in the "
            f"backward: {moved * 1e3:.2f} ms of transfers)"
        )
    if "optimizer" in m.host:
        moved = e.host_s.get("optimizer to device", 0.0) + e.host_s.get("optimizer to host", 0.0)
        parts.append(
            f"optimizer {_size(m.host['optimizer'])} (fetched for the update, written back: "
            f"{moved * 1e3:.2f} ms)"
        )
    return f"host memory {', '.join(parts)} · {e.host_exposed_s * 1e3:.2f} ms exposed"


def _gathering(m) -> str:
    """How a pipeline stage gathers its fsdp-split weights, and the memory gather-once takes."""
    cost = _size(m.gather_once_bytes)
    if m.candidate.gather_once:
        return (
            f"stage weights gathered once per step: +{cost} per device (the stage's weights "
            "and their gradient whole)"
        )
    return (
        f"stage weights gathered per microbatch (gathering once per step would add {cost} "
        "per device)"
    )


def train_flags(plan: Plan, cfg, *, batch: int, seq_len: int, devices: int, simulate: bool):
    """The winner as `meshtrain train` flags (flag name without ``--`` → value)."""
    from meshtrain.models.moe_config import MoEConfig

    c = plan.best.candidate
    flags = {
        "mesh": c.mesh,
        "strategy": c.strategy,
        "devices": devices if simulate else 0,
    }
    if isinstance(cfg, MoEConfig):
        flags["model"] = "moe"
        flags.update(_moe_flags(dataclasses.replace(cfg, remat=c.remat)))
    else:
        flags.update(
            {
                "model": "gpt",
                "gpt.d-model": cfg.d_model,
                "gpt.n-layers": cfg.n_layers,
                "gpt.n-heads": cfg.n_heads,
                "gpt.vocab-size": cfg.vocab_size,
                "gpt.max-seq-len": cfg.max_seq_len,
                "gpt.dtype": cfg.dtype,
                "gpt.remat": c.remat,
            }
        )
        if cfg.d_ff:
            flags["gpt.d-ff"] = cfg.d_ff
    flags.update({"data.batch-size": batch, "data.seq-len": seq_len})
    if c.offload:
        flags["offload"] = "optimizer"
    if plan.sync is not None:
        flags.update(sync_flags(plan.sync))
    if c.pipe > 1:
        flags.update(schedule=c.schedule, microbatches=c.microbatches)
        if c.repeats > 1:
            flags["repeats"] = c.repeats
        if c.gather_once:
            flags["gather-once"] = True
    return flags


def _moe_flags(cfg) -> dict:
    """The ``--moe.*`` flags of the fields where `cfg` differs from the defaults."""
    default = type(cfg)()
    return {
        f"moe.{f.name.replace('_', '-')}": getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if getattr(cfg, f.name) != getattr(default, f.name)
    }


def asked_sync(args) -> SyncConfig | None:
    """The replicas' synchronisation `args` ask the plan to be priced with (None: none)."""
    gossip, fraction, every = args.gossip, args.client_fraction, args.sync_every
    if not (gossip or fraction or every):
        return None
    try:
        return SyncConfig(
            gossip=gossip or None, client_fraction=fraction or None, sync_every=every or None
        )
    except RunCheckError as e:
        raise PlanError(str(e.problems[0])) from None


def sync_flags(sync: SyncConfig) -> dict:
    """`sync`'s settings as `meshtrain train` flags."""
    fields = {"gossip": sync.gossip, "client-fraction": sync.client_fraction}
    flags = {k: v for k, v in fields.items() if v is not None}
    return {**flags, "sync-every": sync.sync_every} if sync.sync_every else flags


def run(args) -> int:
    """Plans (or projects, with ``--scaling``) and prints; returns the exit code."""
    if args.scaling:
        return run_scaling(args)
    if args.model not in model_names():
        raise PlanError(
            f"model={args.model!r}: unknown size; choose from {', '.join(model_names())}"
        )
    device = _profile(args)
    cap = parse_bytes(args.device_memory) if args.device_memory else device.memory
    if args.devices < 1:
        raise PlanError(f"devices={args.devices}: must be a positive integer")
    size = defaults(args.model)
    seq_len = args.seq_len or size["seq_len"]
    dtype = args.dtype or ("float32" if device.name == "cpu-sim" else "bfloat16")
    batch = args.batch or max(size["batch"], 2 * args.devices)
    simulate = args.devices <= 8 and args.confirm > 0
    if simulate:
        from meshtrain.mesh import simulate_devices

        simulate_devices(args.devices)
    from meshtrain.plan.search import plan

    cfg = model_config(args.model, seq_len, dtype, getattr(args, "dispatch", ""))
    sync = asked_sync(args)
    result = plan(
        cfg,
        devices=args.devices,
        batch=batch,
        seq_len=seq_len,
        device=device,
        memory_cap=cap,
        hosts=args.hosts or 1,
        confirm=args.confirm,
        offload=args.offload,
        sync=sync,
    )
    flags = train_flags(
        result,
        cfg,
        batch=batch,
        seq_len=seq_len,
        devices=args.devices,
        simulate=device.name == "cpu-sim",
    )
    if args.json:
        print(
            json.dumps(
                {
                    "best": result.best.candidate.describe(),
                    "train_flags": flags,
                    "modelled_step_s": result.best.modelled.estimate.total_s,
                    "host_bytes": result.best.modelled.host,
                    "sync": sync.summary() if sync else [],
                    "compiled": result.compiled,
                    "considered": result.considered,
                    "wall_s": round(result.wall_s, 2),
                }
            )
        )
    else:
        mem = (
            "compiled on simulated devices"
            if result.compiled
            else (f"analytic only: this process has fewer than {args.devices} devices")
        )
        print(
            f"meshtrain plan · {args.model} · {args.devices} × {device.name} · "
            f"{cap / 1e9:.3g} GB per device · batch {batch} × {seq_len} · memory {mem}"
        )
        print("\n".join(reasoning(result, args.top)))
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            json.dump(flags, f, indent=1)
        print(f"wrote {args.write}: meshtrain train --config {args.write}", file=sys.stderr)
    return 0


def run_scaling(args) -> int:
    """Prints (and plots) the scaling projections of a 1.3B and a 7B GPT."""
    from meshtrain.costmodel import profile
    from meshtrain.plan.scaling import plot, project

    device = profile(args.device)
    rows = []
    t0 = time.perf_counter()
    for name in ("1.3b", "7b"):
        cfg = gpt_config(name, 2048, "bfloat16")
        for r in project(cfg, device=device, seq_len=2048):
            rows.append({"model": name, **r})
    print(
        f"modelled on the {device.name} profile (no GPU step time measured: the compute "
        "term is the model's roofline); weak: 2 sequences of 2048 per device, strong: 512 "
        f"sequences per step; {time.perf_counter() - t0:.0f} s"
    )
    for r in rows:
        tps = f"{r['tokens_per_s']:.3g}" if r["tokens_per_s"] else "no layout"
        eff = f"{r['efficiency']:.2f}" if r["efficiency"] else "-"
        print(
            f"{r['model']:5} {r['regime']:6} {r['layout']:8} {r['devices']:5d}  tokens/s "
            f"{tps:>12}  efficiency {eff:>5}  {r['mesh'] or ''}"
        )
    if args.json:
        print(json.dumps(rows))
    if args.plot:
        where = plot(rows, args.plot, f"modelled scaling on {device.name}")
        print(f"plot: {where}" if where else "plot skipped: matplotlib is not installed")
    return 0
