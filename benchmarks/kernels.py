"""GPU benchmark of meshtrain.kernels against cuDNN and the XLA (jnp) reference.

For each kernel and shape, forward and forward+backward, side by side in one run:

- median wall time over ``--reps`` timed calls after ``--warmup`` calls (each call
  synchronised with ``jax.block_until_ready``), rotating among three random input sets so
  the inputs never sit in L2 from the previous call;
- achieved TFLOP/s (attention, matmul) or GB/s (norms, cross-entropy);
- ``roofline_ratio``: the floor time over the measured time, where the floor is
  max(FLOPs / matmul ceiling, bytes / copy ceiling) and both ceilings are measured in the same
  run (a large bf16 ``jnp.dot`` and a large device-to-device copy);
- ``vs_cudnn`` and ``vs_xla``: the peer's time over the kernel's (> 1: the kernel is faster).

Correctness is checked before any timing: the Pallas output against the reference (or, where
the reference would need O(T²) memory past ``--xla-max-seq``, against cuDNN), by
‖out − ref‖ / ‖ref‖.

Shapes (issue 4): attention batch × seq ∈ {8×1k, 4×4k, 1×16k}, 16 heads, head dims 64 and
128, bf16, causal and not; norms and cross-entropy over 8192 tokens; matmul 4096³ + GELU.

Counting: attention forward FLOPs are 4·B·H·T·S·K (halved when causal); forward+backward is
3.5× that (the backward's five matmuls, including the recomputed scores, are 2.5× the
forward's two). Norm bytes are one read of x and one write of y forward, plus a read of x and
dy and a write of dx backward; cross-entropy reads the logits once forward, and reads them
and writes their gradient backward; parameters and per-row statistics are ignored.

Prints exactly one JSON line on stdout (``--out PATH`` also writes it to a file, which
notebooks/03_kernels.ipynb reads). Without a GPU it does not pretend: it runs a tiny
interpret-mode correctness smoke of every kernel, prints a line with ``"gpu_figures":
"unmeasured"`` and exits 0.

    python benchmarks/kernels.py                           # on a GPU: the full table
    python benchmarks/kernels.py --out benchmarks/results/kernels_gpu.json
    python benchmarks/kernels.py --only attention --reps 10
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

# scripts/gpu_check.sh runs this with PYTHONSAFEPATH set, which leaves this folder off sys.path
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _common import emit, logger, median_seconds, parser  # noqa: E402

SHAPES = {
    "attention": ((8, 1024), (4, 4096), (1, 16384)),  # (batch, seq)
    "heads": 16,
    "head_dims": (64, 128),
    "causal": (True, False),
    "norm": ((8192, 2048), (8192, 8192)),  # (tokens, features)
    "cross_entropy": ((8192, 32768), (8192, 131072)),  # (tokens, vocab)
    "matmul": ((4096, 4096, 4096),),  # (M, K, N)
    "ceiling_matmul": 8192,
    "ceiling_copy_elems": 256 * 2**20,  # 1 GiB of float32
}
# --selftest: the timing code path on tiny shapes (interpreted off the GPU). Its times mean
# nothing; it exists so the table-building code is exercised where no GPU is available.
SELFTEST_SHAPES = {
    "attention": ((1, 40),),
    "heads": 2,
    "head_dims": (64,),
    "causal": (True,),
    "norm": ((40, 48),),
    "cross_entropy": ((40, 300),),
    "matmul": ((40, 48, 36),),
    "ceiling_matmul": 256,
    "ceiling_copy_elems": 2**20,
}


log = logger("kernels")


def parse_args(argv=None) -> argparse.Namespace:
    p = parser("meshtrain.kernels vs cuDNN and XLA on a GPU", out=True)
    p.add_argument("--warmup", type=int, default=5, help="untimed calls after compiling")
    p.add_argument("--reps", type=int, default=30, help="timed calls; the median is reported")
    p.add_argument(
        "--only",
        default="attention,rms_norm,layer_norm,cross_entropy,matmul",
        help="comma-separated kernels to run",
    )
    p.add_argument(
        "--xla-max-seq",
        type=int,
        default=4096,
        help="longest sequence at which the O(T²)-memory XLA attention reference is run",
    )
    p.add_argument(
        "--selftest",
        action="store_true",
        help="run the timing code on tiny shapes on any backend (times meaningless; for tests)",
    )
    return p.parse_args(argv)


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float32 on the device."""
    import jax.numpy as jnp

    a, b = out.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def measure_ceilings(args) -> dict:
    """The two ceilings of the roofline, measured: bf16 matmul TFLOP/s (as `meshtrain bench`
    measures its peak: `meshtrain.measure.matmul_peak`) and copy GB/s."""
    import jax

    from meshtrain.measure import matmul_peak

    dot = matmul_peak(args.shapes["ceiling_matmul"], args.reps, args.warmup)
    keys = jax.random.split(jax.random.key(0), 3)
    big = [(jax.random.normal(k, (args.shapes["ceiling_copy_elems"],)),) for k in keys]
    copy = jax.jit(lambda x: x * 1.0000001)  # a read and a write of every element
    t_copy = median_seconds(copy, big, args.warmup, args.reps)
    return {
        "matmul_tflops": dot["tflops"],
        "copy_gbps": 2 * big[0][0].nbytes / t_copy / 1e9,
    }


