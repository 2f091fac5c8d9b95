"""The planner on a mixture of experts: per-dispatch FLOPs and all-to-all bytes against hand
counts, the modelled all-to-all bytes against a compiled step's, the expert axis it picks for
Mixtral 8x7B and why, and the CLI's MoE line and one-line refusals."""

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from meshtrain.cli import main
from meshtrain.comm import hlo
from meshtrain.comm.compile import compile_step
from meshtrain.comm.expect import param_layouts
from meshtrain.comm.inspector import inspect_compiled
from meshtrain.costmodel import profile
from meshtrain.costmodel.moe import dispatch_costs
from meshtrain.kernels import grouped_matmul as gmm
from meshtrain.layout import rules_for
from meshtrain.mesh import make_mesh
from meshtrain.models.base import DataSpec
from meshtrain.models.moe_config import PRESETS, MoEConfig
from meshtrain.plan import Candidate, model_candidate, plan
from meshtrain.plan.command import model_config
from meshtrain.problem import RunCheckError
from meshtrain.run import RunSpec
from meshtrain.state import abstract_model

CPU, GPU = profile("cpu-sim"), profile("h100")


def _random_moe(rng, dispatch: str, dtype: str) -> tuple[MoEConfig, int]:
    """A random MoE shape (8 experts so every S divides them) and a token count."""
    cfg = MoEConfig(
        d_model=int(rng.integers(2, 65)) * 8,
        n_heads=2,
        d_expert=int(rng.integers(2, 129)) * 8,
        n_experts=8,
        top_k=int(rng.integers(1, 4)),
        capacity_factor=float(rng.uniform(1.0, 2.0)),
        dispatch=dispatch,
        dtype=dtype,
    )
    return cfg, int(rng.integers(16, 4096))


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_dispatch_flops_and_bytes_match_hand_counts(shards):
    rng = np.random.default_rng()
    for device, dtype, b, backend in ((CPU, "bfloat16", 4, "cpu"), (GPU, "bfloat16", 2, "gpu")):
        cap_cfg, n = _random_moe(rng, "capacity", dtype)
        drop_cfg = dataclasses.replace(cap_cfg, dispatch="dropless")
        D, F, k, E = cap_cfg.d_model, cap_cfg.d_expert, cap_cfg.top_k, cap_cfg.n_experts
        A, L, cf, leaves = n * k, E // shards, cap_cfg.capacity_factor, (shards - 1) / shards
        tile = gmm.tile_rows(A, L, backend)
        active = 3 * (2 * 3 * D * F * A)  # forward 6·D·F per choice, backward twice that
        why = f"{device.name} S={shards} D={D} F={F} k={k} N={n} cf={cf:.3f}"

        cap = dispatch_costs(cap_cfg, tokens=n, shards=shards, device=device)
        assert cap.active_flops == pytest.approx(active, rel=1e-12), why
        assert cap.flops == pytest.approx(cf * active, rel=1e-12), why
        assert cap.all_to_all_bytes == pytest.approx(4 * cf * A * D * b * leaves, rel=1e-12), why

        drop = dispatch_costs(drop_cfg, tokens=n, shards=shards, device=device)
        assert drop.flops == pytest.approx(active * (1 + L * (tile - 1) / A), rel=1e-12), why
        rows = shards * A if (shards > 1 and not device.is_gpu) else A  # padded vs ragged
        assert drop.all_to_all_bytes == pytest.approx(4 * rows * D * b * leaves, rel=1e-12), why
        assert drop.exchange == ("none" if shards == 1 else "ragged" if device.is_gpu else "padded")
        assert cap.exchange == ("none" if shards == 1 else "capacity")


