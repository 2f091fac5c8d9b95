"""The grouped matmul of dropless MoE dispatch, timed: the tiled loop against XLA's ragged_dot.

One MoE layer's expert work on one device: A = tokens · k rows sorted by expert, E groups
(sizes from a random routing), the three SwiGLU projections ``[A, D] → [A, F] → [A, D]``
forward, and forward + backward. For each implementation (``tiled`` at several tile heights,
``xla`` = `jax.lax.ragged_dot`) it prints the median time over ``--reps`` calls after
``--warmup`` calls (rotating among three input sets; each call synchronised), the achieved
TFLOP/s counted on the *active* rows only (6·A·D·F forward, 3× that forward + backward), and
the largest relative error against ragged_dot. `meshtrain.kernels.grouped_matmul.auto_impl`
records the winner per backend.

``--layer`` also times one whole MoE layer (`meshtrain.models.moe.Experts`: router, routing,
dispatch, experts, combine; forward + backward) with capacity dispatch and with dropless
dispatch on each grouped-matmul implementation, in tokens/s.

    python benchmarks/grouped_matmul.py               # on a GPU: Mixtral-like widths
    python benchmarks/grouped_matmul.py --quick       # small shapes (CPU)

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from meshtrain.kernels.grouped_matmul import grouped_matmul


def _experts(impl: str, tile: int | None):
    """The SwiGLU experts on expert-sorted rows, with one grouped-matmul implementation."""

    def f(x_AD, sizes_E, gate, up, down):
        g = grouped_matmul(x_AD, gate, sizes_E, impl=impl, tile=tile)
        u = grouped_matmul(x_AD, up, sizes_E, impl=impl, tile=tile)
        return grouped_matmul(jax.nn.silu(g) * u, down, sizes_E, impl=impl, tile=tile)

    return f


def _inputs(key, tokens: int, k: int, E: int, D: int, F: int, dtype):
    """Rows sorted by a random routing's experts, their group sizes, and the weights."""
    ks = jax.random.split(key, 5)
    expert_A = jnp.sort(jax.random.randint(ks[0], (tokens * k,), 0, E))
    sizes_E = jnp.bincount(expert_A, length=E).astype(jnp.int32)
    x = jax.random.normal(ks[1], (tokens * k, D), dtype)
    w = [jax.random.normal(kk, s, dtype) / s[1] ** 0.5
         for kk, s in zip(ks[2:], [(E, D, F), (E, D, F), (E, F, D)], strict=True)]  # fmt: skip
    return (x, sizes_E, *w)


def _time(fn, arg_sets, warmup: int, reps: int) -> float:
    """Median seconds of `fn` over `reps` synchronised calls, rotating the input sets."""
    jax.block_until_ready(fn(*arg_sets[0]))
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rel(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float32."""
    a, b = (jnp.asarray(t, jnp.float32) for t in (a, b))
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def _layer_rows(args, tokens: int, D: int, F: int, dtype) -> list[dict]:
    """Tokens/s of one MoE layer's forward + backward per dispatch and grouped matmul."""
    from flax import nnx

    from meshtrain.models import MoEConfig
    from meshtrain.models.moe import Experts

    T = 2048 if tokens >= 2048 else tokens
    B = tokens // T
    name = jnp.dtype(dtype).name
    xs = [jax.random.normal(jax.random.key(10 + i), (B, T, D), dtype) for i in range(3)]
    rows = []
    for dispatch, impl in (("capacity", "auto"), ("dropless", "xla"), ("dropless", "tiled")):
        cfg = MoEConfig(d_model=D, n_heads=max(1, D // 128), n_experts=8, top_k=2, d_expert=F,
                        dtype=name, dispatch=dispatch, grouped_impl=impl)  # fmt: skip
        graphdef, params = nnx.split(Experts(cfg, rngs=nnx.Rngs(0)))

        def loss(p, x, graphdef=graphdef):
            y, stats = nnx.merge(graphdef, p)(x)
            return jnp.mean(y.astype(jnp.float32) ** 2) + stats["aux_loss"]

        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        s = _time(step, [(params, x) for x in xs], args.warmup, args.reps)
        row = {"dispatch": dispatch, "grouped_impl": impl if dispatch == "dropless" else None,
               "fwd+bwd_ms": round(s * 1e3, 3), "tokens_per_s": round(tokens / s)}  # fmt: skip
        rows.append(row)
        print(f"[grouped_matmul] layer {row}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Times every implementation; prints one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes (for a CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tiles", default="", help="tile heights, comma-separated")
    p.add_argument("--layer", action="store_true", help="also time one whole MoE layer")
    args = p.parse_args(argv)
    if args.quick:
        tokens, k, E, D, F, dtype, tiles = 512, 2, 8, 64, 128, jnp.float32, (16, 64)
    else:
        tokens, k, E, D, F, dtype, tiles = 8192, 2, 8, 4096, 14336, jnp.bfloat16, (128, 256, 512)
    if args.tiles:
        tiles = tuple(int(t) for t in args.tiles.split(","))
    arg_sets = [_inputs(jax.random.key(i), tokens, k, E, D, F, dtype) for i in range(3)]
    active = 6 * tokens * k * D * F
    cases = [("xla", None)] + [("tiled", t) for t in tiles]
    rows, ref_fwd, ref_grads = [], None, None
    for impl, tile in cases:
        f = _experts(impl, tile)
        fwd = jax.jit(f)

        def loss(x, sizes, *w, f=f):
            return jnp.sum(f(x, sizes, *w).astype(jnp.float32) ** 2)

        both = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4)))
        out, grads = fwd(*arg_sets[0]), both(*arg_sets[0])
        if ref_fwd is None:
            ref_fwd, ref_grads = out, grads
        err = max(_rel(out, ref_fwd), *(_rel(g, r) for g, r in zip(grads, ref_grads, strict=True)))
        row = {"impl": impl, "tile": tile, "rel_err_vs_xla": round(err, 6)}
        for name, fn, flops in (("fwd", fwd, active), ("fwd+bwd", both, 3 * active)):
            s = _time(fn, arg_sets, args.warmup, args.reps)
            row[f"{name}_ms"] = round(s * 1e3, 3)
            row[f"{name}_active_tflops"] = round(flops / s / 1e12, 2)
        rows.append(row)
        print(f"[grouped_matmul] {row}", file=sys.stderr, flush=True)
    layer = _layer_rows(args, tokens, D // 2, F // 2, dtype) if args.layer else None
    dev = jax.devices()[0]
    print(
        json.dumps(
            {
                "benchmark": "grouped_matmul",
                "platform": dev.platform,
                "device_kind": dev.device_kind,
                "jax_version": jax.__version__,
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "shape": {
                    "tokens": tokens,
                    "top_k": k,
                    "experts": E,
                    "d_model": D,
                    "d_expert": F,
                    "dtype": jnp.dtype(dtype).name,
                },  # fmt: skip
                "method": {"warmup": args.warmup, "reps": args.reps, "statistic": "median"},
                "rows": rows,
                "layer": layer,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
