"""``meshtrain bench``: train a named GPT size on synthetic tokens and print one JSON line.

    meshtrain bench --size tiny                      # CPU smoke (seconds)
    meshtrain bench --size 125m                      # on a GPU: bf16, cuDNN attention
    meshtrain bench --size 1.3b --seq-len 2048 --profile runs/trace

What it measures, in this order:

1. the compile time of the train step (``lower`` + ``compile``, no disk cache);
2. ``--warmup`` untimed steps, then ``--steps`` steps each timed to ``jax.block_until_ready``
   (median and spread), then the same number back to back with one wait at the end (what a
   training loop that reads its metrics one step late sees);
3. peak device memory (``device.memory_stats()``; on CPU, where jax keeps none, the compiled
   program's own estimate, and the JSON says which);
4. with ``--profile DIR``, a `jax.profiler` trace of ``--profile-steps`` more steps
   (TensorBoard/XProf read ``*.xplane.pb``, Perfetto ``perfetto_trace.json.gz``);
5. the matmul peak of the device: a bf16 8192³ ``jnp.dot``, median of several calls on three
   rotating random input sets (on CPU shrunk to 512³, and the JSON says so).

FLOPs come from `meshtrain.metrics` (written down once there) in both conventions: ``mfu``, the
headline, counts only the attention pairs a causal mask keeps (``causal``, as MaxText and
Megatron report); ``mfu_palm`` counts every pair (PaLM; what the Trainer's progress bar shows).
Each is given against the datasheet peak (`metrics.PEAK_TFLOPS`; null where none is known, e.g.
on CPU) and against the matmul peak measured in the same run.

It uses only meshtrain's public API (``import meshtrain as mt``); its flags are
`meshtrain.cli.bench.BenchSettings`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import pathlib
import sys
import time
from typing import Any

from meshtrain.measure import environment, matmul_peak, memory_figures, profile, spread, time_steps

# GPT-2 / GPT-3-paper sizes (Radford et al. 2019; Brown et al. 2020, table 2.1), in Llama
# style by default (RoPE, RMSNorm, SwiGLU with d_ff = ⌈8/3·d⌉₆₄). The vocabulary is GPT-2's
# 50257 padded to 50304, a multiple of 64 (as nanoGPT does). 1.3b takes 16 heads of width 128
# (Pythia-1.4B's shape) rather than the paper's 24 × 128, which does not multiply to 2048.
# seq_len and batch are the defaults of each size; --seq-len and --batch change them.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=128, n_layers=2, n_heads=2, vocab_size=256, seq_len=64, batch=8),
    "125m": dict(d_model=768, n_layers=12, n_heads=12, vocab_size=50304, seq_len=1024, batch=16),
    "350m": dict(d_model=1024, n_layers=24, n_heads=16, vocab_size=50304, seq_len=2048, batch=8),
    "1.3b": dict(d_model=2048, n_layers=24, n_heads=16, vocab_size=50304, seq_len=2048, batch=8),
}
MATMUL_PEAK_N = {"gpu": 8192, "other": 512}  # the matmul-peak size per platform


def log(*parts: Any) -> None:
    """Progress on stderr; stdout carries only the JSON line."""
    print("[bench]", *parts, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The resolved run shape: model config, tokens per sequence and global batch."""

    config: Any  # mt.GPTConfig
    seq_len: int
    batch: int

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch

    def describe(self) -> dict:
        c = self.config
        return {
            "style": c.style,
            "d_model": c.d_model,
            "n_layers": c.n_layers,
            "n_heads": c.n_heads,
            "n_kv_heads": c.kv_heads,
            "head_dim": c.head_width,
            "d_ff": c.ff_dim,
            "vocab_size": c.vocab_size,
            "seq_len": self.seq_len,
            "batch": self.batch,
            "dtype": c.dtype,
            "fp8": c.fp8,
            "remat": c.remat,
            "attention_impl": c.attention_impl,
            "norm_impl": c.norm_impl,
            "tie_embeddings": c.tie_embeddings,
        }