def row(kernel, shape, pass_, impl, seconds, *, flops=None, bytes_=None, ceilings, **extra):
    """One result row with achieved rate and the roofline ratio."""
    floor = max(
        (flops or 0) / (ceilings["matmul_tflops"] * 1e12),
        (bytes_ or 0) / (ceilings["copy_gbps"] * 1e9),
    )
    out = {
        "kernel": kernel,
        "shape": shape,
        "pass": pass_,
        "impl": impl,
        "ms": round(seconds * 1e3, 4),
        "floor_ms": round(floor * 1e3, 4),
        "roofline_ratio": round(floor / seconds, 4),
    }
    if flops:
        out["tflops"] = round(flops / seconds / 1e12, 2)
    if bytes_:
        out["gbps"] = round(bytes_ / seconds / 1e9, 1)
    out.update(extra)
    return out


def add_peer_ratios(rows) -> None:
    """vs_cudnn / vs_xla on each Pallas row: the peer's time over the kernel's."""
    by_key = {(r["kernel"], json.dumps(r["shape"]), r["pass"], r["impl"]): r for r in rows}
    for r in rows:
        if r["impl"] != "pallas":
            continue
        for peer in ("cudnn", "xla"):
            other = by_key.get((r["kernel"], json.dumps(r["shape"]), r["pass"], peer))
            if other is not None:
                r[f"vs_{peer}"] = round(other["ms"] / r["ms"], 3)


def bench_attention(args, ceilings) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from meshtrain.kernels import flash_attention

    rows = []
    for B, T in args.shapes["attention"]:
        for K in args.shapes["head_dims"]:
            for causal in args.shapes["causal"]:
                H = args.shapes["heads"]
                shape = {"batch": B, "seq": T, "heads": H, "head_dim": K, "causal": causal}
                sets = []
                for i in range(3):
                    ks = jax.random.split(jax.random.key(100 + i), 4)
                    sets.append(tuple(jax.random.normal(k, (B, T, H, K), jnp.bfloat16) for k in ks))
                fwd_flops = 4 * B * H * T * T * K * (0.5 if causal else 1.0)
                io_bytes = 4 * B * T * H * K * 2
                impls = ["pallas"] + (["cudnn"] if jax.default_backend() == "gpu" else [])
                impls += ["xla"] if T <= args.xla_max_seq else []
                fns = {}
                for impl in impls:

                    def f(q, k, v, impl=impl, causal=causal):
                        return flash_attention(q, k, v, causal=causal, impl=impl)

                    def fb(q, k, v, do, f=f):
                        out, vjp = jax.vjp(f, q, k, v)
                        return out, vjp(do)

                    fns[impl] = (jax.jit(f), jax.jit(fb))
                q, k, v, _ = sets[0]
                check = "xla" if "xla" in fns else "cudnn"
                err = rel_err(fns["pallas"][0](q, k, v), fns[check][0](q, k, v))
                log(f"attention {shape}: rel err vs {check} {err:.2e}")
                for impl, (f, fb) in fns.items():
                    try:
                        t_f = median_seconds(f, [s[:3] for s in sets], args.warmup, args.reps)
                        t_fb = median_seconds(fb, sets, args.warmup, args.reps)
                    except Exception as e:  # noqa: BLE001 - an OOM of a peer is a result
                        rows.append(
                            {
                                "kernel": "attention",
                                "shape": shape,
                                "impl": impl,
                                "error": f"{type(e).__name__}: {str(e)[:200]}",
                            }
                        )
                        continue
                    extra = {"rel_err": err, "checked_against": check} if impl == "pallas" else {}
                    rows.append(
                        row(
                            "attention",
                            shape,
                            "fwd",
                            impl,
                            t_f,
                            flops=fwd_flops,
                            bytes_=io_bytes,
                            ceilings=ceilings,
                            **extra,
                        )
                    )
                    rows.append(
                        row(
                            "attention",
                            shape,
                            "fwd+bwd",
                            impl,
                            t_fb,
                            flops=3.5 * fwd_flops,
                            bytes_=2.5 * io_bytes,
                            ceilings=ceilings,
                            **extra,
                        )
                    )
    return rows


