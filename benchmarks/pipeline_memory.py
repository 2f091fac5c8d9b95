"""Compiled memory and pipeline communication of gpipe vs 1F1B (and circular) on one GPT.

For each schedule this script jits the pipelined loss-and-gradient function of the same GPT on
the same mesh (``pipe=4,data=2`` by default, 16 microbatches), compiles it without running it,
and reads:

- ``temp_bytes``: XLA's per-device temporary allocation (`memory_analysis`), which holds the
  activations kept for the backward: every microbatch's for gpipe, at most p for 1F1B;
- the collective-permutes in the compiled HLO: how many execute per step (static count × the
  trip count of the loops around them) and how many bytes each device sends, against the
  analytic count: gpipe and circular send one [b, T, D] activation per tick forward and one
  cotangent per tick backward (2·(v·m + p − 1) sends); 1F1B sends one activation and one
  cotangent every slot (2 · 2(m + p − 1) sends).

It also compiles the unpipelined step on a ``data=8`` mesh for scale. Prints one JSON line.

    python benchmarks/pipeline_memory.py            # p=4, m=16: about a minute on 2 cores
    python benchmarks/pipeline_memory.py --quick    # tiny sizes (the smoke test)
    python benchmarks/pipeline_memory.py --kernels  # the stages run the Pallas kernels

With ``--kernels`` the GPT's attention, norms and loss use the Pallas kernels (two heads of
width 64, the kernels' width); on a CPU they are interpreted, so the memory is the
interpreted kernels' and the permute count is the schedule's either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshtrain.comm.hlo import collectives
from meshtrain.layout import activation_rules, rules_for
from meshtrain.lower import cross_entropy, init_train_state
from meshtrain.mesh import make_mesh
from meshtrain.models import GPTConfig, build_model
from meshtrain.pipeline import PipelineConfig, pipeline_loss_and_grads
from meshtrain.train.loss import cross_entropy_with


def collective_permutes(hlo: str) -> tuple[int, int]:
    """(executions per step, bytes sent per device per step) of the collective-permutes in a
    compiled HLO module, each counted with the trip counts of the loops around it (read by
    `meshtrain.comm.hlo`, the inspector's parser)."""
    permutes = [c for c in collectives(hlo) if c.kind == "collective-permute"]
    return sum(c.count for c in permutes), sum(c.count * c.result_bytes for c in permutes)


def compile_pipelined(
    cfg: GPTConfig, mesh_spec: str, pc: PipelineConfig | None, batch: int, loss_fn=cross_entropy
):
    """Compiles loss-and-grads of `cfg` on `mesh_spec` (pipelined by `pc`, or plain)."""
    mesh = make_mesh(mesh_spec)
    rules = rules_for("fsdp", mesh)
    graphdef, state, _ = init_train_state(
        lambda: build_model(cfg, seed=0), optax.sgd(0.1), mesh, rules
    )
    tokens = jnp.zeros((batch, cfg.max_seq_len), jnp.int32)
    data = {"inputs": tokens, "targets": tokens}

    def run(params, data):
        with activation_rules(mesh, rules):
            if pc is None:

                def loss(p):
                    model = nnx.merge(graphdef, p, state.rest)
                    return loss_fn(model(data["inputs"]), data["targets"])

                return jax.value_and_grad(loss)(params)
            return pipeline_loss_and_grads(
                graphdef, params, state.rest, data, config=pc, mesh=mesh, loss_fn=loss_fn
            )

    return jax.jit(run).lower(state.params, data).compile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes for the smoke test")
    parser.add_argument("--pipe", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--kernels", action="store_true", help="Pallas attention, norms, loss")
    args = parser.parse_args()
    p, m = args.pipe, args.microbatches
    if args.quick:
        p, m = 2, 4
        cfg = GPTConfig(d_model=32, n_layers=4, n_heads=4, max_seq_len=16, vocab_size=64)
        batch = 16
    else:
        cfg = GPTConfig(d_model=128, n_layers=8, n_heads=4, max_seq_len=256, vocab_size=256)
        batch = 64
    loss_fn = cross_entropy
    if args.kernels:
        impls = dict(attention_impl="pallas", norm_impl="pallas")
        d = max(cfg.d_model, 128)
        cfg = dataclasses.replace(cfg, d_model=d, n_heads=d // 64, n_kv_heads=0, **impls)
        loss_fn = cross_entropy_with("pallas")
    data_ways = 8 // p
    mesh_spec = f"pipe={p},data={data_ways}"
    rows = batch // m // data_ways  # rows of one microbatch on one device
    act_bytes = rows * cfg.max_seq_len * cfg.d_model * 4
    out = {
        "platform": jax.devices()[0].platform,
        "jax_version": jax.__version__,
        "mesh": mesh_spec,
        "model": f"llama d={cfg.d_model} L={cfg.n_layers} T={cfg.max_seq_len} batch={batch}",
        "p": p,
        "m": m,
        "microbatch_activation_bytes_per_device": act_bytes,
        "kernels": "pallas (interpreted)" if args.kernels else "xla",
    }
    plain = compile_pipelined(cfg, "data=8", None, batch, loss_fn)
    out["unpipelined_data8_temp_bytes"] = plain.memory_analysis().temp_size_in_bytes
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("circular", 2)):
        print(f"compiling {schedule} ...", file=sys.stderr)
        pc = PipelineConfig(schedule=schedule, microbatches=m, repeats=v)
        compiled = compile_pipelined(cfg, mesh_spec, pc, batch, loss_fn)
        count, sent = collective_permutes(compiled.as_text())
        ticks = v * m + p - 1
        expected = 2 * ticks if schedule != "1f1b" else 2 * 2 * (m + p - 1)
        out[schedule] = {
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "collective_permutes_per_step": count,
            "collective_permutes_expected": expected,
            "permute_bytes_per_device": sent,
            "permute_bytes_expected": expected * act_bytes,
        }
    out["temp_ratio_1f1b_over_gpipe"] = out["1f1b"]["temp_bytes"] / out["gpipe"]["temp_bytes"]
    out["in_flight_ratio_p_over_m"] = p / m
    print(json.dumps(out))


if __name__ == "__main__":
    main()
