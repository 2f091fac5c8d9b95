"""MoE dispatch, read from compiled programs (nothing is timed): one JSON line per case.

- ``all_to_all``: for ``expert`` = 2, 4, 8, the bytes the compiled forward + backward of one
  MoE layer moves in ``all-to-all`` ops, per device (operand sizes; the (S−1)/S of each that
  leaves the device), next to the analytic count for a perfectly balanced routing:
  ``tokens × k × d_model × bytes × (E−1)/E`` per direction (dispatch and combine), twice for
  the backward. Capacity buffers are padded to ``capacity_factor``, so capacity dispatch moves
  about ``capacity_factor`` × the analytic count; dropless' padded exchange moves ``S ×``
  (each destination is sized for every choice).
- ``memory``: per-device argument and temporary bytes of the layer's forward + backward for
  ``expert`` ∈ {1, 2, 4, 8} (the experts' weights and their gradients split over ``expert``),
  for capacity and for dropless with each grouped matmul (``tiled``, ``xla`` = ragged_dot).
- ``flops``: compiled FLOPs per device (XLA's cost analysis, which counts a loop's body once)
  of capacity, dropless-tiled and dropless-ragged_dot next to the experts' active FLOPs (k
  experts per token, forward + backward), at ``expert=1``.
- ``dropless_work``: for ``expert`` ∈ {1, 2, 4, 8}, the rows the tiled grouped matmul runs
  (its tile products × tile rows, `meshtrain.kernels.grouped_matmul.visits` on each device's
  group sizes for the router's choices of the benchmark's input) over the active rows, so the
  dropless layer's expert FLOPs over the active ones (its nine grouped matmuls, forward and
  backward, each run the same tiles).

GPU times: `benchmarks/grouped_matmul.py`.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/moe.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.comm import hlo as comm_hlo
from meshtrain.kernels import grouped_matmul as gmm
from meshtrain.layout import activation_rules, named, rules_for, state_specs
from meshtrain.mesh import make_mesh
from meshtrain.models import MoEConfig
from meshtrain.models.moe import Experts
from meshtrain.models.moe_dispatch import shard_sizes
from meshtrain.state import abstract_model, abstract_target


def _a2a_bytes(hlo: str) -> tuple[int, int]:
    """(all-to-all executions, bytes of their results) in an HLO module's text, read by the
    inspector's parser (`meshtrain.comm.hlo`)."""
    a2a = [c for c in comm_hlo.collectives(hlo) if c.kind == "all-to-all"]
    return sum(c.count for c in a2a), sum(c.count * c.result_bytes for c in a2a)


def _compiled(cfg: MoEConfig, expert: int, batch: int, seq: int):
    """The compiled forward + backward of one MoE layer on a mesh ``expert=E, data=8/E``."""
    mesh = make_mesh(f"expert={expert},data={8 // expert}")
    rules = rules_for("dp", mesh)
    graphdef, state = abstract_model(lambda: Experts(cfg, rngs=nnx.Rngs(0)))
    specs = named(state_specs(state, rules.params, mesh, warn=False), mesh)
    params = abstract_target(nnx.to_pure_dict(state), specs)
    x = jax.ShapeDtypeStruct((batch, seq, cfg.d_model), jnp.float32)

    def loss(p, x_BTD):
        with activation_rules(mesh, rules):
            y, stats = nnx.merge(graphdef, p)(x_BTD)
        return jnp.mean(y**2) + stats["aux_loss"]

    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss, (0, 1))).lower(params, x).compile()


