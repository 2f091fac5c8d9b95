"""Precision policies on the default char-LM: one JSON line per policy with its losses after
``--steps`` steps of the default job (the Llama-style GPT on this Python's standard library,
the default optimizer and batch), on one device, from the same seed.

    python benchmarks/precision.py                      # fp32, bf16, fp16, fp8; 200 steps
    python benchmarks/precision.py --policies bf16 fp8 --steps 50
    python benchmarks/precision.py --policies bf16 fp16 fp8 --check   # the guide's bounds

Each line has the final training loss (the mean of the last 10 steps'), the held-out loss,
their ratios to bf16's (when bf16 ran), and under fp16 the final loss scale and the steps its
overflows skipped. The compiled memory of each policy comes from ``meshtrain bench --size 125m
--precision P --compile-only``. With ``--check`` it exits 1 unless fp16's held-out loss is
within 2% of bf16's and fp8's within 3% (about 5 minutes on 2 cores: outside the test suite,
whose time it would take).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from importlib.metadata import version

import numpy as np

POLICIES = ("fp32", "bf16", "fp16", "fp8")


def converge(policy: str, steps: int = 200, seed: int = 0) -> dict:
    """Trains the default job's model and data for `steps` under `policy` on one device;
    returns its figures (see the module docstring)."""
    import jax

    import meshtrain as mt
    from meshtrain.models import families

    mesh = mt.make_mesh("data=1", devices=jax.devices()[:1])
    run = mt.RunSpec(
        model=families()["gpt"].default,
        data=mt.make_dataset(mt.DataConfig()),
        mesh=mesh,
        rules=mt.rules_for("dp", mesh),
        train=mt.TrainConfig(steps=steps, run_dir="", progress=False, seed=seed, log_every=1),
        precision=mt.Precision(policy=policy),
    )
    trainer = mt.Trainer(run=run)
    history = trainer.fit()
    losses = [h["loss"] for h in history if "loss" in h]
    out = {
        "benchmark": "precision_convergence",
        "policy": policy,
        "steps": steps,
        "final_loss": float(np.mean(losses[-10:])),
        "eval_loss": float(trainer.evaluate()),
        "bad_steps": trainer.skipped_steps,
    }
    if run.loss_scaling:
        out["overflow_steps"] = int(sum(h.get("overflow", 0) for h in history))
        out["final_loss_scale"] = float(history[-1]["loss_scale"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--devices", type=int, default=8, help="CPU devices to simulate")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 unless fp16 is within 2%% and fp8 within 3%%"
    )
    args = parser.parse_args(argv)
    import meshtrain as mt

    mt.simulate_devices(args.devices)
    import jax

    words = sys.argv[1:] if argv is None else argv
    results = [converge(p, args.steps) for p in args.policies]
    base = next((r for r in results if r["policy"] == "bf16"), None)
    for r in results:
        if base is not None:
            r["final_loss_vs_bf16"] = r["final_loss"] / base["final_loss"]
            r["eval_loss_vs_bf16"] = r["eval_loss"] / base["eval_loss"]
        r.update(
            device=jax.devices()[0].device_kind,
            jax_version=version("jax"),
            date=date.today().isoformat(),
            command=" ".join(["python benchmarks/precision.py", *words]),
        )
        print(json.dumps(r), flush=True)
    if args.check and base is not None:  # the precision guide's bounds
        bounds = {"fp16": 0.02, "fp8": 0.03}
        off = [
            f"{r['policy']}: held-out loss {r['eval_loss_vs_bf16']:.4f} × bf16's"
            for r in results
            if r["policy"] in bounds and abs(r["eval_loss_vs_bf16"] - 1) > bounds[r["policy"]]
        ]
        if off:
            print("outside the bounds (fp16 2%, fp8 3%): " + "; ".join(off), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