def bench_rowwise(args, ceilings, name) -> list[dict]:
    """rms_norm, layer_norm or cross_entropy: memory-bound, reported in GB/s."""
    import jax
    import jax.numpy as jnp

    import meshtrain.kernels as K

    rows = []
    shapes = args.shapes["cross_entropy" if name == "cross_entropy" else "norm"]
    for N, D in shapes:
        shape = {"tokens": N, "vocab" if name == "cross_entropy" else "features": D}
        sets = []
        for i in range(3):
            ks = jax.random.split(jax.random.key(200 + i), 4)
            x = jax.random.normal(ks[0], (N, D), jnp.bfloat16)
            if name == "cross_entropy":
                sets.append(
                    (x, jax.random.randint(ks[1], (N,), 0, D), jax.random.normal(ks[2], (N,)))
                )
            else:
                w = 1 + 0.1 * jax.random.normal(ks[1], (D,))
                b = 0.1 * jax.random.normal(ks[2], (D,))
                sets.append((x, w, b, jax.random.normal(ks[3], (N, D), jnp.bfloat16)))
        fns = {}
        for impl in ("pallas", "xla"):
            if name == "cross_entropy":
                f = lambda x, t, impl=impl: K.token_cross_entropy(x, t, impl=impl)  # noqa: E731
                fb = lambda x, t, g, f=f: jax.vjp(lambda x: f(x, t), x)[1](g)  # noqa: E731
            elif name == "rms_norm":
                f = lambda x, w, b, impl=impl: K.rms_norm(x, w, impl=impl)  # noqa: E731
                fb = lambda x, w, b, dy, f=f: jax.vjp(f, x, w, b)[1](dy)  # noqa: E731
            else:
                f = lambda x, w, b, impl=impl: K.layer_norm(x, w, b, impl=impl)  # noqa: E731
                fb = lambda x, w, b, dy, f=f: jax.vjp(f, x, w, b)[1](dy)  # noqa: E731
            fns[impl] = (jax.jit(f), jax.jit(fb))
        n_in = 2 if name == "cross_entropy" else 3
        err = rel_err(fns["pallas"][0](*sets[0][:n_in]), fns["xla"][0](*sets[0][:n_in]))
        log(f"{name} {shape}: rel err vs xla {err:.2e}")
        elems = N * D * 2  # bf16 bytes of one [N, D] array
        fwd_bytes = elems if name == "cross_entropy" else 2 * elems
        fb_bytes = 3 * elems if name == "cross_entropy" else 5 * elems
        for impl, (f, fb) in fns.items():
            t_f = median_seconds(f, [s[:n_in] for s in sets], args.warmup, args.reps)
            t_fb = median_seconds(fb, sets, args.warmup, args.reps)
            extra = {"rel_err": err, "checked_against": "xla"} if impl == "pallas" else {}
            rows.append(
                row(name, shape, "fwd", impl, t_f, bytes_=fwd_bytes, ceilings=ceilings, **extra)
            )
            rows.append(
                row(name, shape, "fwd+bwd", impl, t_fb, bytes_=fb_bytes, ceilings=ceilings, **extra)
            )
    return rows


