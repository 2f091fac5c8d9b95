"""Checkpoint save overhead per training step on the default job: asynchronous vs synchronous.

Builds the default `meshtrain train` job's model, mesh, strategy and batch shape (a
Llama-style GPT, d_model 128, 4 layers, on ``data=2,fsdp=2,tensor=2`` with ``hsdp+tp``, batch
32 × 128 tokens), compiles its train step once, then runs rounds of `--steps` steps in three
modes, in rotating order:

- ``none``: no checkpoints;
- ``async``: `CheckpointManager.save` every `--save-every` steps, written in the background;
- ``sync``: the same saves, each waited for until committed.

One untimed round of each mode comes first (orbax's first save sets up its threads).

At every save point each mode (``none`` too) first waits for the step to finish. Each round is
timed from its first step to its last step's completion (async saves still in
flight at that point are waited for separately, outside the timed part, and reported as
``async_drain_s``). The overhead per step of a mode is (median round time − median ``none`` round
time) / steps; ``async_over_sync`` is the ratio of the two overheads. Because that difference
is noisy on a shared machine, the time the loop spends blocked inside ``save()`` is reported
too (``*_blocking_ms_per_step``, ``async_over_sync_blocking``): an asynchronous save blocks only
while it copies the arrays off the devices, a synchronous one until the files are committed.

Prints one JSON line on stdout; progress goes to stderr.

    python benchmarks/save_overhead.py           # defaults: about 2 minutes on a 2-core CPU
    python benchmarks/save_overhead.py --quick   # tiny sizes, few rounds (a smoke test)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from _common import emit, logger, parser, simulate_cpu_devices

MODES = ("none", "async", "sync")


log = logger("save_overhead")


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(
        "checkpoint save overhead, async vs sync",
        quick="tiny model and few steps (smoke test)",
        steps=20,
        steps_help="steps per timed round",
        devices=8,
    )
    p.add_argument("--save-every", type=int, default=5, help="steps between saves")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of each mode")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.save_every, args.rounds = 4, 2, 1
    if min(args.steps, args.save_every, args.rounds) < 1:
        p.error("--steps, --save-every and --rounds must be ≥ 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    simulate_cpu_devices(args.devices)

    import jax
    import numpy as np

    from meshtrain.checkpoint import CheckpointConfig, CheckpointManager
    from meshtrain.cli.train import TrainJob
    from meshtrain.layout import batch_shardings, rules_for, shard_batch
    from meshtrain.lower import RunSpec, init_train_state, jit_train_step, make_optimizer
    from meshtrain.mesh import describe, make_mesh
    from meshtrain.models import GPTConfig, build_model

    job = TrainJob()
    model = job.gpt
    seq, batch_size = job.data.seq_len, job.data.batch_size
    if args.quick:
        model = GPTConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
        seq, batch_size = 32, 16
    mesh = make_mesh(job.mesh)
    rules = rules_for(job.strategy, mesh)
    tx = make_optimizer(job.optim, job.train.steps)
    graphdef, state, shardings = init_train_state(lambda: build_model(model), tx, mesh, rules)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (batch_size, seq + 1), dtype=np.int32)
    batch_np = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    run = RunSpec(mesh=mesh, rules=rules)
    step = jit_train_step(run, graphdef, tx, shardings, batch_shardings(batch_np, mesh, rules))
    batch = shard_batch(batch_np, mesh, rules)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    log(f"mesh {describe(mesh)} · {job.strategy} · {model} · state {state_bytes / 2**20:.1f} MiB")
    state, metrics = step(state, batch)  # compile
    jax.block_until_ready(metrics)

    root = tempfile.mkdtemp(prefix="meshtrain-save-overhead-")
    times = {m: [] for m in MODES}
    blocked = {"async": 0.0, "sync": 0.0}  # seconds the training loop spent inside save()
    drains = []
    n_saves = 0
    try:
        for r in range(-1, args.rounds):  # round -1 warms orbax up and is not timed
            order = MODES[r % 3 :] + MODES[: r % 3]
            for mode in order:
                mgr = None
                if mode != "none":
                    config = CheckpointConfig(keep_last=2, async_save=mode == "async")
                    mgr = CheckpointManager(os.path.join(root, f"{mode}{r}"), config)
                start = time.perf_counter()
                for i in range(args.steps):
                    state, metrics = step(state, batch)
                    if (i + 1) % args.save_every == 0:
                        # Every mode waits for the step here, so that the time inside save()
                        # is the save's own, not the step's.
                        jax.block_until_ready(state)
                    if mgr is not None and (i + 1) % args.save_every == 0:
                        t = time.perf_counter()
                        mgr.save(int(state.step), state, wait=mode == "sync")
                        if r >= 0:
                            blocked[mode] += time.perf_counter() - t
                        n_saves += 1
                jax.block_until_ready((state, metrics))
                elapsed = time.perf_counter() - start
                if mgr is not None:
                    drain = time.perf_counter()
                    mgr.close()
                    if mode == "async" and r >= 0:
                        drains.append(time.perf_counter() - drain)
                if r >= 0:
                    times[mode].append(elapsed)
                log(f"round {r} {mode}: {elapsed:.2f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    median = {m: statistics.median(times[m]) for m in MODES}
    per_step = {m: (median[m] - median["none"]) / args.steps for m in ("async", "sync")}
    device = jax.devices()[0]
    result = {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": mesh.devices.size,
        "jax_version": jax.__version__,
        "mesh": job.mesh,
        "strategy": job.strategy,
        "state_mib": round(state_bytes / 2**20, 2),
        "steps_per_round": args.steps,
        "save_every": args.save_every,
        "rounds": args.rounds,
        "step_ms_no_checkpoints": 1e3 * median["none"] / args.steps,
        "async_overhead_ms_per_step": 1e3 * per_step["async"],
        "sync_overhead_ms_per_step": 1e3 * per_step["sync"],
        "async_overhead_fraction": per_step["async"] * args.steps / median["none"],
        "sync_overhead_fraction": per_step["sync"] * args.steps / median["none"],
        "async_over_sync": per_step["async"] / per_step["sync"] if per_step["sync"] else None,
        "async_blocking_ms_per_step": 1e3 * blocked["async"] / (args.rounds * args.steps),
        "sync_blocking_ms_per_step": 1e3 * blocked["sync"] / (args.rounds * args.steps),
        "async_over_sync_blocking": blocked["async"] / blocked["sync"],
        "async_drain_s": statistics.median(drains) if drains else None,
        "saves": n_saves,
    }
    emit(result)
    return result


if __name__ == "__main__":
    main()