def on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def resolve_shape(args) -> Shape:
    """The GPT config of ``--size`` with the flags applied (the one place that builds it)."""
    import meshtrain as mt

    size = SIZES[args.size]
    seq_len = args.seq_len or size["seq_len"]
    attention = args.attention
    if attention == "default":
        attention = "cudnn" if on_gpu() else "xla"
    dtype = args.dtype or ("bfloat16" if on_gpu() else "float32")
    if getattr(args, "precision", ""):
        dtype = "float32"  # the policy sets it below
    config = mt.GPTConfig(
        style=args.style,
        vocab_size=size["vocab_size"],
        max_seq_len=seq_len,
        d_model=size["d_model"],
        n_layers=size["n_layers"],
        n_heads=size["n_heads"],
        remat=args.remat,
        dtype=dtype,
        attention_impl=attention,
        norm_impl=args.norm,
    )
    if getattr(args, "precision", ""):
        config = mt.Precision(policy=args.precision).applied(config)
    return Shape(config=config, seq_len=seq_len, batch=args.batch or size["batch"])


def synthetic_tokens(shape: Shape, n_batches: int, seed: int, *, packed: bool = False):
    """`n_batches` distinct host batches {"inputs", "targets"} [B, T] int32 of random tokens;
    `packed`: also "segment_ids" and "positions" of random documents (see `random_documents`)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        tokens = rng.integers(
            0, shape.config.vocab_size, (shape.batch, shape.seq_len + 1), dtype=np.int32
        )
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        if packed:
            batch["segment_ids"], batch["positions"] = random_documents(rng, *batch["inputs"].shape)
        out.append(batch)
    return out


def random_documents(rng, rows: int, seq_len: int):
    """Segment ids and positions [rows, seq_len] of rows packed with documents of random
    lengths (exponential, a quarter of the row on average, at least 16 tokens), the last cut at
    the row's end: the shape of a packed pretraining batch, with no padding."""
    import numpy as np

    seg = np.zeros((rows, seq_len), np.int32)
    pos = np.zeros((rows, seq_len), np.int32)
    for r in range(rows):
        start, doc = 0, 1
        while start < seq_len:
            n = min(max(16, int(rng.exponential(seq_len / 4))), seq_len - start)
            seg[r, start : start + n], pos[r, start : start + n] = doc, np.arange(n)
            start, doc = start + n, doc + 1
    return seg, pos


def throughput(
    *,
    step_time: float,
    shape: Shape,
    n_devices: int,
    peak_datasheet: float | None,
    peak_measured: float | None,
) -> dict:
    """tokens/s, model TFLOP/s and MFU in both FLOP conventions against both peaks (FLOP/s)."""
    from meshtrain import metrics

    out: dict[str, Any] = {"mfu_convention": "causal"}
    for convention in metrics.FLOP_CONVENTIONS:
        per_token = metrics.gpt_flops_per_token(shape.config, shape.seq_len, convention)
        flops = per_token * shape.tokens_per_step
        suffix = "" if convention == "causal" else "_palm"
        rate = metrics.step_rate(
            step_time=step_time,
            tokens_per_step=shape.tokens_per_step,
            flops_per_step=flops,
            n_devices=n_devices,
            peak_flops=peak_datasheet,
        )
        out["tokens_per_s"] = rate.tokens_per_s
        out[f"flops_per_token{suffix}"] = per_token
        out[f"flops_per_step{suffix}"] = flops
        out[f"model_tflops_per_device{suffix}"] = rate.tflops_per_device
        out[f"mfu{suffix}"] = rate.mfu
        out[f"mfu{suffix}_vs_measured_peak"] = (
            rate.tflops_per_device * 1e12 / peak_measured if peak_measured else None
        )
    return out


