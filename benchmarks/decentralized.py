"""Decentralized and federated training against synchronous data parallelism: the convergence
table. One JSON line per task and scheme on stdout.

Two tasks, each on 8 simulated CPU devices (``data=8``, strategy ``dp``: 8 replicas), every
scheme from the same initial parameters for the same number of steps:

- ``charlm``: the tiny byte-level GPT of ``benchmarks/sync.py`` on the stdlib corpus
  (d_model 64, 2 layers, T 64, batch 16, AdamW 3e-3); held-out loss;
- ``digits``: the LeNet-style CNN on the embedded 8×8 digits (batch 64, AdamW 3e-3, no
  normalisation layers; a fifth of the images held out); held-out accuracy on 320 of them.

Schemes: synchronous DP; gossip over a ring and over the exponential graph (the replicas'
mean formed every 10 steps); local SGD (H = 4); federated averaging (rounds of 4 local steps,
half the clients sampled, server SGD with rate 1) with i.i.d. clients and with α = 0.1
non-i.i.d. clients.

The batches: synchronous DP, gossip and local SGD read one shuffled order of the whole
training set (block r of the global batch is replica r's). Federated clients each hold a part
of it (``DataConfig.client_alpha``, `meshtrain.data.clients`): a Dirichlet(α) mix of the
groups, which are the digits' labels and, for the corpus, which has no documents, contiguous
spans of its windows (8 per client); α = 1000 gives clients with the whole set's mix (the
i.i.d. row), α = 0.1 skewed ones. Block r of each batch comes from client r's part.
``skew`` is the partition's measured skew (`meshtrain.data.clients.group_skew`: 0 for the
whole set's mix, near 1 for disjoint groups).

``bytes_per_step`` is what one device sends over the replica axis per step, read from the
compiled program by the inspector (conditional branches, the averaging every H steps, count
1/H; see ``benchmarks/sync.py``).

    python benchmarks/decentralized.py                 # both tasks, every scheme
    python benchmarks/decentralized.py --task digits --steps 100
    python benchmarks/decentralized.py --task digits --only gossip-ring,fedavg-alpha0.1
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import meshtrain as mt  # noqa: E402
from meshtrain.comm.inspector import inspect_compiled  # noqa: E402
from meshtrain.data.clients import group_skew  # noqa: E402
from meshtrain.layout import batch_shardings, shard_batch  # noqa: E402
from meshtrain.loss import cross_entropy  # noqa: E402
from meshtrain.optim import make_optimizer, make_schedule  # noqa: E402
from meshtrain.replicas import gossip, replicas, with_sync  # noqa: E402
from meshtrain.run import RunSpec  # noqa: E402
from meshtrain.state import init_train_state  # noqa: E402
from meshtrain.train.step import jit_train_step  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # benchmarks/sync.py, for its byte reader and settings
try:
    from sync import _axes_of, settings  # noqa: E402
finally:
    sys.path.remove(_HERE)

CLIENTS = 8
ALPHAS = {"iid": 1000.0, "dirichlet": 0.1}  # α = 1000: the clients' mixes are the whole set's


def schemes() -> list[tuple[str, mt.SyncConfig, str]]:
    """(name, settings, how the batches are drawn: ``global``, ``iid`` or ``dirichlet``)."""
    fed = dict(client_fraction=0.5, sync_every=4)
    return [
        ("sync-dp", mt.SyncConfig(), "global"),
        ("gossip-ring", mt.SyncConfig(gossip="ring", sync_every=10), "global"),
        ("gossip-exponential", mt.SyncConfig(gossip="exponential", sync_every=10), "global"),
        ("local-sgd-H4", mt.SyncConfig(sync_every=4), "global"),
        ("fedavg-iid", mt.SyncConfig(**fed), "iid"),
        (f"fedavg-alpha{ALPHAS['dirichlet']:g}", mt.SyncConfig(**fed), "dirichlet"),
    ]


@dataclasses.dataclass
class Task:
    """A model and the data settings it trains on."""

    name: str
    model: object
    data: mt.DataConfig
    lr: float
    eval_batches: int  # held-out batches (distinct examples)
    metric: str  # "eval_loss" or "accuracy"


def task_of(name: str, seed: int) -> Task:
    """``charlm``: the byte-level GPT on the stdlib corpus; ``digits``: the CNN on the digits
    (a fifth held out)."""
    if name == "charlm":
        data = mt.DataConfig(seq_len=64, batch_size=16, seed=seed, max_bytes=1_000_000)
        model = mt.GPTConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=64)
        return Task(name, model, data, 3e-3, 32, "eval_loss")
    data = mt.DataConfig(source="digits", batch_size=64, seed=seed, val_fraction=0.2)
    model = mt.CNNConfig(image_size=8, in_channels=1, norm="none")
    return Task(name, model, data, 3e-3, 5, "accuracy")


def draw(task: Task, how: str, steps: int) -> tuple[object, list[dict], float | None]:
    """The dataset, its first `steps` training batches, and the clients' measured skew: every
    replica's rows from the whole set (``global``), or block r of each batch from client r's
    part (``DataConfig.client_alpha``, `meshtrain.data.clients`)."""
    alpha = None if how == "global" else ALPHAS[how]
    data = mt.make_dataset(dataclasses.replace(task.data, client_alpha=alpha))
    it = data.train_iter(clients=CLIENTS if alpha else None)
    batches = [next(it) for _ in range(steps)]
    skew = None
    if alpha:
        skew = group_skew(data.client_partition(CLIENTS), data.client_groups(CLIENTS))
    return data, batches, skew


def run(task: Task, data, sync: mt.SyncConfig, train: list[dict], seed: int) -> dict:
    """Compiles, inspects and trains one scheme; returns its figures."""
    steps = len(train)
    mesh = mt.make_mesh("data=8")
    rules = mt.rules_for("dp", mesh)
    optim = mt.OptimConfig(lr=task.lr, warmup_steps=10)
    tx, schedule = make_optimizer(optim, steps), make_schedule(optim, steps)
    ctor = lambda: task.model.build(rngs=nnx.Rngs(params=seed))  # noqa: E731
    graphdef, state, shardings = init_train_state(ctor, tx, mesh, rules)
    state, shardings = with_sync(sync, tx, state, shardings, mesh, rules)
    spec = RunSpec(model=task.model, data=data, mesh=mesh, rules=rules, sync=sync,
                   loss_fn=cross_entropy)  # fmt: skip
    step = jit_train_step(spec, graphdef, tx, shardings, batch_shardings(train[0], mesh, rules),
                          schedule=schedule)  # fmt: skip
    compiled = step.lower(state, shard_batch(train[0], mesh, rules)).compile()
    _, param_vars, _ = nnx.split(ctor(), nnx.Param, ...)
    inspection = inspect_compiled(compiled, spec, param_vars=param_vars)
    axes, _ = replicas(mesh, rules)
    counts = per_step_bytes(inspection, axes, sync)
    losses, consensus = [], []
    for b in train:
        state, m = compiled(state, shard_batch(b, mesh, rules))
        losses.append(m["loss"])
        if "consensus" in m:
            consensus.append(m["consensus"])
    losses = [float(x) for x in jax.device_get(losses)]
    held = data.eval_batches(task.eval_batches)
    out = {"losses": losses, **counts, **evaluate(task, held, graphdef, state.params, state.rest)}
    if consensus:
        out["consensus"] = float(jax.device_get(consensus[-1]))
    return out


def per_step_bytes(inspection, axes: tuple[str, ...], sync: mt.SyncConfig) -> dict:
    """Bytes one device sends over the replica `axes` per step (`Collective.wire_bytes`).

    Gossip's permutes run every step (the exponential graph's sit in a switch over its log₂ m
    peers, one taken per step: 1/period each); an all-reduce in a conditional branch is the
    replicas' mean every H steps (1/H); the rest (synchronous DP's gradient all-reduce, the
    metrics' means) counts whole.
    """
    h = sync.sync_every if sync.local else 1
    period = 1
    if sync.gossips:
        sizes = {a: inspection.mesh[a] for a in axes}
        period = gossip.period(sync.gossip, sizes)
    total = {"mixing": 0.0, "averaging": 0.0, "other": 0.0}
    for c in inspection.collectives:
        if _axes_of(c, inspection.mesh) != axes:
            continue
        sent = c.count * c.wire_bytes
        if c.kind == "collective-permute":  # gossip's mixing, every step
            total["mixing"] += sent / period if c.conditional else sent
        elif c.conditional:  # the replicas' mean, every H steps
            total["averaging"] += sent / h
        else:  # the gradient's all-reduce (synchronous DP), the metrics' means
            total["other"] += sent
    return {"bytes_per_step": sum(total.values()), **{f"{k}_bytes": v for k, v in total.items()}}


def evaluate(task: Task, held: list[dict], graphdef, params, rest) -> dict:
    """Held-out loss, and for the digits accuracy, of the model `params` (θ̄)."""

    @jax.jit
    def logits_of(params, rest, inputs):
        return nnx.merge(graphdef, params, rest)(inputs)

    params, rest = jax.device_get((params, rest))
    inputs = np.concatenate([b["inputs"] for b in held])
    targets = jnp.asarray(np.concatenate([b["targets"] for b in held]))
    logits = logits_of(params, rest, jnp.asarray(inputs))
    out = {"eval_loss": float(cross_entropy(logits, targets))}
    if task.metric == "accuracy":
        out["accuracy"] = float(jnp.mean(jnp.argmax(logits, -1) == targets))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=("charlm", "digits", "both"), default="both")
    parser.add_argument("--steps", type=int, default=None, help="steps per scheme (240; 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated scheme names to run")
    args = parser.parse_args(argv)
    names = ("charlm", "digits") if args.task == "both" else (args.task,)
    device = (
        f"{os.cpu_count()}-core CPU ({platform.machine()}), "
        f"{len(jax.devices())} simulated {jax.devices()[0].platform} devices"
    )
    for name in names:
        task = task_of(name, args.seed)
        steps = args.steps or (240 if name == "charlm" else 200)
        keep = set(args.only.split(",")) if args.only else None
        for scheme, sync, how in schemes():
            if keep is not None and scheme not in keep:
                continue
            print(f"{name} {scheme} ...", file=sys.stderr, flush=True)
            data, train, skew = draw(task, how, steps)
            r = run(task, data, sync, train, args.seed)
            line = {
                "bench": "decentralized",
                "task": name,
                "scheme": scheme,
                "settings": settings(sync),
                "clients": how,
                "mesh": "data=8",
                "strategy": "dp",
                "replicas": CLIENTS,
                "model": task.model.describe(),
                "steps": steps,
                "bytes_per_step": round(r["bytes_per_step"]),
                "mixing_bytes_per_step": round(r["mixing_bytes"]),
                "averaging_bytes_per_step": round(r["averaging_bytes"]),
                "final_loss": round(float(np.mean(r["losses"][-10:])), 4),
                "eval_loss": round(r["eval_loss"], 4),
                "device": device,
                "jax_version": jax.__version__,
                "date": datetime.date.today().isoformat(),
            }
            if skew is not None:
                line["skew"] = round(skew, 3)
                line["client_alpha"] = ALPHAS[how]
            for key in ("accuracy", "consensus"):
                if key in r:
                    line[key] = round(r[key], 4)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