def bench_matmul(args, ceilings) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from meshtrain.kernels import matmul

    rows = []
    for M, Kd, N in args.shapes["matmul"]:
        shape = {"m": M, "k": Kd, "n": N, "activation": "gelu"}
        sets = []
        for i in range(3):
            ks = jax.random.split(jax.random.key(300 + i), 4)
            sets.append(
                (
                    jax.random.normal(ks[0], (M, Kd), jnp.bfloat16),
                    (jax.random.normal(ks[1], (Kd, N)) / Kd**0.5).astype(jnp.bfloat16),
                    jax.random.normal(ks[2], (N,)),
                    jax.random.normal(ks[3], (M, N), jnp.bfloat16),
                )
            )
        fns = {}
        for impl in ("pallas", "xla"):
            f = lambda x, w, b, impl=impl: matmul(x, w, b, activation="gelu", impl=impl)  # noqa: E731
            fb = lambda x, w, b, g, f=f: jax.vjp(f, x, w, b)[1](g)  # noqa: E731
            fns[impl] = (jax.jit(f), jax.jit(fb))
        err = rel_err(fns["pallas"][0](*sets[0][:3]), fns["xla"][0](*sets[0][:3]))
        log(f"matmul {shape}: rel err vs xla {err:.2e}")
        flops = 2 * M * Kd * N
        io = 2 * (M * Kd + Kd * N + M * N)
        for impl, (f, fb) in fns.items():
            t_f = median_seconds(f, [s[:3] for s in sets], args.warmup, args.reps)
            t_fb = median_seconds(fb, sets, args.warmup, args.reps)
            extra = {"rel_err": err, "checked_against": "xla"} if impl == "pallas" else {}
            rows.append(
                row(
                    "matmul",
                    shape,
                    "fwd",
                    impl,
                    t_f,
                    flops=flops,
                    bytes_=io,
                    ceilings=ceilings,
                    **extra,
                )
            )
            # backward: the recomputed pre-activation plus dx and dw, three matmuls
            rows.append(
                row(
                    "matmul",
                    shape,
                    "fwd+bwd",
                    impl,
                    t_fb,
                    flops=4 * flops,
                    bytes_=3 * io,
                    ceilings=ceilings,
                    **extra,
                )
            )
    return rows


def cpu_smoke() -> dict:
    """Tiny interpret-mode checks of every kernel against its reference (no timings)."""
    import jax

    import meshtrain.kernels as K
    from meshtrain.kernels import reference as R

    ks = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(ks[0], (1, 24, 2, 64))
    kv = jax.random.normal(ks[1], (1, 24, 1, 64))
    x = jax.random.normal(ks[2], (20, 48))
    w = 1 + 0.1 * jax.random.normal(ks[3], (48,))
    b = 0.1 * jax.random.normal(ks[4], (48,))
    t = jax.random.randint(ks[5], (20,), 0, 48)
    mw = jax.random.normal(ks[3], (48, 40)) / 7
    mb = jax.random.normal(ks[4], (40,))
    return {
        "flash_attention": rel_err(
            K.flash_attention(q, kv, kv, impl="pallas", block_q=16, block_k=16),
            R.attention(q, kv, kv),
        ),
        "rms_norm": rel_err(K.rms_norm(x, w, impl="pallas"), R.rms_norm(x, w)),
        "layer_norm": rel_err(K.layer_norm(x, w, b, impl="pallas"), R.layer_norm(x, w, b)),
        "cross_entropy": rel_err(
            K.token_cross_entropy(x, t, impl="pallas"), R.token_cross_entropy(x, t)
        ),
        "matmul": rel_err(
            K.matmul(x, mw, mb, activation="gelu", impl="pallas"),
            R.matmul(x, mw, mb, activation="gelu"),
        ),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    from meshtrain.measure import environment

    out = {"benchmark": "kernels", **environment()}
    args.shapes = SELFTEST_SHAPES if args.selftest else SHAPES
    if args.selftest:
        args.warmup, args.reps = 1, 2
    if jax.default_backend() != "gpu" and not args.selftest:
        log("no GPU: running the interpret-mode correctness smoke only")
        out["gpu_figures"] = "unmeasured"
        out["note"] = (
            "no GPU on this machine; GPU timings are unmeasured. smoke_rel_err is each Pallas "
            "kernel (interpreted) vs its jnp reference on tiny float32 inputs"
        )
        out["smoke_rel_err"] = cpu_smoke()
    else:
        on_gpu = jax.default_backend() == "gpu" and not args.selftest
        out["gpu_figures"] = "measured" if on_gpu else "unmeasured"
        if args.selftest:
            out["note"] = "selftest: tiny shapes; the times are not performance figures"
        out["method"] = {"warmup": args.warmup, "reps": args.reps, "statistic": "median"}
        out["ceilings"] = measure_ceilings(args)
        log("ceilings", out["ceilings"])
        wanted = set(args.only.split(","))
        rows = []
        if "attention" in wanted:
            rows += bench_attention(args, out["ceilings"])
        for name in ("rms_norm", "layer_norm", "cross_entropy"):
            if name in wanted:
                rows += bench_rowwise(args, out["ceilings"], name)
        if "matmul" in wanted:
            rows += bench_matmul(args, out["ceilings"])
        add_peer_ratios(rows)
        out["rows"] = rows
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
