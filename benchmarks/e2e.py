"""``meshtrain bench`` with its baselines in the same run, as ratios; one JSON line.

    python benchmarks/e2e.py --size 125m                # on a GPU: meshtrain, jax, torch
    python benchmarks/e2e.py --size 1.3b --batch 8
    python benchmarks/e2e.py --size tiny --torch off    # CPU smoke

Every flag of ``meshtrain bench`` is accepted (see ``meshtrain bench --help``), plus:

- ``--torch auto|on|off`` — the PyTorch baseline (`baseline_torch.py`), run FIRST in its own
  process with the same shapes, because JAX keeps the GPU memory it takes until its process
  ends; ``auto`` runs it where ``--torch-python`` can import torch and records why not
  elsewhere. The ratio is ``ratio_vs_torch`` = meshtrain tokens/s ÷ PyTorch tokens/s.
- ``--jax-baseline/--no-jax-baseline`` — the hand-written `jax.jit` + optax step
  (`baseline_jax.py`), timed by the same code as meshtrain's step, from the same initial
  weights and batches: ``ratio_vs_jax`` = meshtrain tokens/s ÷ baseline tokens/s, and
  ``first_loss_rel_diff`` says whether both computed the same first loss.

A ratio above 1 means meshtrain is faster.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import logger  # noqa: E402

log = logger("e2e")


def parse_args(argv=None):
    import dataclasses

    from meshtrain.cli.bench import parse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("--torch", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--torch-python", default=sys.executable, help="a python that has torch")
    p.add_argument("--torch-timeout", type=int, default=600, help="seconds for the torch run")
    p.add_argument("--jax-baseline", action=argparse.BooleanOptionalAction, default=True)
    own, rest = p.parse_known_args(argv)
    bench = dataclasses.asdict(parse(list(rest)))  # meshtrain bench's flags and checks
    return argparse.Namespace(**bench, argv=list(rest), **vars(own))


def size_numbers(args) -> dict:
    """The model's shape without starting a jax backend (which would take the GPU memory)."""
    import meshtrain as mt
    from meshtrain import bench

    s = bench.SIZES[args.size]
    cfg = mt.GPTConfig(
        style=args.style,
        vocab_size=s["vocab_size"],
        max_seq_len=args.seq_len or s["seq_len"],
        d_model=s["d_model"],
        n_layers=s["n_layers"],
        n_heads=s["n_heads"],
    )
    return {
        "style": cfg.style,
        "vocab-size": cfg.vocab_size,
        "d-model": cfg.d_model,
        "n-layers": cfg.n_layers,
        "n-heads": cfg.n_heads,
        "n-kv-heads": cfg.kv_heads,
        "d-ff": cfg.ff_dim,
        "seq-len": cfg.max_seq_len,
        "batch": args.batch or s["batch"],
    }


def run_torch(args) -> dict:
    """The PyTorch baseline in its own process; a dict with "status"."""
    if args.torch == "off":
        return {"status": "off"}
    probe = subprocess.run(
        [args.torch_python, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["import torch failed"])[-1]
        if args.torch == "on":
            raise SystemExit(f"--torch on, but {args.torch_python} cannot import torch: {why}")
        return {"status": f"unavailable: {why}"}
    cmd = [args.torch_python, str(HERE / "baseline_torch.py")]
    for k, v in size_numbers(args).items():
        cmd += [f"--{k}", str(v)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    log("torch baseline:", " ".join(cmd[1:]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.torch_timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {args.torch_timeout} s"}
    sys.stderr.write(proc.stderr[-4000:])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": f"failed (exit {proc.returncode}): {tail[:300]}"}
    return {"status": "ok", **json.loads(lines[-1])}


def run_jax_baseline(args, shape) -> dict:
    """Times the hand-written step on meshtrain's initial weights and batches."""
    import dataclasses

    import baseline_jax as B
    from flax import nnx

    import meshtrain as mt
    from meshtrain import bench, measure

    c = shape.config
    attention = (
        c.attention_impl
        if c.attention_impl in ("xla", "cudnn")
        else ("cudnn" if bench.on_gpu() else "xla")
    )
    cfg = dataclasses.replace(
        c,
        attention_impl=attention,
        remat=c.remat if c.remat in ("none", "full", "save-dots") else "none",
    )
    _, param_vars, _ = nnx.split(mt.lower.build_model(c, seed=args.seed), nnx.Param, ...)
    params = nnx.to_pure_dict(param_vars)
    del param_vars
    total = args.warmup + 2 * args.steps + 1
    tx = B.optimizer(B.OptConfig(warmup_steps=2, total_steps=total))
    state, batches = B.data_parallel(params, tx, bench.synthetic_tokens(shape, 3, args.seed))
    del params
    step = B.make_step(cfg, tx)
    t0 = time.perf_counter()
    compiled = step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    state, loss = compiled(state, batches[0])
    first_loss = float(loss)
    state, synced, back_to_back = measure.time_steps(
        compiled, state, batches, args.warmup, args.steps
    )
    stats = measure.spread(synced)
    del state, compiled, batches
    gc.collect()
    return {
        "status": "ok",
        "attention": attention,
        "remat": cfg.remat,
        "compile_s": compile_s,
        "first_loss": first_loss,
        "step_time_s": stats["median"],
        "step_time_spread": {k: v for k, v in stats.items() if k != "median"},
        "step_time_back_to_back_s": back_to_back,
        "tokens_per_s": shape.tokens_per_step / stats["median"],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    torch_result = run_torch(args)  # first: before jax takes the GPU's memory
    log("torch baseline:", torch_result.get("status"))

    from meshtrain import bench

    record = bench.run(args)
    out = {**record, "benchmark": "e2e"}
    out["command"] = "python benchmarks/e2e.py " + " ".join(argv or sys.argv[1:])
    if args.jax_baseline:
        shape = bench.resolve_shape(args)
        try:
            jax_result = run_jax_baseline(args, shape)
        except Exception as e:  # noqa: BLE001 - an OOM of the baseline is a result
            jax_result = {"status": f"failed: {type(e).__name__}: {str(e)[:300]}"}
        out["jax_baseline"] = jax_result
        if jax_result["status"] == "ok":
            out["ratio_vs_jax"] = record["tokens_per_s"] / jax_result["tokens_per_s"]
            out["first_loss_rel_diff"] = abs(jax_result["first_loss"] - record["first_loss"]) / abs(
                record["first_loss"]
            )
    else:
        out["jax_baseline"] = {"status": "off"}
    out["torch_baseline"] = torch_result
    if torch_result["status"] == "ok":
        out["ratio_vs_torch"] = record["tokens_per_s"] / torch_result["tokens_per_s"]
    bench.emit(out, args.out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    sys.exit(main())
