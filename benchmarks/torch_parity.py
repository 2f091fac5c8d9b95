"""Writes what `baseline_torch.py --parity` checks: meshtrain's weights, a batch, and the loss
and gradient norm meshtrain's train step computes on them (float32, one CPU device).

    .venv/bin/python benchmarks/torch_parity.py build/torch_parity_llama.npz --style llama
    .venv-torch/bin/python benchmarks/baseline_torch.py --parity build/torch_parity_llama.npz

The model is small but has every part the benchmark sizes have (grouped-query attention in
llama style, biases and learned positions in gpt2 style), so a slip in the PyTorch port (a
transposed projection, rotary pairs interleaved instead of halved, a wrong GQA grouping)
moves the loss far past the check's tolerance. `make torch-parity` runs both styles.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the .npz to write")
    p.add_argument("--style", default="llama", choices=("llama", "gpt2"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import jax
    import numpy as np

    import meshtrain as mt

    cfg = mt.GPTConfig(
        style=args.style,
        vocab_size=96,
        max_seq_len=24,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2 if args.style == "llama" else 0,
    )
    mesh = mt.make_mesh("data=1", devices=jax.devices()[:1])
    rules = mt.rules_for("dp", mesh)
    tx = mt.lower.make_optimizer(mt.OptimConfig(), total_steps=10)
    graphdef, state, _ = mt.lower.init_train_state(
        lambda: mt.lower.build_model(cfg, seed=args.seed), tx, mesh, rules
    )
    # Weights ten times the initial scale, so the logits are far from uniform and the loss
    # reacts to a wrong weight (at the initial scale every port gives about ln(vocab)).
    state = state._replace(
        params=jax.tree_util.tree_map_with_path(
            lambda path, x: x if str(getattr(path[-1], "key", "")) in ("scale", "bias") else 10 * x,
            state.params,
        )
    )
    tokens = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, (3, 25), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    _, metrics = mt.lower.train_step(graphdef, tx, state, batch)

    flat = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
        key = "/".join(str(getattr(k, "key", k)) for k in path)
        flat[f"p/{key}"] = np.asarray(leaf)
    config = {
        "style": cfg.style,
        "vocab_size": cfg.vocab_size,
        "max_seq_len": cfg.max_seq_len,
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.kv_heads,
        "d_ff": cfg.ff_dim,
        "rope_theta": cfg.rope_theta,
        "norm_eps": cfg.norm_eps,
        "tie_embeddings": cfg.tie_embeddings,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        out,
        config=json.dumps(config),
        inputs=batch["inputs"],
        targets=batch["targets"],
        loss=np.float64(metrics["loss"]),
        grad_norm=np.float64(metrics["grad_norm"]),
        **flat,
    )
    print(json.dumps({"wrote": str(out), "style": cfg.style, "loss": float(metrics["loss"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