def run(args) -> dict:
    """Builds, compiles, times (and optionally traces) the meshtrain train step of `args`
    (a `meshtrain.cli.bench.BenchSettings`, or anything with its attributes).

    Returns:
        The JSON record (see the module docstring); also ``first_loss``, the loss of the first
        step on batch 0 from the initial parameters, for same-math checks against baselines.
    """
    if args.devices:
        import meshtrain as mt

        mt.simulate_devices(args.devices)
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # a compile time, not a cache hit
    record: dict[str, Any] = {"benchmark": "meshtrain_bench", "size": args.size}
    record.update(environment())
    device = jax.devices()[0]
    shape = resolve_shape(args)
    record["model"] = shape.describe()
    record["loss_impl"] = args.loss
    log(f"{record['device_kind']} × {record['n_devices']} · jax {record['jax_version']}")

    step = _compile_step(args, shape, record)  # 1. build and compile
    if getattr(args, "compile_only", False):
        record.update(_compiled_only(device, step.compiled))
        record["command"] = _command(args)
        return record
    n_devices = step.n_devices
    record.update(_time_and_trace(args, device, step))  # 2. time, 3. memory, 4. trace
    del step
    gc.collect()

    # 5. matmul peak (after the step, so the step's memory peak is its own)
    peak = _matmul_peak(args, device)
    record["matmul_peak"] = peak
    record.update(_rates(record["step_time_s"], shape, n_devices, device, peak))
    record["command"] = _command(args)
    return record


@dataclasses.dataclass
class _Step:
    """The compiled train step with its state and batches, on a mesh of `n_devices`."""

    compiled: Any  # (state, batch) -> (state, metrics), the state donated
    state: Any
    batches: list
    n_devices: int


def _compile_step(args, shape: Shape, record: dict) -> _Step:
    """Builds the train state and batches and compiles the step; records the mesh, strategy,
    precision, parameter count and compile time."""
    import jax

    import meshtrain as mt
    from meshtrain.models import DataSpec

    mesh = mt.make_mesh(args.mesh)
    rules = mt.rules_for(args.strategy, mesh)
    record["mesh"] = mt.describe(mesh)
    record["strategy"] = args.strategy
    total = args.warmup + 2 * args.steps + args.profile_steps + 1
    precision = mt.Precision(policy=getattr(args, "precision", "") or "auto")
    record["precision"] = precision.resolved(shape.config)
    optim = mt.OptimConfig(warmup_steps=2)
    run = mt.RunSpec(
        model=shape.config,
        mesh=mesh,
        rules=rules,
        optim=optim,
        precision=precision,
        train=mt.TrainConfig(loss_impl=args.loss, run_dir=""),
    )
    tx = run.optimizer(total)
    graphdef, state, shardings = mt.lower.init_train_state(
        lambda: mt.lower.build_model(shape.config, seed=args.seed), tx, mesh, rules
    )
    record["params"] = sum(int(x.size) for x in jax.tree.leaves(state.params))
    packed = getattr(args, "packed", False)
    record["packed"] = packed
    host = synthetic_tokens(shape, 3, args.seed, packed=packed)
    batches = [mt.lower.shard_batch(b, mesh, rules) for b in host]
    batch_sharding = {k: v.sharding for k, v in batches[0].items()}
    data = DataSpec("lm", shape.batch, shape.seq_len, shape.config.vocab_size, packed=packed)
    record["kernels"] = run.replace(data=data).kernels()
    log(record["kernels"])
    jitted = mt.lower.jit_train_step(run, graphdef, tx, shardings, batch_sharding)
    t0 = time.perf_counter()
    compiled = jitted.lower(state, batches[0]).compile()
    record["compile_s"] = time.perf_counter() - t0
    log(f"compiled in {record['compile_s']:.1f} s · {record['params'] / 1e6:.1f}M parameters")
    return _Step(compiled, state, batches, mesh.devices.size)


