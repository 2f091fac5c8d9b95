"""Context parallelism: compiled per-device memory against sequence length, and the bytes each
algorithm moves against the analytic count.

Nothing runs; every figure is read from a compiled program (8 simulated CPU devices):

- ``memory`` cases: the loss-and-gradient of a small Llama-style GPT (batch 1) on a mesh of
  ``seq = n`` devices, for each sequence length and n ∈ {1, 2, 4, 8}, with the default ring
  algorithm. ``temp_bytes`` is XLA's per-device temporary allocation (`memory_analysis`); the
  target is that it falls as 1/seq, and ``ratio_vs_seq1`` reports temp(seq=1) / temp(seq=n).
- ``bytes`` cases: one attention call's forward and backward (``context_attention`` under
  `jax.grad`) per algorithm on ``seq = n``; the compiled HLO's collective-permute, all-to-all,
  all-gather and reduce-scatter result bytes per device, against the analytic count.
- ``ring_backward``: the ring's custom VJP against autodiff of the same ring (temp bytes).
- ``half_ring``: the half-work causal ring (zig-zag layout, ``ring.for_positions``) over the
  whole-block ring, one attention call's forward and backward per seq ∈ {2, 4, 8}:
  ``flops_ratio`` from XLA's ``cost_analysis`` (which counts a while loop's body once, so the
  ring's n − 1 hops weigh as one), ``loop_flops_ratio`` from the compiled HLO's dots, each
  counted as often as its loops run (the per-device work), ``pairs_ratio`` the closed form
  (`zigzag.half_pairs` over 4n·c²), and ``temp_ratio`` of ``memory_analysis`` temp bytes.

    python benchmarks/context.py            # T up to 2048: minutes on a 2-core machine
    python benchmarks/context.py --quick    # tiny sizes (the smoke test)
    python benchmarks/context.py --half     # the half_ring case alone (T = 2048)
    python benchmarks/context.py --flash    # the ring with the Pallas kernel (T = 8192, seq 8)
    python benchmarks/context.py --plot docs/context_memory.png < results.jsonl  # the figure
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain import context_parallel as cp
from meshtrain.comm import hlo as comm_hlo
from meshtrain.context_parallel import ring as ring_mod
from meshtrain.context_parallel import zigzag
from meshtrain.context_parallel.blocks import Options
from meshtrain.layout import activation_rules, manual_region, rules_for
from meshtrain.lower import cross_entropy
from meshtrain.mesh import make_mesh
from meshtrain.models import GPTConfig, build_model

OPTS = Options(causal=True)  # the benchmarked attention: causal, no window, the jnp blocks
OPS = ("collective-permute", "all-to-all", "all-gather", "reduce-scatter")


def collective_bytes(hlo: str) -> dict[str, int]:
    """Result bytes per device per call of each collective kind in a compiled HLO module,
    counting each op as often as the loops around it run (`meshtrain.comm.hlo`)."""
    out = dict.fromkeys(OPS, 0)
    for c in comm_hlo.collectives(hlo):
        if c.kind in out:
            out[c.kind] += c.count * c.result_bytes
    return out


def gpt_memory(cfg: GPTConfig, T: int, n: int) -> int:
    """Per-device temp bytes of the GPT's loss and gradient at length T on seq = n devices."""
    mesh = make_mesh(f"seq={n}", devices=jax.devices()[:n])
    rules = rules_for("dp", mesh)
    model = nnx.eval_shape(lambda: build_model(cfg))
    graphdef, params = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)

    def loss(params, tokens):
        with activation_rules(mesh, rules):
            logits = nnx.merge(graphdef, params)(tokens)
            return cross_entropy(logits[:, :-1], tokens[:, 1:])

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def attention_program(algorithm, n, B, T, H, G, K, *, autodiff_ring=False):
    """The compiled forward + backward of one context-parallel attention call."""
    mesh = make_mesh(f"seq={n}", devices=jax.devices()[:n])
    idx = jnp.asarray(cp.order(T, n))
    q = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, G, K), jnp.float32)
    if autodiff_ring:
        seq = jax.P(None, "seq")

        def attend(q, k, v):
            fn = lambda q, k, v, p: ring_mod.ring_autodiff(q, k, v, p, p, "seq", OPTS)
            region = manual_region(
                fn, mesh=mesh, axes={"seq"}, in_specs=(seq, seq, seq, jax.P("seq")),
                out_specs=seq,
            )  # fmt: skip
            return region(q, k, v, idx)
    else:

        def attend(q, k, v):
            return cp.context_attention(q, k, v, idx, mesh=mesh, algorithm=algorithm)

    def loss(q, k, v, w):  # a random cotangent: a constant one would fold collectives away
        return (attend(q, k, v) * w).sum()

    with jax.set_mesh(mesh):  # the value too, so the forward's last collective stays live
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(q, kv, kv, q).compile()


