"""Compiled memory and pipeline communication of every schedule on one GPT.

For each schedule (gpipe, 1f1b, circular and interleaved-1f1b with v = 2 chunks per stage,
zb-h1) this script jits the pipelined loss-and-gradient function of the same GPT on the same
mesh (``pipe=4,data=2`` by default, 16 microbatches), compiles it without running it, and
reads:

- ``temp_bytes``: XLA's per-device temporary allocation (`memory_analysis`), which holds the
  activations kept for the backward: every microbatch's for gpipe, at most p for 1F1B;
- the collective-permutes in the compiled HLO, each run as often as the slots whose branch
  holds it (the executors pick each slot's permutes by the schedule table), and the bytes the
  busiest device sends per step (``permute_bytes_per_device``), against the bytes the table
  implies (``permute_bytes_useful``: the busiest stage's sends, one [b, T, D] activation or
  cotangent each); the compiled permutes' stage pairs must be exactly the table's;
- the bubble counted from the table, its closed form, and the most microbatches in flight.

``--gather`` compiles 1f1b, zb-h1 and gpipe on ``pipe=4,fsdp=2`` (the stage weights split over
fsdp) at m = 4, 8, 16, with and without ``gather_once``, and reports the all-gather bytes per
step: outside the loop they run once; inside a slot's branch once per pass that holds them
(m·v forwards, backwards, weight passes each).

It also compiles the unpipelined step on a ``data=8`` mesh for scale (not with ``--quick``).
Prints one JSON line.

    python benchmarks/pipeline_memory.py            # p=4, m=16: a few minutes on 2 cores
    python benchmarks/pipeline_memory.py --gather   # gather-once against per-microbatch
    python benchmarks/pipeline_memory.py --quick    # tiny sizes, schedules only (smoke test)
    python benchmarks/pipeline_memory.py --kernels  # the stages run the Pallas kernels

With ``--kernels`` the GPT's attention, norms and loss use the Pallas kernels (two heads of
width 64, the kernels' width); on a CPU they are interpreted, so the memory is the
interpreted kernels' and the permute count is the schedule's either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from meshtrain.comm.axes import axes_of_groups
from meshtrain.comm.hlo import collectives
from meshtrain.layout import activation_rules, rules_for
from meshtrain.loss import cross_entropy_with
from meshtrain.lower import cross_entropy, init_train_state
from meshtrain.mesh import PIPE, make_mesh, mesh_sizes
from meshtrain.models import GPTConfig, build_model
from meshtrain.pipeline import PipelineConfig, pipeline_loss_and_grads, schedule_table
from meshtrain.pipeline.slots import count_permutes, permute_uses, sends


def permute_bytes(compiled, mesh, pc: PipelineConfig) -> dict:
    """The compiled permutes as they run: executions and bytes the busiest device sends per
    step, and whether their stage pairs are exactly the ones the schedule's slots use."""
    sizes = mesh_sizes(mesh)
    p = sizes[PIPE]
    cs = [
        c
        for c in collectives(compiled.as_text())
        if c.kind == "collective-permute"
        and axes_of_groups(c.groups, sizes, permute=True) == (PIPE,)
    ]  # the stages' (XLA may reshard a weight over another axis with a permute)
    counted = count_permutes(cs, sizes, pc)
    uses, _ = permute_uses(pc, p)
    shape, axis = list(sizes.values()), list(sizes).index(PIPE)
    sent = np.zeros(math.prod(shape))
    compiled_pairs = set()
    for c in counted:
        for src, _ in c.groups:
            sent[src] += c.count * c.result_bytes
        stage = lambda d: int(np.unravel_index(d, shape)[axis])  # noqa: E731
        compiled_pairs.add(frozenset((stage(a), stage(b)) for a, b in c.groups))
    return {
        "collective_permutes_per_step": sum(c.count for c in counted),
        "permute_bytes_per_device": int(sent.max()),
        "pairs_match_the_table": compiled_pairs == set(uses),
    }