def _compiled_only(device, compiled) -> dict:
    """What ``--compile-only`` reports: the compiled step's memory and FLOPs."""
    out = memory_figures(device, compiled)
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    out["compiled_flops"] = float(cost.get("flops", 0.0)) or None
    out["note"] = "compiled only: memory and FLOPs of the compiled step; nothing timed"
    return out


def _time_and_trace(args, device, step: _Step) -> dict:
    """The first loss, the step's times, its peak memory and, with ``--profile``, a trace."""
    out: dict[str, Any] = {}
    state, metrics0 = step.compiled(step.state, step.batches[0])
    out["first_loss"] = float(metrics0["loss"])
    state, synced, back_to_back = time_steps(
        step.compiled, state, step.batches, args.warmup, args.steps
    )
    stats = spread(synced)
    out["warmup_steps"] = args.warmup
    out["timed_steps"] = args.steps
    out["step_time_s"] = stats["median"]
    out["step_time_spread"] = {k: v for k, v in stats.items() if k != "median"}
    out["step_time_back_to_back_s"] = back_to_back
    out.update(memory_figures(device, step.compiled))
    if args.profile:
        state, files = profile(step.compiled, state, step.batches, args.profile, args.profile_steps)
        out["profile_dir"] = args.profile
        out["profile_files"] = files
    return out


def _matmul_peak(args, device) -> dict:
    """The measured bf16 matmul peak (shrunk off the GPU; skipped with ``--matmul-peak-n 0``)."""
    n = args.matmul_peak_n
    if n < 0:
        n = MATMUL_PEAK_N["gpu" if on_gpu() else "other"]
    if not n:
        return {"n": 0, "note": "skipped (--matmul-peak-n 0)", "tflops": None}
    peak = matmul_peak(n, args.matmul_peak_reps)
    if not on_gpu() and n < MATMUL_PEAK_N["gpu"]:
        peak["note"] = (
            f"shrunk from 8192³ to {n}³ off the GPU ({device.platform}): a smoke of the "
            "code path, not a device ceiling"
        )
    log(f"matmul peak {n}³ bf16: {peak['tflops']:.3g} TFLOP/s")
    return peak


def _rates(step_time: float, shape: Shape, n_devices: int, device, peak: dict) -> dict:
    """Both peaks, the throughput and MFU against them, and what the figures are worth."""
    from meshtrain import metrics

    out: dict[str, Any] = {}
    peak_datasheet = metrics.peak_flops_per_device(device, shape.config.dtype)
    out["peak_tflops_datasheet"] = None if peak_datasheet is None else peak_datasheet / 1e12
    peak_measured = peak["tflops"] * 1e12 if peak.get("tflops") else None
    out["peak_tflops_measured"] = peak["tflops"]
    out.update(
        throughput(
            step_time=step_time,
            shape=shape,
            n_devices=n_devices,
            peak_datasheet=peak_datasheet,
            peak_measured=peak_measured,
        )
    )
    if shape.config.fp8:
        out["mfu_note"] = "fp8: MFU is against the bfloat16 peak, as peers report fp8 MFU"
    out["tokens_per_step"] = shape.tokens_per_step
    out["tokens_per_s_per_device"] = out["tokens_per_s"] / n_devices
    out["note"] = (
        "GPU figures"
        if on_gpu()
        else f"{device.platform} smoke: timings and MFU say nothing about GPU speed "
        "(no datasheet peak off the GPU; the matmul peak is shrunk)"
    )
    return out


def _command(args) -> str:
    """The command line the record came from."""
    return "meshtrain bench " + " ".join(getattr(args, "argv", []))


def emit(record: dict, out: str = "") -> str:
    """The record as one JSON line on stdout (and appended to `out`); returns the line."""
    line = json.dumps(record, allow_nan=False, default=float)
    print(line, flush=True)
    if out:
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
    return line
