"""The Pallas flash attention's launch configurations, swept against cuDNN on a GPU: block
sizes, warps and pipelining stages, forward and backward, at sequence 2k-8k.

    python benchmarks/flash_sweep.py --budget 200           # on a GPU: the best per shape
    python benchmarks/flash_sweep.py --selftest             # the code path, on any backend

Shapes go most wanted first (head width 128 before 64, where the kernel trails cuDNN most;
sequence 4096, 8192, then 2048); within `--budget` seconds as many as fit, each with every
configuration, so a stopped sweep still names the best of the shapes it finished. Prints one
JSON line: per shape and configuration the forward+backward milliseconds, and cuDNN's;
`scripts/auto_table.py` turns the best configuration of each shape into the rows the kernel
reads (`meshtrain.kernels.autotable.flash_config`) and weighs the tuned kernel against cuDNN.
"""

from __future__ import annotations

import itertools
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _common, under PYTHONSAFEPATH
from _common import emit, logger, median_seconds, parser  # noqa: E402

log = logger("flash_sweep")

TOKENS, HEADS = 16384, 16  # batch × sequence per call, and query heads (as benchmarks/kernels.py)
SHAPES = [(T, K) for K in (128, 64) for T in (4096, 8192, 2048)]  # (sequence, head width)
CONFIGS = [
    {"block_q": bq, "block_k": bk, "warps": w, "stages": s}
    for bq, bk, w, s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3))
]
SELFTEST = {"shapes": [(64, 64)], "tokens": 64, "heads": 2,
            "configs": [{"block_q": 16, "block_k": 16, "warps": 4, "stages": 2},
                        {"block_q": 32, "block_k": 16, "warps": 8, "stages": 3}]}  # fmt: skip


def parse_args(argv=None):
    p = parser(__doc__.split("\n\n")[0], out=True)
    p.add_argument("--budget", type=float, default=200.0, help="seconds to sweep for")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls after compiling")
    p.add_argument("--reps", type=int, default=10, help="timed calls; the median is reported")
    p.add_argument("--selftest", action="store_true", help="tiny shapes, any backend")
    return p.parse_args(argv)


def fwd_bwd(impl: str, config: dict | None = None):
    """The jitted forward and backward of causal attention with `impl` (and `config`)."""
    import jax

    from meshtrain.kernels import flash_attention

    def f(q, k, v):
        return flash_attention(q, k, v, impl=impl, **(config or {}))

    def fb(q, k, v, do):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(do)

    return jax.jit(fb)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    on_gpu = jax.default_backend() == "gpu"
    shapes, tokens, heads, configs = SHAPES, TOKENS, HEADS, CONFIGS
    if args.selftest:
        shapes, tokens, heads, configs = (SELFTEST[k] for k in ("shapes", "tokens", "heads",
                                                                "configs"))  # fmt: skip
        args.warmup, args.reps = 0, 1
    from meshtrain.measure import environment

    record = {
        "benchmark": "flash_sweep",
        **environment(),
        "gpu_figures": "measured" if on_gpu and not args.selftest else "unmeasured",
        "method": {
            "warmup": args.warmup,
            "reps": args.reps,
            "statistic": "median",
            "pass": "fwd+bwd",
        },  # fmt: skip
        "rows": [],
    }
    start, finished = time.perf_counter(), []
    for T, K in shapes:
        if time.perf_counter() - start > args.budget:
            log(f"budget spent: stopped before seq {T}, head width {K}")
            break
        B = max(1, tokens // T)
        shape = {"batch": B, "seq": T, "heads": heads, "head_dim": K, "causal": True}
        keys = jax.random.split(jax.random.key(T + K), 4)
        qkv = [jax.random.normal(k, (B, T, heads, K), jnp.bfloat16) for k in keys]
        impls = [("cudnn", None)] if on_gpu else []
        for impl, config in [*impls, *(("pallas", c) for c in configs)]:
            row = {"kernel": "attention", "shape": shape, "pass": "fwd+bwd", "impl": impl}
            if config is not None:
                row["config"] = config
            try:
                seconds = median_seconds(fwd_bwd(impl, config), [qkv], args.warmup, args.reps)
                row["ms"] = 1e3 * seconds
            except Exception as e:  # noqa: BLE001 - a configuration Triton refuses is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            record["rows"].append(row)
        ok = [r for r in record["rows"] if r["shape"] == shape and "ms" in r]
        best = min((r for r in ok if r["impl"] == "pallas"), key=lambda r: r["ms"], default=None)
        cudnn = next((r["ms"] for r in ok if r["impl"] == "cudnn"), None)
        if best is not None:
            ratio = f", {cudnn / best['ms']:.2f}× cuDNN" if cudnn else ""
            log(f"seq {T}, head width {K}: best {best['config']} {best['ms']:.3f} ms{ratio}")
        finished.append(shape)
    record["complete"] = len(finished) == len(shapes)
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
