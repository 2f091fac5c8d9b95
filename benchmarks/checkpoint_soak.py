"""Flipped-byte soak: does a restore notice one changed byte anywhere in a checkpoint step?

Writes a small model's checkpoint with two steps (an MLP and its Adam state, sharded ``fsdp=8``,
0.46 MB a step), then for each trial copies the directory, xors one byte of the newest step
with a random non-zero value, and restores with step None. The byte is at a random offset of
a random file (``--pick file``, every file alike) or a random byte of the step (``--pick
byte``, so files are hit in proportion to their size).
Each trial ends one of four ways:

- ``detected``: a `CheckpointWarning` names the newest step and the previous step is restored
  bit-exactly (state, data position, meta); ``detected_by_digests`` counts those that only
  the digests noticed (orbax read the changed bytes without an error);
- ``harmless``: no warning and the newest step restored bit-exactly: orbax never read that
  byte, or read it without effect (a timestamp, a commit marker);
- ``silent``: no warning but something restored differs from what was saved (the failure this
  soak looks for);
- ``error``: the restore raised.

Files are grouped by kind: ``array_data`` (the OCDBT data files, ``state/**/d/*``),
``json_items`` (the ``data``, ``meta`` and ``digests`` items' JSON) and ``orbax_metadata``
(everything else: orbax's tree and array metadata, manifests, commit markers). Prints one JSON
line with the counts per outcome and per kind, and each trial that was not ``detected``.

    python benchmarks/checkpoint_soak.py                 # 50 trials, about 30 s on 2 cores
    python benchmarks/checkpoint_soak.py --trials 5      # a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from _common import emit, logger, parser, simulate_cpu_devices

log = logger("checkpoint_soak")
OUTCOMES = ("detected", "harmless", "silent", "error")
JSON_ITEMS = ("data", "meta", "digests")


def parse_args(argv=None) -> argparse.Namespace:
    p = parser("flipped-byte soak of checkpoint restores", devices=8, out=True)
    p.add_argument("--trials", type=int, default=50, help="flipped bytes, one per trial")
    p.add_argument("--seed", type=int, default=0, help="seed of the files, offsets and values")
    p.add_argument(
        "--pick",
        choices=("file", "byte"),
        default="file",
        help="file: a random file, then a random offset in it; byte: a random byte of the step",
    )
    args = p.parse_args(argv)
    if args.trials < 1:
        p.error(f"--trials {args.trials}: give at least 1")
    return args


def kind(relative: Path) -> str:
    """The kind of a file of a step, from its path inside the step's directory."""
    parts = relative.parts
    if parts[0] == "state" and len(parts) > 1 and parts[-2] == "d":
        return "array_data"
    if parts[0] in JSON_ITEMS and parts[-1] == "metadata":
        return "json_items"
    return "orbax_metadata"