def gather_bytes(compiled, pc: PipelineConfig, p: int) -> dict:
    """All-gather bytes per device per step: outside any branch as the HLO counts them; in a
    slot's branch once per pass that holds them (m·v per stage)."""
    m, v = pc.num_microbatches(p), pc.chunks_per_stage()
    once = inside = 0
    for c in collectives(compiled.as_text()):
        if c.kind != "all-gather":
            continue
        if c.conditional:
            inside += m * v * c.result_bytes
        else:
            once += c.count * c.result_bytes
    return {"outside_branches": once, "in_branches": inside, "total": once + inside}


def compile_pipelined(
    cfg: GPTConfig,
    mesh_spec: str,
    pc: PipelineConfig | None,
    batch: int,
    loss_fn=cross_entropy,
    strategy: str = "fsdp",
):
    """Compiles loss-and-grads of `cfg` on `mesh_spec` (pipelined by `pc`, or plain);
    ``(compiled, mesh)``."""
    mesh = make_mesh(mesh_spec)
    rules = rules_for(strategy, mesh)
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

    return jax.jit(run).lower(state.params, data).compile(), mesh


SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("circular", 2), ("interleaved-1f1b", 2), ("zb-h1", 1))


def schedules(cfg, mesh_spec, p, m, batch, loss_fn, act_bytes) -> dict:
    """Per schedule: memory, permutes against the table's useful bytes, bubble, in flight."""
    out = {}
    for schedule, v in SCHEDULES:
        print(f"compiling {schedule} ...", file=sys.stderr)
        pc = PipelineConfig(schedule=schedule, microbatches=m, repeats=v)
        compiled, mesh = compile_pipelined(cfg, mesh_spec, pc, batch, loss_fn)
        table = schedule_table(schedule, p, m, v)
        useful = int(sends(table).max()) * act_bytes
        fig = {
            "v": v,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            **permute_bytes(compiled, mesh, pc),
            "permute_bytes_useful": useful,
            "bubble_counted": table.bubble_fraction,
            "bubble_closed_form": table.closed_form_bubble,
            "in_flight": table.in_flight(),
        }
        fig["permute_over_useful"] = fig["permute_bytes_per_device"] / useful
        out[schedule] = fig
    return out


def gathers(cfg, p, batch, loss_fn, ms) -> dict:
    """All-gather bytes per step with and without gather-once, at several m."""
    out = {}
    for schedule in ("1f1b", "zb-h1", "gpipe"):
        for once in (False, True):
            row = {}
            for m in ms:
                print(f"compiling {schedule} m={m} gather_once={once} ...", file=sys.stderr)
                pc = PipelineConfig(schedule=schedule, microbatches=m, gather_once=once)
                compiled, _ = compile_pipelined(cfg, f"pipe={p},fsdp={8 // p}", pc, batch, loss_fn)
                row[str(m)] = {
                    **gather_bytes(compiled, pc, p),
                    "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                }
            out[f"{schedule}{' gather_once' if once else ''}"] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes for the smoke test")
    parser.add_argument("--pipe", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--kernels", action="store_true", help="Pallas attention, norms, loss")
    parser.add_argument("--gather", action="store_true", help="gather-once against per-step")
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
    if args.gather:
        ms = (2, 4) if args.quick else (4, 8, 16)
        out["mesh"] = f"pipe={p},fsdp={8 // p}"
        out["gather"] = gathers(cfg, p, batch, loss_fn, ms)
        print(json.dumps(out))
        return
    if not args.quick:  # for scale; the smoke test reads only the schedules' figures
        plain, _ = compile_pipelined(cfg, "data=8", None, batch, loss_fn)
        out["unpipelined_data8_temp_bytes"] = plain.memory_analysis().temp_size_in_bytes
    out.update(schedules(cfg, mesh_spec, p, m, batch, loss_fn, act_bytes))
    out["temp_ratio_1f1b_over_gpipe"] = out["1f1b"]["temp_bytes"] / out["gpipe"]["temp_bytes"]
    out["temp_ratio_interleaved_over_1f1b"] = (
        out["interleaved-1f1b"]["temp_bytes"] / out["1f1b"]["temp_bytes"]
    )
    out["temp_ratio_zb_h1_over_1f1b"] = out["zb-h1"]["temp_bytes"] / out["1f1b"]["temp_bytes"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