def analytic(algorithm, n, B, T, H, G, K) -> dict[str, int]:
    """Result bytes per device each algorithm's forward + backward moves (float32, int32)."""
    Tl = T // n
    kv, pos = B * Tl * G * K * 4, Tl * 4  # one device's k (or v) block; its positions
    out = dict.fromkeys(OPS, 0)
    if algorithm == "ring":
        # k, v and positions hop n − 1 times in each pass; dk, dv hop n times (back home)
        out["collective-permute"] = 2 * (n - 1) * (2 * kv + pos) + n * 2 * kv
    elif algorithm == "allgather":
        out["all-gather"] = n * (2 * kv + pos)  # the whole k, v and positions, gathered once
        out["reduce-scatter"] = 2 * kv  # dk, dv scattered back
    else:  # ulysses: q, k, v (k, v repeated to H heads when seq does not divide G) and out
        g = G if G % n == 0 else H
        qo, kvh = B * Tl * H * K * 4, B * Tl * g * K * 4
        out["all-to-all"] = 2 * (2 * qo + 2 * kvh)  # forward q, k, v, o; backward the same
        out["all-gather"] = n * pos  # the positions (of queries and keys alike)
    return out


def half_ring_program(n, B, T, H, G, K, *, halve):
    """The compiled forward + backward of one causal ring call on the zig-zag layout: the
    half-work ring as `ring.for_positions` picks it, or the whole-block ring."""
    mesh = make_mesh(f"seq={n}", devices=jax.devices()[:n])
    idx = cp.order(T, n)
    fn = ring_mod.for_positions(idx, n, OPTS) if halve else ring_mod.ring
    assert not halve or fn.keywords["halve"], "the zig-zag layout must take the half-work ring"
    seq = jax.P(None, "seq")
    region = manual_region(
        lambda q, k, v, p: fn(q, k, v, p, p, "seq", OPTS), mesh=mesh, axes={"seq"},
        in_specs=(seq, seq, seq, jax.P("seq")), out_specs=seq,
    )  # fmt: skip
    q = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, G, K), jnp.float32)

    def loss(q, k, v, w):
        return (region(q, k, v, jnp.asarray(idx, jnp.int32)) * w).sum()

    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(q, kv, kv, q).compile()


_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = [a-z0-9]+\[([\d,]*)\]")
_DOT = re.compile(r" dot\(%?([\w.\-]+), %?[\w.\-]+\).*lhs_contracting_dims=\{([\d,]*)\}")


def loop_dot_flops(hlo: str) -> int:
    """FLOPs per device of the dots of a compiled HLO module (2 × result size × contracted
    size), each counted as often as the while loops around it run."""
    comps, entry = comm_hlo.computations(hlo)
    times, _ = comm_hlo.executions(comps, entry)
    total = 0
    for name, lines in comps.items():
        dims = {}
        for line in lines:
            d = _DEF.match(line)
            if d:
                dims[d.group(1)] = [int(x) for x in d.group(2).split(",") if x]
            dot = _DOT.search(line)
            if d and dot:
                lhs = dims[dot.group(1)]
                contracted = math.prod(lhs[int(i)] for i in dot.group(2).split(",") if i)
                total += times.get(name, 0) * 2 * math.prod(dims[d.group(1)]) * contracted
    return total


