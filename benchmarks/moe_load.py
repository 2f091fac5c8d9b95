"""Expert load over training: a tiny MoE trained on bytes of a source file for capacity
factors 1.0 and 1.25 and dropless dispatch, beside a dense model of equal active parameters;
one JSON line per run (final figures and the per-step curves), and with ``--plot PATH`` the
expert-load figure the MoE guide shows.

    .venv/bin/python benchmarks/moe_load.py --plot benchmarks/results/moe_load.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import numpy as np
import optax
from flax import nnx

from meshtrain.loss import cross_entropy, loss_and_metrics
from meshtrain.models import GPTConfig, MoEConfig, build_model

BATCH, SEQ = 8, 32
# 8 experts of width 32, top-2: 2 active experts = a dense SwiGLU of width 64.
MOE = MoEConfig(
    d_model=32, n_heads=2, n_layers=2, n_experts=8, top_k=2, d_expert=32, max_seq_len=SEQ
)
DENSE = GPTConfig(d_model=32, n_heads=2, n_layers=2, d_ff=64, max_seq_len=SEQ)
RUNS = {
    "capacity 1.0": dataclasses.replace(MOE, capacity_factor=1.0),
    "capacity 1.25": dataclasses.replace(MOE, capacity_factor=1.25),
    "dropless": dataclasses.replace(MOE, dispatch="dropless"),
    "dense (equal active params)": DENSE,
}


def _batches(steps: int) -> list[np.ndarray]:
    """Fixed [B, T+1] byte windows of jax's own source."""
    corpus = np.frombuffer(open(jax.__file__, "rb").read(), np.uint8)
    starts = np.random.default_rng(0).integers(0, corpus.size - SEQ - 1, (steps, BATCH))
    return [np.stack([corpus[s : s + SEQ + 1] for s in row]).astype(np.int32) for row in starts]


def train(cfg, batches) -> list[dict]:
    """AdamW on one device; the metrics of every step."""
    graphdef, params = nnx.split(build_model(cfg, seed=0))
    tx = optax.adamw(3e-3)

    @jax.jit
    def step(params, opt, tokens):
        def loss_fn(p):
            out = nnx.merge(graphdef, p)(tokens[:, :-1])
            return loss_and_metrics(cross_entropy, out, tokens[:, 1:])

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, {**metrics, "loss": loss}

    opt, history = tx.init(params), []
    for tokens in batches:
        params, opt, metrics = step(params, opt, tokens)
        history.append(metrics)
    return [{k: float(v) for k, v in m.items()} for m in jax.device_get(history)]


def main(argv: list[str] | None = None) -> int:
    """Trains every run; prints one JSON line each; draws the figure with ``--plot``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--plot", default="", help="write the expert-load figure here")
    args = parser.parse_args(argv)
    batches = _batches(args.steps)
    curves = {}
    for name, cfg in RUNS.items():
        curves[name] = history = train(cfg, batches)
        keys = sorted(history[-1])
        print(
            json.dumps(
                {
                    "run": name,
                    "steps": args.steps,
                    "final": history[-1],
                    "curves": {k: [round(m[k], 4) for m in history] for k in keys},
                    "device": jax.devices()[0].device_kind,
                }
            ),
            flush=True,
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        for name, history in curves.items():
            steps = range(1, len(history) + 1)
            axes[2].plot(steps, [m.get("task_loss", m["loss"]) for m in history], label=name)
            if "moe_tokens_per_expert_max" not in history[0]:
                continue
            line = axes[0].plot(steps, [m["moe_tokens_per_expert_max"] for m in history])
            axes[0].plot(
                steps, [m["moe_tokens_per_expert_min"] for m in history], "--", c=line[0].get_c()
            )
            axes[1].plot(steps, [m["moe_dropped_fraction"] for m in history], c=line[0].get_c())
        axes[0].axhline(BATCH * SEQ * MOE.top_k / MOE.n_experts, c="k", lw=0.8)
        axes[0].set_title("choices per expert: max (solid), min (dashed), even (black)")
        axes[1].set_title("fraction of choices dropped")
        axes[2].set_title("task loss (cross-entropy)")
        axes[2].legend(fontsize=8)
        for ax in axes:
            ax.set_xlabel("step")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=90)
    return 0


if __name__ == "__main__":
    sys.exit(main())
