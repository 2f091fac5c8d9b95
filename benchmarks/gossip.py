"""Gossip mixing, compiled: one JSON line per topology and replica count with the bytes each
device sends per mixing step, read from the compiled program, beside the analytic count and the
α-β cost model's time for the same step on a device profile. Nothing runs: each mixing step
is compiled ahead of time on simulated devices.

    python benchmarks/gossip.py                          # 64 MB of parameters per replica
    python benchmarks/gossip.py --params-mb 512 --device h100
    python benchmarks/gossip.py --train-step             # whole train steps, read by the inspector

For a fixed degree the bytes do not grow with the replicas (ring: two neighbours, torus: four,
exponential: one peer per step), where an all-reduce's grow towards twice the buffer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from datetime import date

LAYOUTS = {  # topology -> the replica axes tried, 2, 4 and 8 replicas
    "ring": ({"data": 2}, {"data": 4}, {"data": 8}),
    "exponential": ({"data": 2}, {"data": 4}, {"data": 8}),
    "torus": ({"data": 2, "fsdp": 2}, {"data": 2, "fsdp": 4}),
    "complete": ({"data": 2}, {"data": 4}, {"data": 8}),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-mb", type=float, default=64.0, help="parameters per replica, MB")
    p.add_argument("--device", default="h100", help="the cost model's device profile")
    p.add_argument("--topologies", nargs="+", default=list(LAYOUTS))
    p.add_argument(
        "--train-step",
        action="store_true",
        help="inspect whole train steps of a small GPT instead (ring and exponential, the mean "
        "every 10 steps)",
    )
    return p.parse_args(argv)


def train_steps() -> int:
    """One JSON line per topology and replica count: the compiled train step's exchange per
    step, as the inspector reads it, beside the α-β model's (`meshtrain.comm.exchange`)."""
    import jax

    import meshtrain as mt
    from meshtrain.models import DataSpec

    gpt = mt.GPTConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=64)
    for topology in ("ring", "exponential"):
        for m in (2, 4, 8):
            mesh = mt.make_mesh(f"data={m}", devices=jax.devices()[:m])
            sync = mt.SyncConfig(gossip=topology, sync_every=10)
            run = mt.RunSpec(model=gpt, data=DataSpec("lm", 16, 64, 256), mesh=mesh,
                             rules=mt.rules_for("dp", mesh), sync=sync)  # fmt: skip
            report = mt.inspect(run)
            ex = report.exchange
            mean = 2 * (m - 1) / m * report.param_bytes / ex["sync_every"]  # the mean's share
            line = {
                "bench": "gossip-train-step",
                "topology": topology,
                "replicas": m,
                "model": gpt.describe(),
                "param_bytes": report.param_bytes,
                "compiled_bytes_per_step": ex["compiled_bytes"],
                "compiled_mixing_bytes_per_step": round(ex["compiled_bytes"] - mean),
                "modelled_bytes_per_step": ex["modelled_bytes"],
                "modelled_s": ex["modelled_s"],
                "permutes_per_step": ex["permutes_per_step"],
                "sync_every": ex["sync_every"],
                "flags": report.flags,
                "device_profile": ex["device"],
                "jax": jax.__version__,
                "date": date.today().isoformat(),
                "compiled_on": "cpu (simulated devices)",
            }
            print(json.dumps(line), flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    if args.train_step:
        return train_steps()
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshtrain.comm.hlo import collectives
    from meshtrain.costmodel import collective_time, profile
    from meshtrain.mesh import make_mesh
    from meshtrain.replicas import gossip

    device = profile(args.device)
    n = max(1, int(args.params_mb * 1e6 / 4))
    for topology in args.topologies:
        for sizes in LAYOUTS[topology]:
            m = math.prod(sizes.values())
            mesh = make_mesh(",".join(f"{a}={s}" for a, s in sizes.items()), jax.devices()[:m])
            axes = tuple(sizes)
            spec = P(axes if len(axes) > 1 else axes[0])
            body = lambda x, t=topology, s=sizes: gossip.mix(x, t, s, 0)  # noqa: E731
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
            x = jax.ShapeDtypeStruct((m, n), jnp.float32, sharding=NamedSharding(mesh, spec))
            found = collectives(fn.lower(x).compile().as_text(), m)
            sent = sum(c.wire_bytes * c.count for c in found)
            kinds = sorted({c.kind for c in found})
            predicted = 0.0
            for t in gossip.terms(topology, sizes):
                if t.by:
                    seconds, _ = collective_time(
                        "collective-permute", t.axes, 4.0 * n, mesh.shape, device
                    )
                    predicted += seconds
            line = {
                "bench": "gossip",
                "topology": topology,
                "replicas": m,
                "axes": sizes,
                "param_bytes": 4 * n,
                "sent_bytes_per_step": sent,
                "analytic_bytes_per_step": gossip.sent_per_step(topology, sizes) * 4 * n,
                "collectives": kinds,
                "modelled_s": predicted,
                "device_profile": device.name,
                "jax": jax.__version__,
                "date": date.today().isoformat(),
                "compiled_on": "cpu (simulated devices)",
            }
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