@pytest.mark.parametrize("shards", [1, 2])
def test_xla_ragged_dot_on_cpu_costs_every_local_expert_for_every_row(shards):
    rng = np.random.default_rng()
    base, n = _random_moe(rng, "dropless", "float32")
    cfg = dataclasses.replace(base, grouped_impl="xla")
    cost = dispatch_costs(cfg, tokens=n, shards=shards, device=CPU)
    assert cost.factor == pytest.approx(base.n_experts)  # E × active (8× at E = 8)
    rows = shards * n * base.top_k
    assert cost.flops == pytest.approx(rows * (8 // shards) * 18 * base.d_model * base.d_expert)


def test_an_expert_axis_that_does_not_divide_the_experts_is_one_line():
    cfg = MoEConfig(n_experts=6)
    with pytest.raises(RunCheckError) as e:
        dispatch_costs(cfg, tokens=64, shards=4, device=CPU)
    assert str(e.value) == (
        "mesh.expert=4: does not divide n_experts=6; use an expert axis that divides 6"
    )


def _param_vars(cfg):
    graphdef, abstract = abstract_model(lambda: cfg.build(rngs=nnx.Rngs(0)))
    return nnx.split(nnx.merge(graphdef, abstract), nnx.Param, ...)[1]


def test_expert_weights_are_split_over_the_expert_axis_in_memory():
    cfg = MoEConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=128, max_seq_len=16)
    expert_bytes = 3 * cfg.d_model * cfg.expert_dim * cfg.n_experts * cfg.n_moe_layers * 4
    pv, parts = _param_vars(cfg), {}
    for expert in (1, 4):
        cand = Candidate(1, 8 // expert, 1, 1, "dp", expert=expert)
        rules = rules_for("dp", cand.sizes)
        layouts = param_layouts(pv, rules, cand.sizes)
        m = model_candidate(cand, layouts, cfg, batch=16, seq_len=16, device=CPU)
        parts[expert] = m.memory["parameters"]
    assert parts[1] - parts[4] == pytest.approx(expert_bytes * (1 - 1 / 4))


def test_modelled_all_to_all_bytes_equal_the_compiled_step_for_capacity_dispatch():
    """Capacity dispatch on expert=4 × data=2: the all-to-all bytes that leave each device in
    the compiled train step (operand bytes × (S−1)/S, summed over loop trips) are the planner's
    within 2%; the expectation's gradient reduction (experts reduced over data only) within
    10%. Capacity slots round up per sequence; at T=16, k=2, E=8, cf=1.25 they are whole."""
    cfg = MoEConfig(vocab_size=128, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)
    B, T = 16, 16
    cand = Candidate(1, 2, 1, 1, "dp", expert=4)
    mesh = make_mesh(cand.mesh)
    run = RunSpec(
        model=cfg, data=DataSpec("lm", B, T, 128, None), mesh=mesh, rules=rules_for("dp", mesh)
    )
    compiled, _ = compile_step(run)
    a2a = [c for c in hlo.collectives(compiled.as_text(), 8) if c.kind == "all-to-all"]
    sent = sum(c.count * c.wire_bytes for c in a2a)
    pv = _param_vars(cfg)
    layouts = param_layouts(pv, run.rules, cand.sizes)
    m = model_candidate(cand, layouts, cfg, batch=B, seq_len=T, device=CPU)
    assert m.moe is not None and m.moe.exchanges == 4
    assert sent == pytest.approx(m.moe.all_to_all_bytes, rel=0.02)
    seen = inspect_compiled(compiled, run, param_vars=pv)
    want = seen.expectation.bytes["gradient reduction"]
    assert seen.measured["gradient reduction"] == pytest.approx(want, rel=0.10)


def test_mixtral_on_64_h100s_takes_an_expert_axis_so_its_experts_are_not_gathered():
    cfg = model_config("mixtral-8x7b", 4096, "bfloat16")
    p = plan(cfg, devices=64, batch=128, seq_len=4096, device=GPU, memory_cap=80e9, confirm=0)
    best = p.best.modelled
    c = best.candidate
    assert c.expert > 1 and best.moe is not None
    assert best.moe.cost.exchange == "ragged" and best.moe.cost.factor < 1.25
    assert 0 < best.moe.seconds <= best.estimate.exposed_s  # on the critical path
    # The reason: the same layout with the expert axis folded into fsdp also fits, but it
    # gathers every expert's weights over the batch axes and models slower.
    folded = dataclasses.replace(c, fsdp=c.fsdp * c.expert, expert=1)
    twin = next(x.modelled for x in p.ranked if x.candidate == folded)
    assert twin.estimate.total_s > best.estimate.total_s
    assert twin.estimate.comm_s["parameter gathers"] > best.estimate.comm_s["parameter gathers"]


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("deepseek-v3-like", None, 37e9)],
)
def test_the_2025_presets_have_their_published_sizes(name, total, active):
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active; DeepSeek-V3: 37B active (its 671B total
    counts 3 dense layers where the preset has MoE layers). The matmul parameters plus the
    input embedding, within 3%."""
    cfg = PRESETS[name]
    embedding = cfg.d_model * cfg.vocab_size
    assert cfg.matmul_params() + embedding == pytest.approx(active, rel=0.03)
    if total is not None:
        assert cfg.matmul_params(active=False) + embedding == pytest.approx(total, rel=0.03)


def test_cli_plans_moe_tiny_and_says_what_it_assumed(capsys, tmp_path):
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", "moe-tiny", "--devices", "8", "--device", "cpu-sim"]
    assert main([*argv, "--confirm", "0", "--top", "3", "--write", str(path)]) == 0
    out = capsys.readouterr().out
    lines = [x.strip() for x in out.splitlines() if x.strip().startswith("moe:")]
    assert len(lines) == 3 and all("capacity · expert FLOPs 1.25× active" in x for x in lines)
    flags = json.loads(path.read_text())
    assert flags["model"] == "moe" and flags["data.seq-len"] == PRESETS["moe-tiny"].max_seq_len


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "moe-tiny", "--dispatch", "sideways"], "dispatch='sideways': choose from"),
        (["--model", "tiny", "--dispatch", "dropless"], "only a mixture of experts dispatches"),
    ],
)
def test_bad_moe_input_is_one_line(capsys, argv, needle):
    code = main(["plan", "--confirm", "0", "--devices", "8", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err
