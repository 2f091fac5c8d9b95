"""The compiled-collective inspector against the analytic expectation of each layout, and the
planner's choices confirmed by compiling. One compile per layout, shared (module scope)."""

import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from _helpers import fresh_env
from flax import nnx

import meshtrain as mt
from meshtrain import cli
from meshtrain.check import check_run
from meshtrain.comm import inspect
from meshtrain.comm.axes import axes_of_groups
from meshtrain.comm.compile import compile_step
from meshtrain.comm.expect import Traffic, expected, param_layouts, stage_gathered_bytes
from meshtrain.costmodel import profile
from meshtrain.models import MoEConfig
from meshtrain.models.base import DataSpec
from meshtrain.pipeline import BWD, FWD
from meshtrain.pipeline.schedules import schedule_table
from meshtrain.pipeline.slots import sends
from meshtrain.plan import plan

CFG = mt.GPTConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16, vocab_size=64)
SPEC = DataSpec("lm", 16, 16, 64, None)
STEPS = mt.TrainConfig(steps=100)  # the schedule these layouts are compiled with
NO_DIR = mt.TrainConfig(run_dir="")  # no run directory to check: the settings' problems only

LAYOUTS = {
    "dp": ("data=8", "dp"),
    "fsdp": ("fsdp=8", "fsdp"),
    "hsdp": ("data=4,fsdp=2", "hsdp"),
    "tp": ("data=2,tensor=4", "tp"),
    "zero1": ("data=8", "zero1"),
    "2x2x2": ("data=2,fsdp=2,tensor=2", "fsdp+tp"),
    "pipeline": ("pipe=2,data=4", "dp"),
    "1f1b": ("pipe=2,data=4", "dp"),
    "zb-h1": ("pipe=2,data=4", "dp"),
    "interleaved-1f1b": ("pipe=2,data=4", "dp"),
}
PIPELINES = {
    "1f1b": mt.PipelineConfig(schedule="1f1b", microbatches=4),
    "zb-h1": mt.PipelineConfig(schedule="zb-h1", microbatches=4),
    "interleaved-1f1b": mt.PipelineConfig(schedule="interleaved-1f1b", microbatches=4, repeats=2),
}
MODELS = {"interleaved-1f1b": dataclasses.replace(CFG, n_layers=4)}  # 2 stages × 2 chunks
# What each layout must send, bucket by bucket (the rest must be absent).
BUCKETS = {
    "dp": {"gradient reduction"},
    "fsdp": {"gradient reduction", "parameter gathers"},
    "hsdp": {"gradient reduction", "parameter gathers"},
    "tp": {"gradient reduction", "tensor activations"},
    "zero1": {"gradient reduction", "parameter gathers"},
    "2x2x2": {"gradient reduction", "parameter gathers", "tensor activations"},
    "pipeline": {"gradient reduction", "pipeline permutes", "pipeline stage sums"},
    "1f1b": {"gradient reduction", "pipeline permutes", "pipeline stage sums"},
    "zb-h1": {"gradient reduction", "pipeline permutes", "pipeline stage sums"},
    "interleaved-1f1b": {"gradient reduction", "pipeline permutes", "pipeline stage sums"},
}


@pytest.fixture(scope="module")
def reports():
    """One inspection per layout, compiled on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            mesh_str, strategy = LAYOUTS[name]
            mesh = mt.make_mesh(mesh_str)
            rules = mt.rules_for(strategy, mesh)
            model = MODELS.get(name, CFG)
            pipeline = PIPELINES.get(name, mt.PipelineConfig())
            run = mt.RunSpec(
                model=model, data=SPEC, mesh=mesh, rules=rules, train=STEPS, pipeline=pipeline
            )
            cache[name] = inspect(run)
        return cache[name]

    return get


def _param_bytes():
    """Bytes of the model's float32 parameters, counted from its abstract state."""
    abstract = nnx.eval_shape(lambda: CFG.build(rngs=nnx.Rngs(0)))
    return 4 * sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


# interleaved-1f1b (like circular) also moves the stage weights into their round-robin chunk
# order and the gradients back every step, which the inspector flags (see the Pipelines guide).
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "interleaved-1f1b"])
def test_compiled_collectives_match_the_layouts_expectation_within_10_percent(reports, name):
    r = reports(name)
    assert not r.flags, r.flags
    assert {b for b, v in r.measured.items() if v} == BUCKETS[name]
    for bucket in BUCKETS[name]:
        ratio = r.measured[bucket] / r.expectation.bytes[bucket]
        assert 0.9 <= ratio <= 1.1, (bucket, ratio)
    # The mesh axes each collective runs over, mapped back from its replica groups.
    sizes = r.mesh
    for row in r.rows:
        assert row.axes is not None and all(sizes[a] > 1 for a in row.axes)
        if row.kind == "all-gather":
            assert set(row.axes) <= set(r.batch_axes)  # weights, never activations


