"""Compiled communication and memory per strategy against the analytic model, and the
planner's wall time. One JSON line per case on stdout.

For each layout the real train step of one GPT is compiled on 8 simulated CPU devices (nothing
runs) and inspected (`meshtrain.inspect`):

- ``comm_bytes``: every collective's buffer bytes per device per step, executions counted;
- ``ratio_to_analytic``: that over the analytic expectation of the layout (the bytes its
  parameters' layout requires: `meshtrain.comm.expect`); target ≤ 1.10;
- ``memory_over_ideal``: the compiled peak per device over (parameters + gradients +
  optimizer state) / N, the ideal of a fully sharded state with nothing else held.

Then the planner's wall time: 8 devices (a tiny GPT on the cpu-sim profile, memory confirmed
by compiling the best two), and 64 devices (a 1.3B GPT on H100, memory analytic: a process with
8 devices cannot compile a 64-device program).

    python benchmarks/comm.py            # GPT d=128, 4 layers, T=128, batch 32
    python benchmarks/comm.py --quick    # smaller: dp, fsdp and gpipe; the 64-device planner
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import meshtrain as mt  # noqa: E402
from meshtrain.costmodel import profile  # noqa: E402
from meshtrain.models.base import DataSpec  # noqa: E402
from meshtrain.plan import plan  # noqa: E402
from meshtrain.plan.command import gpt_config  # noqa: E402

LAYOUTS = [
    ("dp", "data=8", "dp"),
    ("fsdp", "fsdp=8", "fsdp"),
    ("hsdp", "data=2,fsdp=4", "hsdp"),
    ("zero1", "data=8", "zero1"),
    ("tp", "data=2,tensor=4", "tp"),
    ("2x2x2", "data=2,fsdp=2,tensor=2", "fsdp+tp"),
    ("pipeline-gpipe", "pipe=2,data=4", "dp"),
    ("pipeline-1f1b", "pipe=2,data=4", "dp"),
]
PIPELINES = {"pipeline-1f1b": mt.PipelineConfig(schedule="1f1b")}  # gpipe is the default
QUICK = ("dp", "fsdp", "pipeline-gpipe")


def emit(record: dict) -> None:
    """Prints one JSON line."""
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, fewer cases")
    args = parser.parse_args()
    if args.quick:
        cfg = mt.GPTConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16, vocab_size=64)
        spec, layouts = DataSpec("lm", 16, 16, 64, None), [x for x in LAYOUTS if x[0] in QUICK]
    else:
        cfg = mt.GPTConfig(d_model=128, n_layers=4, n_heads=4, max_seq_len=128, vocab_size=256)
        spec, layouts = DataSpec("lm", 32, 128, 256, None), LAYOUTS
    env = {"platform": jax.devices()[0].platform, "jax_version": jax.__version__}
    model = f"llama d={cfg.d_model} L={cfg.n_layers} T={spec.seq_len} batch={spec.batch_size}"
    for name, mesh_str, strategy in layouts:
        print(f"compiling {name} ...", file=sys.stderr, flush=True)
        mesh = mt.make_mesh(mesh_str)
        rules = mt.rules_for(strategy, mesh)
        pipeline = PIPELINES.get(name) or mt.PipelineConfig()
        r = mt.inspect(mt.RunSpec(model=cfg, data=spec, mesh=mesh, rules=rules, pipeline=pipeline))
        expected = sum(r.expectation.bytes.values())
        ideal = r.param_bytes * (1 + 1 + 2) / mesh.devices.size  # params, grads, 2 Adam moments
        emit(
            {
                "case": name,
                "mesh": mesh_str,
                "strategy": strategy,
                "model": model,
                **env,
                "comm_bytes": r.comm_bytes,
                "analytic_bytes": round(expected),
                "ratio_to_analytic": round(r.comm_bytes / expected, 4) if expected else None,
                "wire_bytes": round(r.wire_bytes),
                "collectives": [row.as_dict() for row in r.rows],
                "peak_bytes": r.memory["peak"],
                "ideal_state_bytes": round(ideal),
                "memory_over_ideal": round(r.memory["peak"] / ideal, 3),
                "flags": r.flags,
                "compile_s": round(r.compile_s, 2),
            }
        )
    cases = [(64, "1.3b", "h100", 80e9, 0)]
    if not args.quick:
        cases.insert(0, (8, "tiny", "cpu-sim", 8e9, 2))
    for devices, size, device, cap, confirm in cases:
        seq = 2048 if size == "1.3b" else 64
        cfg = gpt_config(size, seq, "bfloat16" if device == "h100" else "float32")
        t0 = time.perf_counter()
        p = plan(
            cfg,
            devices=devices,
            batch=max(16, 2 * devices),
            seq_len=seq,
            device=profile(device),
            memory_cap=cap,
            confirm=confirm,
        )
        emit(
            {
                "case": f"planner-{devices}",
                "model": size,
                "device_profile": device,
                **env,
                "wall_s": round(time.perf_counter() - t0, 2),
                "considered": p.considered,
                "compiled": p.compiled,
                "best": p.best.candidate.describe(),
                "modelled_step_s": p.best.modelled.estimate.total_s,
            }
        )


if __name__ == "__main__":
    main()