def half_ring_lines(quick: bool, device: str):
    """One JSON line per seq: the half-work ring over the whole-block ring."""
    B, T, H, G, K = 1, (128 if quick else 2048), 8, 2, (16 if quick else 64)
    for n in (2, 4, 8):
        got = {}
        for halve in (True, False):
            compiled = half_ring_program(n, B, T, H, G, K, halve=halve)
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            got[halve] = dict(
                flops=cost["flops"], loop_flops=loop_dot_flops(compiled.as_text()),
                temp=compiled.memory_analysis().temp_size_in_bytes,
            )  # fmt: skip
        c = T // (2 * n)
        half, whole = got[True], got[False]
        line = dict(case="half_ring", seq=n, T=T, batch=B, heads=H, kv_heads=G, head_dim=K)
        line.update(
            flops_ratio=round(half["flops"] / whole["flops"], 4),
            loop_flops_ratio=round(half["loop_flops"] / whole["loop_flops"], 4),
            pairs_ratio=round(zigzag.half_pairs(n, c, ring_mod.LEAF) / (4 * n * c * c), 4),
            temp_ratio=round(half["temp"] / whole["temp"], 4),
            half=half, whole=whole, leaf=ring_mod.LEAF, device=device, jax=jax.__version__,
        )  # fmt: skip
        print(json.dumps(line), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--plot", help="draw the memory lines read from stdin to this PNG; no compile")
    ap.add_argument("--half", action="store_true", help="only the half-work ring case")
    ap.add_argument("--flash", action="store_true", help="only the ring with the Pallas kernel")
    ap.add_argument(
        "--segments", action="store_true", help="only each algorithm without and with segment ids"
    )
    args = ap.parse_args(argv)
    if args.plot:
        return plot([json.loads(line) for line in sys.stdin if line.strip()], args.plot)
    quick = args.quick
    if args.half:
        half_ring_lines(quick, jax.devices()[0].device_kind)
        return 0
    if args.flash:
        flash_lines(quick, jax.devices()[0].device_kind)
        return 0
    if args.segments:
        segment_lines(quick, jax.devices()[0].device_kind)
        return 0
    lengths = [128, 256] if quick else [512, 1024, 2048]
    seqs = [1, 2, 4] if quick else [1, 2, 4, 8]
    cfg = GPTConfig(
        style="llama", n_layers=2, d_model=64, n_heads=8, n_kv_heads=2, max_seq_len=max(lengths)
    )
    device = jax.devices()[0].device_kind
    for T in lengths:
        base = None
        for n in seqs:
            temp = gpt_memory(cfg, T, n)
            base = base or temp
            line = dict(case="memory", T=T, seq=n, algorithm="ring", temp_bytes=temp)
            line.update(ratio_vs_seq1=round(base / temp, 2), ideal=n, device=device)
            print(json.dumps(line), flush=True)
    B, T, H, G, K = 1, (64 if quick else 1024), 8, 2, 16
    for algorithm in cp.ALGORITHMS:
        for n in [2, 4] if quick else [2, 4, 8]:
            got = collective_bytes(attention_program(algorithm, n, B, T, H, G, K).as_text())
            want = analytic(algorithm, n, B, T, H, G, K)
            line = dict(case="bytes", algorithm=algorithm, seq=n, T=T, heads=H, kv_heads=G)
            line.update(measured=got, analytic=want, match=got == want, device=device)
            print(json.dumps(line), flush=True)
    n = 4
    for name, autodiff in (("custom_vjp", False), ("autodiff", True)):
        compiled = attention_program("ring", n, B, T, H, G, K, autodiff_ring=autodiff)
        temp = compiled.memory_analysis().temp_size_in_bytes
        line = dict(case="ring_backward", backward=name, seq=n, T=T, temp_bytes=temp)
        print(json.dumps(line | {"device": device}), flush=True)
    half_ring_lines(quick, device)
    return 0


def plot(lines: list[dict], path: str) -> int:
    """Per-device temp memory against sequence length, one line per seq size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = [x for x in lines if x["case"] == "memory"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for n in sorted({x["seq"] for x in memory}):
        pts = sorted((x["T"], x["temp_bytes"] / 2**20) for x in memory if x["seq"] == n)
        ax.loglog(*zip(*pts, strict=True), "o-", label=f"seq={n}")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("compiled temp memory per device (MiB)")
    ax.set_title(f"GPT loss + gradient, ring attention ({memory[0]['device']}, simulated)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return 0


# --- the Pallas kernel inside the ring ------------------------------------------------------


def flash_program(impl, n, B, T, H, G, K):
    """The compiled forward + backward of causal ring attention on the zig-zag layout (the
    half-work ring) whose blocks run with `impl`."""
    mesh = make_mesh(f"seq={n}", devices=jax.devices()[:n])
    idx = cp.order(T, n)
    q = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, G, K), jnp.float32)

    def loss(q, k, v, w):
        o = cp.context_attention(q, k, v, idx, mesh=mesh, algorithm="ring", impl=impl)
        return (o * w).sum()

    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(q, kv, kv, q).compile()


def flash_lines(quick: bool, device: str):
    """One JSON line per block impl: compiled temp memory per device of the ring with the jnp
    blocks and with the Pallas flash kernel (T = 8192 on seq = 8; quick: T = 512 on seq = 4).
    Off the GPU the kernel is interpreted (lowered to ordinary XLA loops), so its row measures
    the interpreted kernel, which the row says."""
    B, H, G, K = 1, 8, 2, 64
    T, n = (512, 4) if quick else (8192, 8)
    kernel = "interpreted" if jax.default_backend() != "gpu" else "compiled"
    for impl in ("xla", "pallas"):
        start = time.perf_counter()
        compiled = flash_program(impl, n, B, T, H, G, K)
        seconds = round(time.perf_counter() - start, 1)
        line = dict(case="flash", impl=impl, T=T, seq=n, heads=H, kv_heads=G, head_dim=K)
        line.update(temp_bytes=compiled.memory_analysis().temp_size_in_bytes)
        line.update(kernel=kernel if impl == "pallas" else "none", compile_s=seconds)
        line.update(device=device, jax=jax.__version__)
        print(json.dumps(line), flush=True)


def segments_program(algorithm, n, B, T, H, G, K, *, segmented: bool):
    """The compiled forward + backward of one causal context-parallel attention call on the
    zig-zag layout, with (a packed batch's) or without segment ids."""
    mesh = make_mesh(f"seq={n}", devices=jax.devices()[:n])
    idx = cp.order(T, n)
    q = jax.ShapeDtypeStruct((B, T, H, K), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, G, K), jnp.float32)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def loss(q, k, v, w, seg):
        ids = seg if segmented else None
        o = cp.context_attention(q, k, v, idx, mesh=mesh, algorithm=algorithm, segment_ids=ids)
        return (o * w).sum()

    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(q, kv, kv, q, seg).compile()


def segment_lines(quick: bool, device: str):
    """One JSON line per algorithm and with/without segment ids: compiled temp memory per
    device (T = 1024 on seq = 4, jnp blocks; quick: T = 128)."""
    B, H, G, K = 1, 8, 2, 64
    T, n = (128, 4) if quick else (1024, 4)
    for algorithm in cp.ALGORITHMS:
        for segmented in (False, True):
            compiled = segments_program(algorithm, n, B, T, H, G, K, segmented=segmented)
            line = dict(case="segments", algorithm=algorithm, segment_ids=segmented, T=T, seq=n)
            line.update(heads=H, kv_heads=G, head_dim=K)
            line.update(temp_bytes=compiled.memory_analysis().temp_size_in_bytes)
            line.update(device=device, jax=jax.__version__)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
