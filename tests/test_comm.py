"""The compiled-collective inspector against the analytic expectation of each layout, and the
planner's choices confirmed by compiling. One compile per layout, shared (module scope)."""

import dataclasses
import math

import jax
import pytest
from flax import nnx

import meshtrain as mt
from meshtrain.check import check_run
from meshtrain.comm import inspect
from meshtrain.comm.compile import compile_step
from meshtrain.costmodel import profile
from meshtrain.models.base import DataSpec
from meshtrain.plan import plan

CFG = mt.GPTConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16, vocab_size=64)
SPEC = DataSpec("lm", 16, 16, 64, None)

LAYOUTS = {
    "dp": ("data=8", "dp"),
    "fsdp": ("fsdp=8", "fsdp"),
    "hsdp": ("data=4,fsdp=2", "hsdp"),
    "tp": ("data=2,tensor=4", "tp"),
    "zero1": ("data=8", "zero1"),
    "2x2x2": ("data=2,fsdp=2,tensor=2", "fsdp+tp"),
    "pipeline": ("pipe=2,data=4", "dp"),
}
# What each layout must send, bucket by bucket (the rest must be absent).
BUCKETS = {
    "dp": {"gradient reduction"},
    "fsdp": {"gradient reduction", "parameter gathers"},
    "hsdp": {"gradient reduction", "parameter gathers"},
    "tp": {"gradient reduction", "tensor activations"},
    "zero1": {"gradient reduction", "parameter gathers"},
    "2x2x2": {"gradient reduction", "parameter gathers", "tensor activations"},
    "pipeline": {"gradient reduction", "pipeline permutes", "pipeline stage sums"},
}


@pytest.fixture(scope="module")
def reports():
    """One inspection per layout, compiled on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            mesh_str, strategy = LAYOUTS[name]
            mesh = mt.make_mesh(mesh_str)
            cache[name] = inspect(CFG, SPEC, mesh, mt.rules_for(strategy, mesh))
        return cache[name]

    return get


def _param_bytes():
    """Bytes of the model's float32 parameters, counted from its abstract state."""
    abstract = nnx.eval_shape(lambda: CFG.build(rngs=nnx.Rngs(0)))
    return 4 * sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "pipeline"])
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


@pytest.mark.slow
def test_pipeline_permutes_match_the_schedule_and_the_per_tick_gradient_all_reduce_is_named(
    reports,
):
    r = reports("pipeline")
    p, m = 2, 4  # the default: 2 × pipe microbatches, gpipe
    for bucket in ("pipeline permutes", "pipeline stage sums"):
        ratio = r.measured[bucket] / r.expectation.bytes[bucket]
        assert 0.9 <= ratio <= 1.1, (bucket, ratio)
    permutes = [c for c in r.collectives if c.kind == "collective-permute"]
    assert sum(c.count for c in permutes) == 2 * (m + p - 1)
    # The extra collective: the stage's layer gradients are all-reduced over data inside the
    # tick loop, once per tick (m + p − 1 times) rather than once per step.
    (flag,) = r.flags
    assert flag.startswith("gradient reduction") and f"{m + p - 1}× per step" in flag
    looped = [c for c in r.collectives if c.kind == "all-reduce" and c.count == m + p - 1]
    assert looped


@pytest.mark.slow
def test_a_planted_activation_constraint_that_forces_gathers_is_flagged():
    mesh = mt.make_mesh("data=2,tensor=4")
    rules = mt.rules_for("tp", mesh)
    bad = dataclasses.replace(rules, activations={**rules.activations, "embed": "tensor"})
    r = inspect(CFG, SPEC, mesh, bad)
    assert any("unexpected all-gather over tensor" in f for f in r.flags), r.flags


def test_the_planner_picks_a_sharded_layout_when_data_parallel_does_not_fit(reports):
    def compile_peak(cand):  # the shared compiles where they exist
        for name, (mesh_str, strategy) in LAYOUTS.items():
            if (mesh_str, strategy) == (cand.mesh, cand.strategy) and cand.remat == "none":
                return reports(name).memory["peak"]
        compiled, _ = compile_step(
            lambda: CFG.build(rngs=nnx.Rngs(0)),
            SPEC,
            mt.make_mesh(cand.mesh),
            mt.rules_for(cand.strategy),
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
        assert not check_run(model=CFG, data=SPEC, mesh=c.sizes, rules=mt.rules_for(c.strategy))