def main(argv: list[str] | None = None) -> int:
    """Prints the cases' JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="expert=2 and 8 only, small sizes")
    args = parser.parse_args(argv)
    d_model, batch, seq = (32, 8, 16) if args.quick else (256, 16, 128)
    base = MoEConfig(d_model=d_model, n_heads=4, n_experts=8, top_k=2, d_expert=2 * d_model)
    device = {"platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind}
    experts = (2, 8) if args.quick else (2, 4, 8)
    for dispatch in ("capacity", "dropless"):
        cfg = MoEConfig(**{**base.__dict__, "dispatch": dispatch})
        for e in experts:
            compiled = _compiled(cfg, e, batch, seq)
            ops, result_bytes = _a2a_bytes(compiled.as_text())
            tokens = batch * seq // 8  # per device: the batch splits over all 8 devices
            one_way = tokens * cfg.top_k * d_model * 4 * (e - 1) / e
            print(
                json.dumps(
                    {
                        "case": "all_to_all",
                        "dispatch": dispatch,
                        "expert": e,
                        "capacity_factor": cfg.capacity_factor,
                        "tokens_per_device": tokens,
                        "all_to_all_ops": ops,
                        "hlo_all_to_all_bytes": result_bytes,
                        "sent_bytes": round(result_bytes * (e - 1) / e),
                        "analytic_bytes_fwd_bwd": round(4 * one_way),
                        "ratio": round(result_bytes * (e - 1) / e / (4 * one_way), 3),
                        **device,
                    }
                ),
                flush=True,
            )
    variants = {
        "capacity": base,
        "dropless-tiled": MoEConfig(**{**base.__dict__, "dispatch": "dropless"}),
        "dropless-xla": MoEConfig(
            **{**base.__dict__, "dispatch": "dropless", "grouped_impl": "xla"}
        ),
    }
    for name, cfg in variants.items():
        for e in (1, 2, 4, 8):
            mem = _compiled(cfg, e, batch, seq).memory_analysis()
            print(
                json.dumps(
                    {
                        "case": "memory",
                        "dispatch": name,
                        "expert": e,
                        "argument_bytes": mem.argument_size_in_bytes,
                        "temp_bytes": mem.temp_size_in_bytes,
                        "output_bytes": mem.output_size_in_bytes,
                        **device,
                    }
                ),
                flush=True,
            )
    active = 3 * 2 * 3 * batch * seq * base.top_k * d_model * base.expert_dim
    flops = {}
    for name, cfg in variants.items():
        cost = _compiled(cfg, 1, batch, seq).cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        flops[f"{name}_flops"] = float(cost.get("flops", 0.0))
    print(
        json.dumps(
            {
                "case": "flops",
                "expert": 1,
                **flops,
                # The experts' matmuls a token's k choices need, forward + backward, per device
                # (the batch splits over all 8 devices).
                "active_expert_flops_per_device": active // 8,
                **device,
            }
        ),
        flush=True,
    )
    for line in _dropless_work(variants["dropless-tiled"], batch, seq, active):
        print(json.dumps({**line, **device}), flush=True)
    return 0


def _dropless_work(cfg: MoEConfig, batch: int, seq: int, active: int):
    """Per expert size: the rows the tiled grouped matmul runs over the active rows, on the
    router's choices for a random input (the layer's own initial router)."""
    layer = Experts(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (batch, seq, cfg.d_model))
    _, expert_BTK = jax.lax.top_k(jnp.dot(x, layer.router[...]), cfg.top_k)
    for e in (1, 2, 4, 8):
        sizes = shard_sizes(expert_BTK, cfg.n_experts, e, row_blocks=8)
        R = gmm.tile_rows(batch * seq * cfg.top_k // 8, cfg.n_experts // e, "cpu")
        run = sum(int(gmm.visits(jnp.asarray(s, jnp.int32), R)) * R for s in sizes)
        rows = sum(int(s.sum()) for s in sizes)
        yield {
            "case": "dropless_work",
            "expert": e,
            "tile_rows": R,
            "rows_run": run,
            "active_rows": rows,
            "ratio": round(run / rows, 4),
            "busiest_shard_rows": max(int(s.sum()) for s in sizes),
            "executed_expert_flops_per_device": round(active / 8 * run / rows),
        }


if __name__ == "__main__":
    sys.exit(main())