def test_data_parallel_all_reduces_exactly_the_gradient_bytes(reports):
    r = reports("dp")
    grads = _param_bytes()
    # One all-reduce bucket over data holding every gradient (plus the scalar loss).
    assert grads <= r.bytes_by("all-reduce", ("data",)) <= grads + 64
    assert r.bytes_by("all-gather") == 0 and r.bytes_by("reduce-scatter") == 0
    m = r.memory
    assert m["peak"] == m["argument"] + m["output"] + m["temp"] - m["alias"] > 0
    assert r.flops > 0


def test_tensor_parallel_all_reduces_activations_over_tensor_only(reports):
    r = reports("tp")
    act = SPEC.batch_size // 2 * SPEC.seq_len * CFG.d_model * 4  # [B/data, T, D] float32
    # Forward: out-proj and down-proj per layer and the vocab-split embedding; backward: the
    # input gradients of q, k, v, gate, up per layer and of the head.
    want = (2 * CFG.n_layers + 1 + 5 * CFG.n_layers + 1) * act
    got = r.measured["tensor activations"]
    assert abs(got - want) <= 0.1 * want
    # the gradients are reduced over data alone: a quarter of the weights per device (roughly)
    assert r.bytes_by("all-reduce", ("data",)) < 0.5 * _param_bytes()


def _sending_slots(schedule: str, p: int, m: int, v: int) -> int:
    """Slots (ticks) of the schedule's table in which some stage sends forward, plus those in
    which some stage sends back: a forward's output goes on unless it is the model's last
    chunk's (the head reads it), a backward's cotangent unless it is the first chunk's."""
    t = mt.schedule_table(schedule, p, m, v)
    stage = np.arange(p)[None, :]
    last = (stage == p - 1) & (t.chunk == v - 1)
    first = (stage == 0) & (t.chunk == 0)
    fwd = ((t.phase == FWD) & ~last).any(axis=1)
    bwd = ((t.phase == BWD) & ~first).any(axis=1)
    return int(fwd.sum() + bwd.sum())


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,schedule,v",
    [("pipeline", "gpipe", 1), ("1f1b", "1f1b", 1), ("zb-h1", "zb-h1", 1),
     ("interleaved-1f1b", "interleaved-1f1b", 2)],
)  # fmt: skip
def test_pipelines_send_only_useful_payloads_and_reduce_gradients_over_data_once(
    reports, name, schedule, v
):
    r = reports(name)  # p = 2 stages, m = 4 microbatches (gpipe's default: 2 × pipe)
    # Each slot in which a stage sends runs one permute over pipe, holding only the pairs
    # that send, and nothing runs on idle slots: with one chunk per stage, 4 slots send
    # forward (stage 0's outputs; stage 1 holds the last chunk, which the head reads) and 4
    # back (stage 1's cotangents; stage 0's first chunk's go to the embedding). Each payload
    # is one microbatch's [B/(m·data), T, D] float32 activation.
    sends = _sending_slots(schedule, 2, 4, v)
    assert v > 1 or sends == 8
    micro = SPEC.batch_size // (4 * 4) * SPEC.seq_len * CFG.d_model * 4
    sizes = r.mesh
    permutes = [
        c
        for c in r.collectives
        if c.kind == "collective-permute" and axes_of_groups(c.groups, sizes, True) == ("pipe",)
    ]
    assert sum(c.count * c.buffer_bytes for c in permutes) == sends * micro
    assert r.expectation.bytes["pipeline permutes"] == sends * micro
    # The stages' layer gradients are summed over the replica axis (data) after the tick loop,
    # once per step: no all-reduce runs inside it.
    assert not [c for c in r.collectives if c.kind == "all-reduce" and c.count > 1]
    if name == "interleaved-1f1b":
        return  # the chunk order's reduction is counted with the gradients' (see above)
    grads = r.measured["gradient reduction"]
    assert 0.9 <= grads / r.expectation.bytes["gradient reduction"] <= 1.1


def _pipeline_traffic(schedule, *, repeats=1, gather_once=False, mesh="pipe=4,data=2"):
    """The expectation of the test GPT (8 layers) pipelined over `mesh`, m = 8."""
    sizes = mt.make_mesh(mesh).shape
    rules = mt.rules_for("fsdp" if "fsdp" in mesh else "dp")
    pc = mt.PipelineConfig(
        schedule=schedule, microbatches=8, repeats=repeats, gather_once=gather_once
    )
    cfg = dataclasses.replace(CFG, n_layers=8)
    abstract = nnx.eval_shape(lambda: cfg.build(rngs=nnx.Rngs(0)))
    layouts = param_layouts(nnx.state(abstract, nnx.Param), rules, dict(sizes))
    run = Traffic(dict(sizes), rules.batch_axes(dict(sizes)), SPEC.batch_size * SPEC.seq_len,
                  d_model=CFG.d_model, pipeline=pc, batch=SPEC.batch_size)  # fmt: skip
    return expected(layouts, run), layouts, dict(sizes), rules


