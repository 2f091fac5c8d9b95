"""Data-parallel scaling of a ResNet-style CNN on fake images: measured here, projected for H100s.

Measured: ``meshtrain train --model cnn --data.source fake_images`` as 1 process with 1 to 8
simulated devices and through ``meshtrain launch`` as 2 and 4 processes, with the same batch
per device (weak scaling), strategy ``dp``. Each configuration prints one JSON line with the
images/s (the median over steps 4 to the last: the rate is logged from step 2, and two more are
skipped) and the per-device throughput relative to one device. On CPU every simulated device
and process shares the same cores, so these figures show what the collectives and the
processes cost, not a speed-up.

Projected: meshtrain's α-β cost model through `alpha_beta.py` (the H100 profile's NVLink /
InfiniBand figures, with their sources in `meshtrain.costmodel`) of the efficiency of data
parallelism for the full ResNet-18 preset on 32×32×3 images, 1 to 64 GPUs; one JSON line per
GPU count, ``"kind": "projected"``.

    python benchmarks/scaling.py --quick     # 1, 2 devices; 2 processes; 3 steps
    python benchmarks/scaling.py             # 1, 2, 4, 8 devices; 2 and 4 processes
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import parser  # noqa: E402
from alpha_beta import projected_efficiency  # noqa: E402

ROOT = HERE.parent
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# (processes, devices per process)
FULL = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]
QUICK = [(1, 1), (1, 2), (2, 1)]


def _train_args(args, devices: int, run_dir: str) -> list[str]:
    """The ``train`` arguments of one configuration."""
    size = str(args.image_size)
    return [
        "train", "--model", "cnn", "--cnn.preset", "resnet18",
        "--cnn.widths", *map(str, args.widths), "--cnn.depth", "1",
        "--cnn.image-size", size, "--cnn.in-channels", "3",
        "--data.source", "fake_images", "--data.image-shape", size, size, "3",
        "--data.batch-size", str(args.per_device_batch * devices), "--data.val-fraction", "0",
        "--mesh", f"data={devices}", "--strategy", "dp", "--steps", str(args.steps),
        "--log-every", "1", "--eval-every", "0", "--no-save", "--no-progress",
        "--run-dir", run_dir,
    ]  # fmt: skip


def measure(args, procs: int, per_proc: int) -> dict:
    """Runs one configuration; returns its JSON line."""
    devices = procs * per_proc
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHTRAIN_")}
    env["XLA_FLAGS"] = FAST_COMPILE if args.fast_compile else ""
    env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        train = _train_args(args, devices, tmp)
        cli = [sys.executable, "-m", "meshtrain.cli"]
        if procs == 1:
            argv = cli + train + ["--devices", str(per_proc)]
        else:
            launch = ["launch", "--nproc", str(procs), "--devices-per-proc", str(per_proc), "--"]
            argv = cli + launch + train
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"scaling: {procs}×{per_proc} failed:\n{done.stdout[-3000:]}")
        lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")][2:]
    rate = statistics.median(rates) if rates else None
    return {
        "bench": "scaling",
        "kind": "measured",
        "procs": procs,
        "devices_per_proc": per_proc,
        "devices": devices,
        "global_batch": args.per_device_batch * devices,
        "images_per_s": rate,
        "images_per_s_per_device": rate / devices if rate else None,
        "steps_timed": len(rates),
        "device": "cpu (simulated devices share the host's cores)",
        "note": "CPU: collective and process overhead, not speed-up",
    }


def projections(args) -> list[dict]:
    """The projected H100 efficiency of the full ResNet-18 preset (32×32×3)."""
    import jax
    from flax import nnx

    from meshtrain.models import CNNConfig

    cfg = CNNConfig(preset="resnet18", image_size=32, in_channels=3)
    model = nnx.eval_shape(lambda: cfg.build(rngs=nnx.Rngs(params=0)))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    flops = cfg.flops_per_token() * args.gpu_batch
    out = []
    for gpus in (1, 2, 4, 8, 16, 32, 64):
        est = projected_efficiency(
            gpus=gpus, flops_per_step=flops, grad_bytes=4 * params, utilisation=args.utilisation
        )
        out.append(
            {
                "bench": "scaling",
                "kind": "projected",
                "model": cfg.describe(),
                "params": params,
                "per_gpu_batch": args.gpu_batch,
                "utilisation_assumed": args.utilisation,
                **est,
                "device": "H100 SXM (projected: meshtrain.costmodel, see alpha_beta.py)",
            }
        )
    return out


def main(argv=None) -> int:
    """Prints the measured lines, then the projected ones."""
    p = parser(__doc__.splitlines()[0], quick="3 configurations, 4 steps", steps=8)
    p.add_argument("--per-device-batch", type=int, default=8)
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--gpu-batch", type=int, default=128, help="per-GPU batch (projection)")
    p.add_argument("--utilisation", type=float, default=0.4, help="assumed (projection)")
    p.add_argument("--no-fast-compile", dest="fast_compile", action="store_false")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.widths = 4, [8, 16]
    base = None
    for procs, per_proc in QUICK if args.quick else FULL:
        line = measure(args, procs, per_proc)
        if (procs, per_proc) == (1, 1):
            base = line["images_per_s_per_device"]
        per = line["images_per_s_per_device"]
        line["per_device_vs_one_device"] = per / base if per and base else None
        print(json.dumps(line), flush=True)
    for line in projections(args):
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
