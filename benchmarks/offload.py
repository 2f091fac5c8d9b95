"""Host offload, compiled: one JSON line per setting with the compiled step's memory per
device (accelerator and host), its host↔device transfers per step, and the analytic figures
they are held to. Nothing runs: every step is compiled ahead of time on simulated devices.

    python benchmarks/offload.py                     # the 125m bench model, fsdp over 8
    python benchmarks/offload.py --size tiny --mesh fsdp=8 --strategy fsdp

Settings: ``plain`` (nothing offloaded, no remat); ``full`` and ``save:NAME`` for each named
intermediate (what each remat policy keeps costs in memory and FLOPs); ``optimizer``
(``--offload optimizer``: the Adam moments and count in host memory), held to the optimizer
state's bytes per device (the device arguments must fall by at least 0.9 of them); and pairs
of remat policies that save and offload the same residuals (``save:mlp_hidden`` /
``offload:mlp_hidden``, ``save-dots`` / ``offload-dots``), held to one residual per layer each
way: the transfers must equal the analytic count within 10%.

On CPU, jax lowers a transfer inside the step to nothing, so an offloading policy compiles to
the same program as the one that saves: its device memory cannot fall there, and the line
says so (``cpu_moves_compile_to_nothing``). The transfers are counted from the traced step,
and each line also counts the moves of the step lowered for ``cuda``
(``cuda_moves_to_host``), which a GPU compiles into copies.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from datetime import date

SETTINGS = (
    "plain", "optimizer", "full", "save:attn_in", "save:qkv", "save:attn_out", "save:mlp_in",
    "save:mlp_hidden", "offload:mlp_hidden", "save-dots", "offload-dots",
)  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="125m", help="a bench size (meshtrain.bench.SIZES)")
    p.add_argument("--mesh", default="fsdp=8")
    p.add_argument("--strategy", default="fsdp")
    p.add_argument("--batch", type=int, default=0, help="global batch (0: the size's)")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax

    import meshtrain as mt
    from meshtrain import bench
    from meshtrain.comm import compile as comp
    from meshtrain.models import DataSpec

    size = bench.SIZES[args.size]
    mesh = mt.make_mesh(args.mesh)
    n = mesh.devices.size
    seq, batch = size["seq_len"], args.batch or size["batch"]
    base = mt.GPTConfig(
        d_model=size["d_model"], n_layers=size["n_layers"], n_heads=size["n_heads"],
        vocab_size=size["vocab_size"], max_seq_len=seq, dtype="bfloat16",
    )  # fmt: skip
    common = {
        "benchmark": "offload", "size": args.size, "mesh": args.mesh, "strategy": args.strategy,
        "batch": batch, "seq_len": seq, "platform": jax.default_backend(),
        "jax_version": jax.__version__, "date": date.today().isoformat(),
    }  # fmt: skip
    for setting in args.settings:
        remat = setting if setting not in ("plain", "optimizer") else "none"
        run = mt.RunSpec(
            model=dataclasses.replace(base, remat=remat),
            data=DataSpec("lm", batch, seq, base.vocab_size),
            mesh=mesh,
            rules=mt.rules_for(args.strategy, mesh),
            offload=mt.Offload(optimizer=setting == "optimizer"),
        )
        report = mt.inspect(run)
        line = {**common, "setting": setting, "remat": remat, "compile_s": report.compile_s}
        line["flops"] = report.flops
        line["memory_bytes"] = report.memory
        line["transfer_bytes"] = {k: round(v) for k, v in report.transfers.items()}
        if setting == "optimizer":
            step, state, _ = comp.step_parts(run)
            shardings = jax.tree.map(lambda x: x.sharding, state.opt_state)
            analytic = mt.offload.host_bytes(state.opt_state, shardings)
            line["analytic_moments_bytes"] = analytic
        if remat != "none":
            step, state, batch_ = comp.step_parts(run)
            text = step.trace(state, batch_).lower(lowering_platforms=("cuda",)).as_text()
            line["cuda_moves_to_host"] = len(
                re.findall(r'_xla_buffer_placement = "pinned_host"', text)
            )
            if setting.startswith("offload:mlp_hidden"):
                residual = batch * seq * base.ff_dim * 2 // n  # bf16, split over every device
                line["analytic_transfer_bytes"] = base.n_layers * residual
        line["cpu_moves_compile_to_nothing"] = jax.default_backend() == "cpu"
        print(json.dumps(line), flush=True)
        print(f"[offload] {setting}: {report.memory} {report.transfers}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