@pytest.mark.parametrize(
    ("schedule", "repeats"),
    [("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)],
)
def test_pipeline_permutes_are_the_sending_slots_of_the_schedules_table(schedule, repeats):
    exp, *_ = _pipeline_traffic(schedule, repeats=repeats)
    # Each slot (tick) in which some stage sends runs one permute each way it sends.
    slots = _sending_slots(schedule, 4, 8, repeats)
    # p = 4, m = 8 over data = 2: one microbatch is 16 / (8 · 2) = 1 row of [T, D] float32.
    micro = 1 * SPEC.seq_len * CFG.d_model * 4
    assert exp.bytes["pipeline permutes"] == slots * micro
    assert f"{slots} microbatch activations" in exp.why["pipeline permutes"]
    # No slot sends more than one payload from a stage: at least the busiest stage's sends
    # (each of a middle stage's v·m forwards on and v·m backwards back), at most all stages'.
    busiest = int(sends(schedule_table(schedule, 4, 8, repeats)).max())
    assert busiest == 2 * 8 * repeats <= slots <= 4 * busiest
    # The hand-scheduled ones run the head inside their loop: only input cotangents summed.
    sums = exp.bytes["pipeline stage sums"]
    tokens = SPEC.batch_size * SPEC.seq_len / 2
    assert sums == (1 if schedule not in ("gpipe", "circular") else 2) * tokens * CFG.d_model * 4


@pytest.mark.parametrize(("schedule", "per_step"), [("1f1b", 2 * 8), ("gpipe", 2 * (8 + 4 - 1))])
def test_a_stages_fsdp_split_weights_are_gathered_per_microbatch_unless_gathered_once(
    schedule, per_step
):
    each, layouts, sizes, rules = _pipeline_traffic(schedule, mesh="pipe=4,fsdp=2")
    once, *_ = _pipeline_traffic(schedule, mesh="pipe=4,fsdp=2", gather_once=True)
    stage = stage_gathered_bytes(layouts, sizes, rules.batch_axes(sizes))
    # 8 layers over 4 stages: each stage's 2 layers, whole over fsdp.
    blocks = sum(x.nbytes for x in layouts if x.path.startswith("blocks/"))
    assert stage == blocks / 4
    # Gathered for each forward and each backward (per microbatch; gpipe: per tick of its
    # loops, bubble ticks included) and reduced after each backward; once with gather_once.
    gathered = each.bytes["parameter gathers"] - once.bytes["parameter gathers"]
    assert gathered == pytest.approx((per_step - 1) * stage)
    reduced = each.bytes["gradient reduction"] - once.bytes["gradient reduction"]
    assert reduced == pytest.approx((per_step // 2 - 1) * stage)
    assert "once per step" in once.why["parameter gathers"]


@pytest.mark.slow
def test_a_gpipe_stage_gathers_its_fsdp_split_weights_every_tick_as_expected():
    mesh = mt.make_mesh("pipe=2,fsdp=4")
    cfg = dataclasses.replace(CFG, n_layers=4)
    pc = mt.PipelineConfig(schedule="gpipe", microbatches=4)
    r = inspect(mt.RunSpec(model=cfg, data=SPEC, mesh=mesh, rules=mt.rules_for("fsdp", mesh),
                           pipeline=pc))  # fmt: skip
    for bucket in ("parameter gathers", "gradient reduction"):
        ratio = r.measured[bucket] / r.expectation.bytes[bucket]
        assert 0.9 <= ratio <= 1.1, (bucket, ratio)
    # 2(m + p − 1) = 10 gathers of the stage's weights: 10× what one gather per step would be.
    assert "10× per step" in r.expectation.why["parameter gathers"]


@pytest.mark.slow
def test_a_planted_activation_constraint_that_forces_gathers_is_flagged():
    mesh = mt.make_mesh("data=2,tensor=4")
    rules = mt.rules_for("tp", mesh)
    bad = dataclasses.replace(rules, activations={**rules.activations, "embed": "tensor"})
    r = inspect(mt.RunSpec(model=CFG, data=SPEC, mesh=mesh, rules=bad, train=STEPS))
    assert any("unexpected all-gather over tensor" in f for f in r.flags), r.flags


def test_the_planner_picks_a_sharded_layout_when_data_parallel_does_not_fit(reports):
    def compile_peak(cand):  # the shared compiles where they exist
        for name, (mesh_str, strategy) in LAYOUTS.items():
            if (mesh_str, strategy) == (cand.mesh, cand.strategy) and cand.remat == "none":
                return reports(name).memory["peak"]
        compiled, _ = compile_step(
            mt.RunSpec(
                model=lambda: CFG.build(rngs=nnx.Rngs(0)),
                data=SPEC,
                mesh=mt.make_mesh(cand.mesh),
                rules=mt.rules_for(cand.strategy),
                train=STEPS,
            )
        )
        ma = compiled.memory_analysis()
        return (
            ma.argument_size_in_bytes
            + ma.output_size_in_bytes
            + ma.temp_size_in_bytes
            - (ma.alias_size_in_bytes)
        )

    kw = dict(
        devices=8,
        batch=16,
        seq_len=16,
        device=profile("h100"),
        remats=("none",),
        max_pipe=1,
        max_tensor=1,
        compile_fn=compile_peak,
    )
    free = plan(CFG, memory_cap=80e9, confirm=0, **kw)
    dp_time = next(c for c in free.ranked if c.candidate.strategy == "dp").modelled.estimate
    assert free.best.modelled.estimate.total_s <= dp_time.total_s  # never worse than DP
    dp_peak = reports("dp").memory["peak"]
    cap = 0.95 * dp_peak
    capped = plan(CFG, memory_cap=cap, confirm=1, **kw)
    best = capped.best
    assert best.candidate.strategy != "dp" and best.compiled_peak <= cap
    for choice in capped.confirmed:  # only layouts that pass the run check, compile and fit
        c = choice.candidate
        assert choice.compiled_peak <= cap
        rules = mt.rules_for(c.strategy)
        run = mt.RunSpec(model=CFG, data=SPEC, mesh=c.sizes, rules=rules, train=NO_DIR)
        assert not check_run(run)


def test_meshtrain_inspect_json_prints_the_compiled_steps_collectives(capsys):
    argv = ["inspect", "--mesh", "data=8", "--strategy", "dp", "--gpt.d-model", "32",
            "--gpt.n-layers", "2", "--data.source", "synthetic", "--data.seq-len", "16",
            "--data.batch-size", "16", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    out = json.loads(line)
    assert out["strategy"] == "dp" and out["mesh"]["data"] == 8 and not out["flags"]
    assert {c["axes"] for c in out["collectives"]} == {"data"}
    got, want = out["measured_bytes"], out["expected_bytes"]
    assert set(got) == {"gradient reduction"}
    assert 0.9 <= got["gradient reduction"] / want["gradient reduction"] <= 1.1
    assert out["memory_bytes"]["peak"] > 0 and out["flops"] > 0


@pytest.mark.slow
def test_the_comm_benchmark_quick_meets_its_target_on_every_layout():
    root = pathlib.Path(__file__).resolve().parents[1]
    env = fresh_env(devices=8)
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "comm.py"), "--quick"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.strip().splitlines()]
    layouts = {x["case"]: x for x in lines if "ratio_to_analytic" in x}
    assert set(layouts) == {"dp", "fsdp", "pipeline-gpipe"}
    for case, x in layouts.items():
        assert 0.9 <= x["ratio_to_analytic"] <= 1.1 and not x["flags"], (case, x)
        assert x["peak_bytes"] > 0 and x["memory_over_ideal"] > 0
    (planner,) = [x for x in lines if x["case"] == "planner-64"]
    assert planner["considered"] > 0 and planner["modelled_step_s"] > 0


MOE = MoEConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16, vocab_size=64,
                   n_experts=4, d_expert=32)  # fmt: skip


@pytest.mark.parametrize(
    "mesh_str, strategy, moe",
    [
        ("data=2,expert=4", "dp", {"dispatch": "capacity"}),
        ("data=2,expert=4", "dp", {"dispatch": "dropless"}),
        ("data=4,expert=2", "dp", {"dispatch": "dropless", "remat": "full"}),
        ("fsdp=2,expert=2,tensor=2", "fsdp+tp", {"dispatch": "capacity"}),
    ],
)
def test_moe_dispatch_all_to_alls_are_expected_over_expert(mesh_str, strategy, moe):
    """The dispatch's all-to-alls over ``expert`` are their own bucket, at the bytes the
    planner models (capacity buffers; the padded dropless exchange on CPU; 6 per MoE layer
    under remat), not an unexpected collective."""
    mesh = mt.make_mesh(mesh_str)
    model = dataclasses.replace(MOE, **moe)
    r = inspect(mt.RunSpec(model=model, data=SPEC, mesh=mesh, rules=mt.rules_for(strategy, mesh)))
    assert not [f for f in r.flags if "unexpected all-to-all" in f], r.flags
    ratio = r.measured["expert dispatch"] / r.expectation.bytes["expert dispatch"]
    assert 0.9 <= ratio <= 1.1, (ratio, r.flags)