def main(argv=None) -> dict:
    args = parse_args(argv)
    simulate_cpu_devices(args.devices)

    import jax
    import numpy as np

    from meshtrain.checkpoint import CheckpointManager, CheckpointWarning, restore
    from meshtrain.layout import rules_for
    from meshtrain.mesh import make_mesh
    from meshtrain.models import MLPConfig, build_model
    from meshtrain.optim import OptimConfig, make_optimizer
    from meshtrain.state import abstract_target, abstract_train_state

    rng = np.random.default_rng(args.seed)
    mesh = make_mesh(f"fsdp={args.devices}")
    # Wide enough that the kernels' shards exceed orbax's 1 KiB inline limit and go to data
    # files of their own; the smaller arrays sit inside OCDBT's checksummed tree nodes.
    model = MLPConfig(num_features=8, num_classes=4, d_model=64, d_hidden=128)
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=1), 10)
    like = abstract_train_state(
        lambda: build_model(model, seed=0), tx, mesh, rules_for("fsdp", mesh)
    )

    def random_state():
        def leaf(x):
            host = rng.standard_normal(x.shape).astype(x.dtype)
            if not np.issubdtype(x.dtype, np.floating):
                host = rng.integers(0, 1000, x.shape).astype(x.dtype)
            return jax.device_put(host, x.sharding)

        return jax.tree.map(leaf, like)

    def same(restored, saved) -> bool:
        got, want = jax.tree.leaves(jax.device_get(restored.state)), jax.tree.leaves(saved[0])
        arrays = all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
        return arrays and (restored.data, restored.meta) == saved[1:]

    work = Path(tempfile.mkdtemp(prefix="meshtrain-checkpoint-soak-"))
    source = work / "source"
    saved = {}
    with CheckpointManager(source) as mgr:
        for step in (1, 2):
            state = random_state()
            data, meta = {"next_index": 10 * step}, {"step": step, "note": f"step {step}"}
            mgr.save(step, state, data=data, meta={"note": meta["note"]}, wait=True)
            saved[step] = (jax.device_get(state), data, meta)
    files = sorted(p.relative_to(source / "2") for p in (source / "2").rglob("*") if p.is_file())
    sizes = np.array([(source / "2" / f).stat().st_size for f in files], dtype=float)
    weights = sizes / sizes.sum() if args.pick == "byte" else np.full(len(files), 1 / len(files))
    target = abstract_target(like, jax.tree.map(lambda x: x.sharding, like))

    counts = {o: 0 for o in OUTCOMES}
    by_digests = 0  # detected trials that only the digests noticed
    by_kind: dict[str, dict[str, int]] = {}
    others = []
    start = time.perf_counter()
    try:
        for trial in range(args.trials):
            root = work / f"trial{trial}"
            shutil.copytree(source, root)
            rel = files[rng.choice(len(files), p=weights)]
            path = root / "2" / rel
            blob = bytearray(path.read_bytes())
            offset = int(rng.integers(len(blob)))
            value = int(rng.integers(1, 256))
            blob[offset] ^= value
            path.write_bytes(bytes(blob))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    restored = restore(root, target)
                    noticed = [w for w in caught if issubclass(w.category, CheckpointWarning)]
                    if noticed and restored.step == 1 and same(restored, saved[1]):
                        outcome, note = "detected", str(noticed[0].message)
                    elif not noticed and restored.step == 2 and same(restored, saved[2]):
                        outcome, note = "harmless", ""
                    else:
                        outcome, note = "silent", f"restored step {restored.step}"
                except Exception as e:  # any failure is reported, not raised
                    outcome, note = "error", f"{type(e).__name__}: {e}"[:300]
            shutil.rmtree(root)
            k = kind(rel)
            counts[outcome] += 1
            by_digests += outcome == "detected" and "its bytes changed" in note
            by_kind.setdefault(k, {o: 0 for o in OUTCOMES})[outcome] += 1
            if outcome != "detected":
                others.append(
                    {"outcome": outcome, "file": str(rel), "size": len(blob),
                     "offset": offset, "xor": value, "note": note}
                )  # fmt: skip
            log(f"trial {trial}: {outcome} ({k}: {rel} @ {offset}) {note[:160]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "benchmark": "checkpoint_soak",
        "trials": args.trials,
        "pick": args.pick,
        **counts,
        "detected_by_digests": by_digests,
        "by_kind": by_kind,
        "not_detected": others,
        "files_per_step": {k: sum(kind(f) == k for f in files) for k in sorted(map(kind, files))},
        "bytes_per_step": {
            k: int(sum(n for f, n in zip(files, sizes, strict=True) if kind(f) == k))
            for k in sorted(map(kind, files))
        },
        "seconds": round(time.perf_counter() - start, 1),
        "seed": args.seed,
        "device": f"CPU: {args.devices} simulated devices",
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "command": "python benchmarks/checkpoint_soak.py "
        + f"--trials {args.trials} --seed {args.seed} --pick {args.pick}",
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
