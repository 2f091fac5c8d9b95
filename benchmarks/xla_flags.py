"""XLA's GPU flags that peers set for throughput, each measured on and off: one `meshtrain bench`
run per flag set, each in a fresh process (XLA reads its flags once), back to back so the
ratios share the machine's state.

    python benchmarks/xla_flags.py --size 350m --seq-len 2048 --packed --precision bf16
    python benchmarks/xla_flags.py --size tiny --steps 2    # the CPU dry run: the runs work

Prints one JSON line per flag set (the bench's record with ``xla_flags`` and ``vs_none``, its
tokens/s over the run without extra flags) and a last summary line. A flag this jaxlib does not
know makes its run fail, which the line says; the others go on.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _common, under PYTHONSAFEPATH
from _common import emit, logger, parser  # noqa: E402

log = logger("xla_flags")

# name -> the flags added to XLA_FLAGS (the first: none, the reference)
FLAG_SETS = {
    "none": "",
    "latency_hiding_scheduler": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "no_triton_gemm": "--xla_gpu_enable_triton_gemm=false",
    "while_loop_double_buffering": "--xla_gpu_enable_while_loop_double_buffering=true",
    "highest_priority_async_stream": "--xla_gpu_enable_highest_priority_async_stream=true",
    # MaxText's GPU set (its collective-combining thresholds matter only across devices)
    "maxtext": " ".join(
        [
            "--xla_gpu_enable_latency_hiding_scheduler=true",
            "--xla_gpu_enable_triton_gemm=false",
            "--xla_gpu_enable_highest_priority_async_stream=true",
            "--xla_gpu_enable_while_loop_double_buffering=true",
            "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
            "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
            "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
        ]
    ),
}


def parse_args(argv=None):
    p = parser(__doc__.split("\n\n")[0], steps=10)
    p.add_argument("--size", default="350m", help="the bench's model size")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0: the size's)")
    p.add_argument("--precision", default="bf16", help="the precision policy")
    p.add_argument("--packed", action="store_true", help="packed documents (the recipe)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    p.add_argument("--only", default=",".join(FLAG_SETS), help="flag sets to run, comma-separated")
    p.add_argument("--timeout", type=int, default=240, help="seconds per run")
    return p.parse_args(argv)


def bench(args, flags: str) -> dict:
    """One `meshtrain bench` run with `flags` added to XLA_FLAGS: its record, or the failure."""
    cmd = [sys.executable, "-m", "meshtrain.cli", "bench", "--size", args.size,
           "--precision", args.precision, "--attention", "auto", "--norm", "auto",
           "--loss", "auto", "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--matmul-peak-n", "0"]  # fmt: skip
    cmd += ["--seq-len", str(args.seq_len)] if args.seq_len else []
    cmd += ["--packed"] if args.packed else []
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), flags) if f)
    try:
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {args.timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": f"failed (exit {proc.returncode}): {tail[:300]}"}
    return {"status": "ok", **json.loads(lines[-1])}


def main(argv=None) -> int:
    args = parse_args(argv)
    wanted = [n for n in FLAG_SETS if n in args.only.split(",")]
    rates: dict[str, float] = {}
    for name in wanted:
        log(f"{name}: {FLAG_SETS[name] or '(no extra flags)'}")
        record = bench(args, FLAG_SETS[name])  # the bench's record: its "benchmark" renamed
        record.update(benchmark="xla_flags", flag_set=name, xla_flags=FLAG_SETS[name])
        if record["status"] == "ok":
            rates[name] = record["tokens_per_s"]
            if "none" in rates:
                record["vs_none"] = record["tokens_per_s"] / rates["none"]
        log(f"{name}: {record['status']}" + (f", {record['vs_none']:.3f}× none"
                                             if "vs_none" in record else ""))  # fmt: skip
        emit(record)
    ratios = {n: r / rates["none"] for n, r in rates.items()} if "none" in rates else {}
    emit({"benchmark": "xla_flags_summary", "vs_none": ratios, "size": args.size,
          "packed": args.packed, "precision": args.precision})  # fmt: skip
    return 0 if rates else 1


if __name__ == "__main__":
    sys.exit(main())
