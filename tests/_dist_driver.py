"""Trains the tiny GPT of the multi-process tests under several layouts; one process's view.

Under ``meshtrain launch`` (or any ``MESHTRAIN_*`` environment) it joins the job first:

    meshtrain launch --nproc 2 --devices-per-proc 4 -- python tests/_dist_driver.py OUT dp fsdp

With ``--tokens DIR`` before the layouts it trains on that prepared corpus (``meshtrain
prepare``; the ``tokens`` source, packed except under pipe, which refuses packed batches), else
on the synthetic source. Every process writes ``OUT/<layout>.p<i>.npz``: the losses, its batch
rows, and its shards of the first global batch and of the final parameters, which the tests
reassemble. Run without ``meshtrain launch`` it is the single-process reference on the same
mesh shape.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

import meshtrain as mt
from meshtrain._tree import path_str as _path_str
from meshtrain.layout import shard_batch

# name: (mesh, strategy, pipeline schedule[, SyncConfig settings])
LAYOUTS = {
    "dp": ("data=8", "dp", None),
    "fsdp": ("data=2,fsdp=4", "fsdp", None),
    "tp": ("data=2,tensor=4", "tp", None),
    "pipe": ("pipe=2,data=2,tensor=2", "dp+tp", "1f1b"),
    # federated rounds of 2 steps, a quarter of the 8 clients each: every process must draw
    # the same clients, or the processes' means (and parameters) part
    "federated": ("data=8", "dp", None, {"client_fraction": 0.25, "sync_every": 2}),
}
STEPS = 3
GPT = dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
DATA = dict(source="synthetic", seq_len=16, batch_size=8, seed=7, val_fraction=0.0)


def _shards(prefix: str, tree) -> dict[str, np.ndarray]:
    """This process's shards of every leaf of `tree` (one copy each), keyed by path@index."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                where = ",".join(
                    f"{s.start or 0}:{n if s.stop is None else s.stop}"
                    for s, n in zip(shard.index, leaf.shape, strict=True)
                )
                out[f"{prefix}/{_path_str(path)}@{where}"] = np.asarray(shard.data)
    return out


def run_layout(name: str, tokens: str = "") -> dict[str, np.ndarray]:
    """Trains `STEPS` steps under layout `name` (on the prepared corpus `tokens` if given);
    returns losses, rows and this process's shards of the first global batch and of the final
    parameters."""
    mesh_text, strategy, schedule, *sync = LAYOUTS[name]
    mesh = mt.make_mesh(mesh_text)
    rules = mt.rules_for(strategy, mesh)
    source = dict(source="tokens", path=tokens, packing=schedule is None) if tokens else {}
    data = mt.make_dataset(mt.DataConfig(**{**DATA, **source}))
    run = mt.RunSpec(
        model=mt.GPTConfig(**GPT),
        data=data,
        mesh=mesh,
        rules=rules,
        # SGD with momentum, not AdamW: since the schedule's first step is a real update,
        # AdamW at lr 1e-2 turned float32 reduction-order differences between gloo and
        # in-process all-reduces into parameter differences up to 3e-6 (Adam's first steps
        # are nearly sign(g)), which says nothing about the layout. SGD keeps the comparison
        # linear in the gradients, so the tolerance still means what it says.
        optim=mt.OptimConfig(optimizer="sgd", lr=0.1, warmup_steps=1),
        train=mt.TrainConfig(steps=STEPS, log_every=1, run_dir="", progress=False, seed=3),
        pipeline=(  # pipeline settings only where there is a pipeline (else they do nothing)
            mt.PipelineConfig(schedule=schedule or "gpipe", microbatches=4)
            if mesh.shape.get("pipe", 1) > 1
            else mt.PipelineConfig()
        ),
        sync=mt.SyncConfig(**sync[0]) if sync else mt.SyncConfig(),
    )
    trainer = mt.Trainer(run=run)
    first = shard_batch(next(data.train_iter(trainer._rows)), mesh, rules)
    history = trainer.fit()
    return {
        "losses": np.array([h["loss"] for h in history]),
        "rows": np.array(trainer._rows),
        **_shards("batch", first),
        **_shards("param", trainer.state.params),
    }


def main(out: str, names: list[str]) -> None:
    tokens = ""
    if names[:1] == ["--tokens"]:
        tokens, names = names[1], names[2:]
    if mt.DistributedConfig().wanted():  # under meshtrain launch; else the reference
        mt.distributed.initialize()
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    me = jax.process_index()
    for name in names:
        result = run_layout(name, tokens)
        np.savez(out_dir / f"{name}.p{me}.npz", **result)
        print(f"layout {name}: losses {result['losses'].tolist()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
