"""The planner's pipelines: the schedules and gather-once it searches, the bubble it charges
(lockstep), the memory gather-once costs, and the flags and lines it prints."""

import dataclasses
import json
import types

import pytest
from flax import nnx

import meshtrain as mt
from meshtrain import cli
from meshtrain.comm.expect import param_layouts, stage_gathered_bytes
from meshtrain.costmodel import held_microbatches, lockstep_bubble, profile
from meshtrain.pipeline.schedules import SCHEDULES
from meshtrain.plan import Candidate, candidates, model_candidate, plan
from meshtrain.plan.command import gpt_config, reasoning, train_flags
from meshtrain.state import abstract_model

# One H100 per node: every collective crosses nodes, so pipelines (which send little) win.
ONE_PER_NODE = dataclasses.replace(profile("h100"), devices_per_node=1)
GPT = gpt_config("1.3b", 2048, "bfloat16")  # 24 layers
KW = dict(devices=8, batch=16, seq_len=2048, device=ONE_PER_NODE, confirm=0)


def _twin(p, cand, **change):
    """The ranked choice whose candidate is `cand` with `change` applied (None if absent)."""
    want = dataclasses.replace(cand, **change)
    return next((c for c in p.ranked if c.candidate == want), None)


def test_the_search_space_tries_each_schedule_and_gather_once_where_fsdp_splits_weights():
    cands = candidates(8, remats=("none",), microbatch_factors=(2,), layers=8)

    def settings(pipe, data, fsdp):
        return {
            (c.schedule, c.repeats, c.gather_once)
            for c in cands
            if (c.pipe, c.data, c.fsdp, c.tensor) == (pipe, data, fsdp, 1)
        }

    both = {("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)}
    assert settings(2, 1, 4) == {(s, v, once) for s, v in both for once in (False, True)}
    assert settings(2, 4, 1) == {(s, v, False) for s, v in both}  # nothing split: no gather
    assert settings(4, 2, 1) == {(s, v, False) for s, v in both}  # 8 layers = 4 stages × 2
    assert settings(8, 1, 1) == {("1f1b", 1, False), ("zb-h1", 1, False)}  # 8 ∤ 16 chunks
    assert {c.microbatches for c in cands if c.pipe == 4} == {8}  # m = 2 × pipe
    assert len([c for c in cands if c.pipe == 1 and c.strategy == "dp"]) == 1
    # Without the layers the planner cannot cut chunks: no interleaving.
    assert all(c.schedule != "interleaved-1f1b" for c in candidates(8, layers=None))


def test_a_candidate_describes_its_chunks_and_gather_once():
    c = Candidate(2, 1, 4, 1, "fsdp", "none", 8, "interleaved-1f1b", repeats=2, gather_once=True)
    want = "pipe=2,fsdp=4 · fsdp · remat none · interleaved-1f1b m=8 v=2 · gather once"
    assert c.describe() == want
    plain = Candidate(2, 4, 1, 1, "dp", "none", 8, "zb-h1")
    assert plain.describe() == "pipe=2,data=4 · dp · remat none · zb-h1 m=8"


def test_the_written_flags_carry_repeats_and_gather_once_into_meshtrain_train(tmp_path):
    c = Candidate(2, 1, 4, 1, "fsdp", "none", 8, "interleaved-1f1b", repeats=2, gather_once=True)
    best = types.SimpleNamespace(best=types.SimpleNamespace(candidate=c), sync=None)
    cfg = mt.GPTConfig(d_model=32, n_layers=4, n_heads=4, max_seq_len=16, vocab_size=64)
    flags = train_flags(best, cfg, batch=16, seq_len=16, devices=8, simulate=True)
    assert flags["schedule"] == "interleaved-1f1b" and flags["microbatches"] == 8
    assert flags["repeats"] == 2 and flags["gather-once"] is True
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(flags))
    job = cli.parse(["train", "--config", str(path)])
    assert job.pipeline == mt.PipelineConfig(
        schedule="interleaved-1f1b", microbatches=8, repeats=2, gather_once=True
    )
    plain = dataclasses.replace(c, schedule="zb-h1", repeats=1, gather_once=False)
    flags = train_flags(
        types.SimpleNamespace(best=types.SimpleNamespace(candidate=plain), sync=None),
        cfg, batch=16, seq_len=16, devices=8, simulate=True,
    )  # fmt: skip
    assert "repeats" not in flags and "gather-once" not in flags


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_a_schedule_flag_of_meshtrain_train(name):
    job = cli.parse(["train", "--mesh", "pipe=2,data=4", "--schedule", name])
    assert job.pipeline.schedule == name


def test_a_bad_schedule_lists_the_new_names(capsys):
    code = cli.main(["train", "--schedule", "zb-h2", "--mesh", "pipe=2,data=4", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "choose from gpipe, circular, 1f1b, interleaved-1f1b, zb-h1" in err[0]


def test_gather_once_keeps_the_stages_weights_and_gradient_whole():
    cfg = mt.GPTConfig(d_model=64, n_layers=4, n_heads=4, max_seq_len=32, vocab_size=128)
    each = Candidate(2, 1, 4, 1, "fsdp", "none", 8, "1f1b")
    once = dataclasses.replace(each, gather_once=True)
    rules = mt.rules_for("fsdp")
    graphdef, abstract = abstract_model(lambda: cfg.build(rngs=nnx.Rngs(0)))
    params = nnx.split(nnx.merge(graphdef, abstract), nnx.Param, ...)[1]
    layouts = param_layouts(params, rules, each.sizes)
    kw = dict(batch=16, seq_len=32, device=profile("h100"))
    a, b = (model_candidate(c, layouts, cfg, **kw) for c in (each, once))
    stage = stage_gathered_bytes(layouts, each.sizes, ("fsdp",))
    blocks = sum(x.nbytes for x in layouts if x.path.startswith("blocks/"))
    assert stage == blocks / 2  # every stacked weight is split over fsdp; 2 stages
    assert "gathered weights" not in a.memory
    assert b.memory["gathered weights"] == 2 * stage == a.gather_once_bytes == b.gather_once_bytes
    assert b.peak - a.peak == pytest.approx(2 * stage)
    # 2m = 16 gathers of the stage's weights per step become one.
    assert a.estimate.comm_s["parameter gathers"] > 5 * b.estimate.comm_s["parameter gathers"]


def test_gather_once_is_chosen_when_it_fits_and_the_per_microbatch_gathers_dominate():
    p = plan(GPT, memory_cap=80e9, schedules=("1f1b",), **KW)
    best = p.best.modelled
    c = best.candidate
    assert c.pipe > 1 and c.fsdp > 1 and c.gather_once, c.describe()
    each = _twin(p, c, gather_once=False).modelled
    gathers = each.estimate.comm_s["parameter gathers"]
    assert gathers > 5 * best.estimate.comm_s["parameter gathers"]  # 2m = 16 passes vs 1
    assert gathers > each.estimate.compute_s  # no longer hidden behind compute
    assert each.estimate.total_s > best.estimate.total_s
    assert best.peak - each.peak == pytest.approx(best.gather_once_bytes)
    lines = reasoning(p, 1)
    assert "gather once" in lines[1]
    said = f"stage weights gathered once per step: +{best.gather_once_bytes / 1e9:.3g} GB"
    assert any(said in line for line in lines), lines


def test_gather_once_is_refused_when_the_memory_does_not_allow_it():
    free = plan(GPT, memory_cap=80e9, schedules=("1f1b",), **KW)
    once = free.best.modelled
    each = _twin(free, once.candidate, gather_once=False).modelled
    cap = (once.peak + each.peak) / 2  # room for the layout, not for its whole stage weights
    capped = plan(GPT, memory_cap=cap, schedules=("1f1b",), **KW)
    assert capped.over_memory > free.over_memory
    assert all(c.modelled.peak <= cap for c in capped.ranked)
    assert _twin(capped, once.candidate) is None  # refused
    kept = _twin(capped, once.candidate, gather_once=False)
    assert kept is not None
    i = capped.ranked.index(kept)
    lines = reasoning(dataclasses.replace(capped, ranked=[kept]), 1)
    assert "gather once" not in lines[1], (i, lines)
    assert "gathered per microbatch (gathering once per step would add" in lines[-1]


def test_the_planner_prefers_zb_h1_over_1f1b_where_it_pipelines(capsys):
    p = plan(GPT, memory_cap=80e9, **KW)
    best = p.best.modelled
    c = best.candidate
    assert c.pipe > 1 and c.schedule == "zb-h1", c.describe()
    f1b = _twin(p, c, schedule="1f1b").modelled
    m = c.microbatches
    assert best.estimate.bubble == pytest.approx(lockstep_bubble("zb-h1", c.pipe, m))
    assert f1b.estimate.bubble == pytest.approx(lockstep_bubble("1f1b", c.pipe, m))
    assert best.estimate.bubble < f1b.estimate.bubble
    assert best.estimate.total_s < f1b.estimate.total_s
    # The activations each holds are the table's: p microbatches for 1f1b, zb-h1 its own.
    held = held_microbatches("zb-h1", c.pipe, m) / held_microbatches("1f1b", c.pipe, m)
    assert best.memory["activations"] == pytest.approx(held * f1b.memory["activations"])
    # The command prints it: the schedule, its bubble, and writes it as flags.
    assert cli.main(["plan", "--model", "1.3b", "--devices", "8", "--hosts", "8",
                     "--batch", "16", "--confirm", "0", "--top", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert f"· zb-h1 m={m}" in out[2]
    assert f"bubble {best.estimate.bubble:.0%}" in out[3]
    assert cli.main(["plan", "--model", "1.3b", "--devices", "8", "--hosts", "8",
                     "--batch", "16", "--confirm", "0", "--json"]) == 0  # fmt: skip
    flags = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["train_flags"]
    assert flags["schedule"] == "zb-h1" and flags["microbatches"] == m
