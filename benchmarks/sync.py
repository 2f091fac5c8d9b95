"""Communicating less, measured: bytes per step and final loss per synchronisation scheme.
One JSON line per scheme on stdout.

A tiny byte-level GPT trains on the stdlib corpus on 8 simulated CPU devices (``data=8``,
strategy ``dp``: 8 replicas) under each scheme, from the same initial parameters on the same
batches, for a fixed number of steps. For each scheme the train step is compiled once; the
inspector (`meshtrain.comm.inspector.inspect_compiled`, what `mt.inspect` runs on the
programs it compiles) reads that very program's collectives, and the same executable trains.

- ``bytes_per_step``: what each device sends per step over the replica axes, as a
  bandwidth-optimal algorithm sends it (`Collective.wire_bytes`: an all-reduce sends
  2(n-1)/n of its buffer, an all-gather or all-to-all (n-1)/n), so int8's all-to-all +
  all-gather and fp32's all-reduce compare as the bytes on the wire do;
  ``buffer_bytes_per_step`` sums the buffers instead (the inspector's ``comm_bytes``).
  Gradient schemes send the same every step. Local SGD / DiLoCo send parameters only on a
  synchronisation step: that exchange sits in a conditional branch of the compiled step, so
  its bytes count 1/H per step (``sync_bytes`` is one synchronisation's), and what runs
  every step (the loss's mean, a few bytes) counts whole.
- ``ratio_to_fp32``: that over scheme ``none`` (the compiler's fp32 all-reduce).
- ``final_loss``: the mean training loss of the last 10 steps; ``eval_loss``: the loss of
  the parameters after the last step (under local SGD the last synchronised ones) on fixed
  held-out batches.
- ``cpu_step_s``: median wall time of one step on this CPU. Simulated devices share the host's
  cores: it says nothing about speed on accelerators.

    python benchmarks/sync.py            # every scheme; GPT d=64, 2 layers, T=64, 250 steps
    python benchmarks/sync.py --quick    # none and int8 + error feedback;
                                         # GPT d=32, 1 layer, T=32, 200 steps
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import meshtrain as mt  # noqa: E402
from meshtrain.comm.compile import FAST_CODEGEN  # noqa: E402
from meshtrain.comm.inspector import inspect_compiled  # noqa: E402
from meshtrain.layout import batch_shardings, process_rows, shard_batch  # noqa: E402
from meshtrain.loss import cross_entropy  # noqa: E402
from meshtrain.optim import make_optimizer, make_schedule  # noqa: E402
from meshtrain.replicas import replicas, with_sync  # noqa: E402
from meshtrain.run import RunSpec  # noqa: E402
from meshtrain.state import init_train_state  # noqa: E402
from meshtrain.train.step import jit_train_step  # noqa: E402

LOSSY = ("bf16", "int8", "topk:0.01", "sign")


def schemes(quick: bool = False) -> list[tuple[str, mt.SyncConfig]]:
    """The (name, settings) pairs to run."""
    if quick:
        return [("none", mt.SyncConfig()), ("int8+ef", mt.SyncConfig(grad_compression="int8"))]
    out = [("none", mt.SyncConfig())]
    for codec in LOSSY:
        for ef in (True, False):
            name = f"{codec}+ef" if ef else codec
            out.append((name, mt.SyncConfig(grad_compression=codec, error_feedback=ef)))
    for h in (1, 4, 16):
        out.append((f"local-average-H{h}", mt.SyncConfig(sync_every=h)))
    for h in (4, 16):
        out.append((f"diloco-H{h}", mt.SyncConfig(sync_every=h, outer_optimizer="nesterov")))
    for s in (1, 4, 16):
        out.append((f"staleness-{s}", mt.SyncConfig(staleness=s)))
    return out


@dataclasses.dataclass
class Setup:
    """What every scheme shares: model, mesh, optimizer, initial parameters, batches."""

    model: mt.GPTConfig
    data: object
    mesh: object
    rules: object
    tx: object
    schedule: object
    params: dict
    batches: list
    held_out: list
    steps: int


def setup(
    steps: int,
    *,
    d_model: int = 64,
    n_layers: int = 2,
    seq_len: int = 64,
    batch_size: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
) -> Setup:
    """The tiny char-LM on ``data=8`` (dp) and `steps` batches of the stdlib corpus.

    Args:
        steps: optimizer steps every scheme runs.
        d_model, n_layers, seq_len, batch_size: the model and batch (vocabulary 256, bytes).
        lr: AdamW's peak learning rate (warm-up 10 steps, cosine to 0.1·lr).
        seed: parameter and data seed.

    Returns:
        A `Setup`.
    """
    model = mt.GPTConfig(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=4,
        max_seq_len=seq_len,
        vocab_size=256,
    )
    data = mt.make_dataset(
        mt.DataConfig(seq_len=seq_len, batch_size=batch_size, seed=seed, max_bytes=1_000_000)
    )
    mesh = mt.make_mesh("data=8")
    rules = mt.rules_for("dp", mesh)
    optim = mt.OptimConfig(lr=lr, warmup_steps=10)
    graphdef, state = nnx.split(model.build(rngs=nnx.Rngs(params=seed)))
    del graphdef
    params = jax.device_get(nnx.to_pure_dict(state.filter(nnx.Param)))
    it = data.train_iter(process_rows(mesh, rules, batch_size))
    batches = [next(it) for _ in range(steps)]
    held_out = data.eval_batches(4)
    return Setup(
        model,
        data,
        mesh,
        rules,
        make_optimizer(optim, steps),
        make_schedule(optim, steps),
        params,
        batches,
        held_out,
        steps,
    )


def replica_bytes(inspection, axes: tuple[str, ...], sync_every: int) -> dict:
    """Bytes per device of the collectives over the replica `axes`, per step.

    ``bytes_per_step`` counts what each device sends with a bandwidth-optimal algorithm
    (`Collective.wire_bytes`: 2(n-1)/n of the buffer for an all-reduce, (n-1)/n for an
    all-gather or all-to-all), so an int8 all-to-all + all-gather compares with an fp32
    all-reduce as the bytes on the wire do; ``buffer_bytes_per_step`` sums the buffers
    (`Collective.buffer_bytes`, the inspector's ``comm_bytes``). Collectives inside a
    conditional's branches (`Collective.conditional`) run only on the steps that take the
    branch (local SGD's synchronisation, every `sync_every` steps): they count 1/`sync_every`
    per step, and ``sync_bytes`` is one synchronisation's (sent).
    """
    sent = {"every": 0.0, "sync": 0.0}
    buffers = {"every": 0.0, "sync": 0.0}
    for c in inspection.collectives:
        if _axes_of(c, inspection.mesh) != axes:
            continue
        where = "sync" if c.conditional else "every"
        sent[where] += c.count * c.wire_bytes
        buffers[where] += c.count * c.buffer_bytes
    return {
        "bytes_per_step": sent["every"] + sent["sync"] / sync_every,
        "buffer_bytes_per_step": buffers["every"] + buffers["sync"] / sync_every,
        "sync_bytes": sent["sync"],
    }


def _axes_of(c, sizes) -> tuple[str, ...]:
    """The mesh axes a collective's replica groups run over."""
    from meshtrain.comm.axes import axes_of_groups

    return tuple(axes_of_groups(c.groups, sizes, permute=c.kind == "collective-permute"))


def run_scheme(s: Setup, sync: mt.SyncConfig | None, fast_compile: bool = False) -> dict:
    """Compiles, inspects and trains one scheme from `s`'s parameters on `s`'s batches.

    `fast_compile` skips XLA's LLVM optimisations (`meshtrain.comm.compile.FAST_CODEGEN`):
    the same collectives, half the compile time, slower steps.

    Returns:
        ``losses`` (one per step), ``eval_loss``, the byte counts of `replica_bytes`,
        ``compile_s`` and ``cpu_step_s`` (median).
    """
    mesh, rules = s.mesh, s.rules
    ctor = lambda: s.model.build(rngs=nnx.Rngs(params=0))  # noqa: E731 - shapes only
    graphdef, state, shardings = init_train_state(ctor, s.tx, mesh, rules, s.params)
    state, shardings = with_sync(sync, s.tx, state, shardings, mesh, rules)
    batch_sh = batch_shardings(s.batches[0], mesh, rules)
    run = RunSpec(
        model=s.model,
        data=s.data,
        mesh=mesh,
        rules=rules,
        sync=sync or mt.SyncConfig(),
        loss_fn=cross_entropy,
    )
    step = jit_train_step(run, graphdef, s.tx, shardings, batch_sh, schedule=s.schedule)
    first = shard_batch(s.batches[0], mesh, rules)
    t0 = time.perf_counter()
    compiled = step.lower(state, first).compile(FAST_CODEGEN if fast_compile else None)
    compile_s = time.perf_counter() - t0
    _, param_vars, _ = nnx.split(ctor(), nnx.Param, ...)
    inspection = inspect_compiled(compiled, run, param_vars=param_vars)
    axes, _ = replicas(mesh, rules)
    h = sync.sync_every if sync is not None and sync.local else 1
    counts = replica_bytes(inspection, axes, h)
    metrics, times = [], []
    for b in s.batches:
        batch = shard_batch(b, mesh, rules)
        t = time.perf_counter()
        state, m = compiled(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t)
        metrics.append(m["loss"])
    losses = [float(x) for x in jax.device_get(metrics)]
    return {
        "losses": losses,
        "eval_loss": eval_loss(s, graphdef, state.params, state.rest),
        **counts,
        "compile_s": compile_s,
        "cpu_step_s": float(np.median(times[1:] or times)),
    }


_EVAL = {}


def eval_loss(s: Setup, graphdef, params, rest) -> float:
    """Mean cross-entropy of `params` on `s`'s held-out batches (one jit for every scheme)."""
    key = id(s)
    if key not in _EVAL:

        def loss(params, rest, inputs, targets):
            logits = nnx.merge(graphdef, params, rest)(inputs)
            return cross_entropy(logits, targets)

        _EVAL[key] = jax.jit(loss)
    params, rest = jax.device_get((params, rest))
    values = [float(_EVAL[key](params, rest, b["inputs"], b["targets"])) for b in s.held_out]
    return float(np.mean(values))


def settings(sync: mt.SyncConfig) -> dict:
    """The fields of `sync` that differ from the defaults (the CLI flags to reproduce it)."""
    default = mt.SyncConfig()
    return {
        f.name: getattr(sync, f.name)
        for f in dataclasses.fields(sync)
        if getattr(sync, f.name) != getattr(default, f.name)
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="none and int8 with error feedback; GPT d=32, 1 layer, T=32",
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per scheme (250; 200)")
    parser.add_argument("--only", default="", help="comma-separated scheme names to run")
    args = parser.parse_args(argv)
    quick = args.quick
    steps = args.steps or (200 if quick else 250)
    chosen = schemes(quick)
    if args.only:
        keep = set(args.only.split(","))
        chosen = [x for x in chosen if x[0] in keep]
    size = {"d_model": 32, "n_layers": 1, "seq_len": 32} if quick else {}
    s = setup(steps, **size)
    device = (
        f"{os.cpu_count()}-core CPU ({platform.machine()}), "
        f"{len(jax.devices())} simulated {jax.devices()[0].platform} devices"
    )
    model = (
        f"gpt d={s.model.d_model} L={s.model.n_layers} T={s.model.max_seq_len} "
        f"batch={len(s.batches[0]['inputs'])} vocab=256 stdlib"
    )
    fp32 = None
    for name, sync in chosen:
        print(f"{name} ...", file=sys.stderr, flush=True)
        r = run_scheme(s, sync, fast_compile=quick)
        if name == "none":
            fp32 = r["bytes_per_step"]
        tail = r["losses"][-10:]
        print(
            json.dumps(
                {
                    "scheme": name,
                    "settings": settings(sync),
                    "mesh": "data=8",
                    "strategy": "dp",
                    "replicas": 8,
                    "model": model,
                    "steps": steps,
                    "bytes_per_step": round(r["bytes_per_step"]),
                    "buffer_bytes_per_step": round(r["buffer_bytes_per_step"]),
                    "sync_bytes": round(r["sync_bytes"]),
                    "sync_every": sync.sync_every or 1,
                    "ratio_to_fp32": round(r["bytes_per_step"] / fp32, 4) if fp32 else None,
                    "final_loss": round(float(np.mean(tail)), 4),
                    "last_loss": round(r["losses"][-1], 4),
                    "eval_loss": round(r["eval_loss"], 4),
                    "cpu_step_s": round(r["cpu_step_s"], 4),
                    "compile_s": round(r["compile_s"], 2),
                    "device": device,
                    "jax_version": jax.__version__,
                    "date": datetime.date.today().isoformat(),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
