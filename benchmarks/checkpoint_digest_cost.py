"""What the checkpoint digests cost: saves and restores of a 125m model's train state with and
without them.

Builds the train state of the ``125m`` bench GPT (float32 parameters and Adam moments, about
1.5 GB) laid out ``fsdp`` over simulated CPU devices, filled with random values (nothing is
compiled but the digest program). Then, in alternating rounds:

- ``digest``: `meshtrain.checkpoint.digests.array_digests` of the state alone;
- ``save``: `CheckpointManager.save` (with digests) against the same save without them (an
  orbax manager of the same options and items, less ``digests``: the save before digests
  existed), both synchronous (waited for until committed) and asynchronous (the time the
  caller is blocked in ``save()``, and the time until committed);
- ``restore``: `meshtrain.checkpoint.restore` of a step with digests (read, then checked)
  against one without (read only).

Every figure is the median over ``--rounds``; the first of each kind is a warm-up and not
counted (compiles, orbax's threads). Prints one JSON line with the medians, the extra time as a
fraction of the save without digests, and the size of the ``digests`` item.

    python benchmarks/checkpoint_digest_cost.py               # about 5 minutes on 2 CPU cores
    python benchmarks/checkpoint_digest_cost.py --size tiny   # a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import emit, logger, parser, simulate_cpu_devices

log = logger("checkpoint_digest_cost")


def parse_args(argv=None) -> argparse.Namespace:
    p = parser("cost of checkpoint digests at save and restore", devices=8, out=True)
    p.add_argument("--size", default="125m", help="a bench size (meshtrain.bench.SIZES)")
    p.add_argument("--mesh", default="fsdp=8")
    p.add_argument("--strategy", default="fsdp")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of each figure")
    p.add_argument("--dir", default="", help="where to write (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give at least 1")
    return args


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> dict:
    args = parse_args(argv)
    simulate_cpu_devices(args.devices)

    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from meshtrain import bench
    from meshtrain._compat import orbax_state_handler_without_replica_slices
    from meshtrain.checkpoint import CheckpointConfig, CheckpointManager, restore
    from meshtrain.checkpoint.digests import array_digests
    from meshtrain.layout import rules_for
    from meshtrain.mesh import make_mesh
    from meshtrain.models import GPTConfig, build_model
    from meshtrain.optim import OptimConfig, make_optimizer
    from meshtrain.state import abstract_target, abstract_train_state

    size = bench.SIZES[args.size]
    model = GPTConfig(
        d_model=size["d_model"], n_layers=size["n_layers"], n_heads=size["n_heads"],
        vocab_size=size["vocab_size"], max_seq_len=size["seq_len"],
    )  # fmt: skip
    mesh = make_mesh(args.mesh)
    tx = make_optimizer(OptimConfig(), 1000)
    like = abstract_train_state(
        lambda: build_model(model), tx, mesh, rules_for(args.strategy, mesh)
    )
    rng = np.random.default_rng(0)

    def leaf(x):
        if np.issubdtype(x.dtype, np.floating):
            return jax.device_put(rng.standard_normal(x.shape, dtype=np.float32), x.sharding)
        return jax.device_put(np.full(x.shape, 7, x.dtype), x.sharding)

    state = jax.tree.map(leaf, like)
    items = state._asdict()
    del items["comm"]  # empty: the checkpoint stores no comm item then
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    log(f"{args.size}: {state_bytes / 2**30:.2f} GiB of train state on {args.mesh}")
    target = abstract_target(like, jax.tree.map(lambda x: x.sharding, like))

    def plain(directory: Path, async_save: bool):
        """The manager's save before digests existed: the same options, three items."""
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=async_save)
        handlers = {
            "state": orbax_state_handler_without_replica_slices(),
            "data": ocp.JsonCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        }
        return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)

    def plain_args():
        return ocp.args.Composite(
            state=ocp.args.StandardSave(items),
            data=ocp.args.JsonSave({}),
            meta=ocp.args.JsonSave({"step": 1}),
        )

    root = Path(tempfile.mkdtemp(prefix="meshtrain-digest-cost-", dir=args.dir or None))
    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float, counted: bool) -> None:
        log(f"{name}: {seconds:.3f} s{'' if counted else ' (warm-up)'}")
        if counted:
            times.setdefault(name, []).append(seconds)

    digest_bytes = 0
    try:
        for r in range(args.rounds + 1):
            counted = r > 0
            record("digest", _seconds(lambda: array_digests(items)), counted)
            for mode in ("sync", "async"):
                config = CheckpointConfig(keep_last=1, async_save=mode == "async")
                with_dir, without_dir = root / f"with-{mode}-{r}", root / f"without-{mode}-{r}"
                # Alternate which goes first, so that neither always meets a warmer cache.
                order = ("with", "without") if r % 2 else ("without", "with")
                for variant in order:
                    if variant == "with":
                        mgr = CheckpointManager(with_dir, config)
                        save = lambda mgr=mgr: mgr.save(1, state)  # noqa: E731
                    else:
                        mgr = plain(without_dir, mode == "async")
                        save = lambda mgr=mgr: mgr.save(1, args=plain_args(), force=True)  # noqa: E731
                    blocked = _seconds(save)
                    committed = blocked + _seconds(mgr.wait_until_finished if variant == "without"
                                                   else mgr.wait)  # fmt: skip
                    mgr.close()
                    if mode == "async":
                        record(f"async_blocked_{variant}", blocked, counted)
                    record(f"{mode}_save_{variant}", committed, counted)
            digest_bytes = (root / f"with-sync-{r}" / "1" / "digests" / "metadata").stat().st_size
            for variant in ("with", "without"):
                directory = root / f"{variant}-sync-{r}"
                record(
                    f"restore_{variant}", _seconds(lambda d=directory: restore(d, target)), counted
                )
            for d in root.iterdir():
                shutil.rmtree(d)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}

    def extra(kind: str) -> float:
        return (med[f"{kind}_with"] - med[f"{kind}_without"]) / med[f"{kind}_without"]

    result = {
        "benchmark": "checkpoint_digest_cost",
        "size": args.size,
        "mesh": args.mesh,
        "strategy": args.strategy,
        "state_bytes": state_bytes,
        "arrays": len(jax.tree.leaves(items)),
        "digests_item_bytes": digest_bytes,
        "rounds": args.rounds,
        "median_s": {k: round(v, 4) for k, v in sorted(med.items())},
        "digest_over_sync_save": round(med["digest"] / med["sync_save_without"], 4),
        "extra_fraction": {
            "sync_save": round(extra("sync_save"), 4),
            "async_save_blocked": round(extra("async_blocked"), 4),
            "async_save_committed": round(extra("async_save"), 4),
            "restore": round(extra("restore"), 4),
        },
        "digest_gbps": round(state_bytes / med["digest"] / 1e9, 3),
        "device": f"CPU: {args.devices} simulated devices",
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "command": f"python benchmarks/checkpoint_digest_cost.py --size {args.size} "
        f"--mesh {args.mesh} --strategy {args.strategy} --rounds {args.rounds}",
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
