"""The run check: every problem of a run found at once, each naming the field, the value and
the fix; batch devices counted from the rules; nothing compiled or allocated."""

import dataclasses

import jax
import numpy as np
import pytest
from _helpers import count_compiles
from flax import nnx

import meshtrain as mt
from meshtrain.check import check_run
from meshtrain.models import DataSpec
from meshtrain.problem import Problem
from meshtrain.state import abstract_model

LM = DataSpec(kind="lm", batch_size=16, seq_len=32, vocab_size=256)
GPT = mt.GPTConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
NO_DIR = mt.TrainConfig(run_dir="")  # no run directory to check: the settings' problems only


def _fields(problems):
    return sorted(p.field for p in problems)


def test_a_good_run_has_no_problems():
    sizes = dict(pipe=1, data=2, fsdp=2, expert=1, seq=1, tensor=2)
    rules = mt.rules_for("fsdp+tp", sizes)
    assert check_run(mt.RunSpec(model=GPT, data=LM, mesh=sizes, rules=rules, train=NO_DIR)) == []


def test_every_problem_is_reported_at_once():
    sizes = dict(pipe=2, data=4, fsdp=1, expert=1, seq=2, tensor=1)
    data = LM._replace(batch_size=12, seq_len=64, vocab_size=300)
    cfg = mt.GPTConfig(d_model=32, n_layers=3, n_heads=4, max_seq_len=32)
    problems = check_run(
        mt.RunSpec(
            model=cfg,
            data=data,
            mesh=sizes,
            rules=mt.rules_for("fsdp", sizes),
            train=mt.TrainConfig(accum_steps=2, run_dir=""),
            pipeline=mt.PipelineConfig(schedule="1f1b", microbatches=2),
        )
    )
    text = "\n".join(map(str, problems))
    assert "mesh.seq=2: context parallelism with a hand-scheduled schedule beside " in text
    assert "data.batch_size=12: does not divide into accum_steps=2" in text
    assert "data.seq_len=64: exceeds the model's max_seq_len=32" in text
    assert "gpt.vocab_size=256: the data has 300 token ids" in text
    assert "layers=3: not divisible by pipe × repeats = 2 × 1 = 2" in text
    assert "3 rows per microbatch, not divisible by data = 4 devices" in text
    assert "microbatches=2 < pipe=2" not in text  # 2 microbatches fill 2 stages
    assert all(isinstance(p, Problem) and ";" in p.message for p in problems), text
    assert len(problems) == 6, text


def test_batch_devices_come_from_the_rules_not_a_constant():
    """A user's rules that split the batch over data only: 12 rows on data=2 × fsdp=4 is
    fine (the fsdp axis carries parameters only); over data × fsdp it would not be."""
    sizes = dict(pipe=1, data=2, fsdp=4, expert=1, seq=1, tensor=1)
    preset = mt.rules_for("fsdp", sizes)
    mine = mt.Rules(
        params=preset.params, activations={**preset.activations, "batch": "data"}, name="mine"
    )
    data = LM._replace(batch_size=12)
    assert check_run(mt.RunSpec(model=GPT, data=data, mesh=sizes, rules=mine, train=NO_DIR)) == []
    (problem,) = check_run(mt.RunSpec(model=GPT, data=data, mesh=sizes, rules=preset, train=NO_DIR))
    assert "data × fsdp = 8 devices; use a multiple of 8" in str(problem)


def test_the_parameter_layout_is_checked_from_the_abstract_model():
    cfg = mt.GPTConfig(d_model=36, n_layers=2, n_heads=2, max_seq_len=32)  # 36 % 8 != 0
    sizes = dict(pipe=1, data=1, fsdp=8, expert=1, seq=1, tensor=1)
    abstract = abstract_model(lambda: cfg.build(rngs=nnx.Rngs(0)))
    rules = mt.rules_for("fsdp", sizes)
    problems = check_run(
        mt.RunSpec(model=cfg, data=LM, mesh=sizes, rules=rules, train=NO_DIR), abstract=abstract
    )
    assert problems and all(p.field == "strategy" for p in problems)
    assert "(embed=36) is not divisible by mesh fsdp=8 = 8" in str(problems[0])


def test_a_padded_vocabulary_that_tensor_does_not_split_names_the_multiple():
    """GPT-2's 50257 ids pad to 50304 (vocab_multiple=128): fine on tensor=4 and 8, not on
    tensor=5; unpadded, not even on tensor=2. Each problem names the vocab_multiple to set."""
    gpt2 = mt.GPTConfig(style="gpt2", vocab_size=50257, d_model=32, n_layers=1, n_heads=4)
    data = LM._replace(batch_size=16, vocab_size=50257)

    def problems(cfg, tensor):
        sizes = dict(pipe=1, data=1, fsdp=1, expert=1, seq=1, tensor=tensor)
        rules = mt.rules_for("tp", sizes)
        return check_run(mt.RunSpec(model=cfg, data=data, mesh=sizes, rules=rules, train=NO_DIR))

    assert problems(gpt2, 4) == problems(gpt2, 8) == []
    (five,) = problems(gpt2, 5)
    assert str(five) == (
        "gpt.vocab_multiple=128: the vocabulary of 50257 padded to 50304 ids does not split "
        "over tensor=5; set --gpt.vocab-multiple 640 (pads it to 50560)"
    )
    (two,) = problems(dataclasses.replace(gpt2, vocab_multiple=1), 2)
    assert "50257 ids does not split over tensor=2; set --gpt.vocab-multiple 2 " in str(two)


def test_the_check_compiles_and_allocates_nothing():
    """Cheap enough for a planner: many candidate meshes, no compile, no device arrays."""
    abstract = abstract_model(lambda: GPT.build(rngs=nnx.Rngs(0)))
    before = len(jax.live_arrays())
    with count_compiles() as compiles:
        for data, tensor in ((1, 8), (2, 4), (4, 2), (8, 1), (3, 1)):
            sizes = dict(pipe=1, data=data, fsdp=1, expert=1, seq=1, tensor=tensor)
            rules = mt.rules_for("dp", sizes)
            check_run(
                mt.RunSpec(model=GPT, data=LM, mesh=sizes, rules=rules, train=NO_DIR),
                abstract=abstract,
            )
    assert compiles == [] and len(jax.live_arrays()) == before


def test_the_trainer_raises_every_problem_before_compiling(tmp_path):
    mesh = mt.make_mesh("data=8")
    tokens = np.zeros((64, 9), np.int32)
    data = mt.make_arrays_dataset(tokens[:, :-1], tokens[:, 1:], batch_size=12)
    with count_compiles() as compiles, pytest.raises(mt.RunCheckError) as err:
        mt.Trainer(
            run=mt.RunSpec(
                model=mt.GPTConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=4),
                data=data,
                mesh=mesh,
                rules=mt.rules_for("dp", mesh),
                train=mt.TrainConfig(steps=1, run_dir="", progress=False),
            )
        )
    assert compiles == []
    assert _fields(err.value.problems) == ["data.batch_size", "data.seq_len"]
    assert len(str(err.value).splitlines()) == 2


def test_kernels_in_a_pipeline_pass_the_check():
    """The Pallas kernels and cuDNN's fused attention each carry a per-shard backward into a
    stage: both pass the run check on pipe > 1."""
    sizes = dict(pipe=2, data=4, fsdp=1, expert=1, seq=1, tensor=1)
    cfg = mt.GPTConfig(
        d_model=128, n_layers=2, n_heads=2, max_seq_len=32, attention_impl="pallas",
        norm_impl="pallas",
    )  # fmt: skip
    rules = mt.rules_for("dp", sizes)
    assert check_run(mt.RunSpec(model=cfg, data=LM, mesh=sizes, rules=rules)) == []
    cudnn = dataclasses.replace(cfg, attention_impl="cudnn", dtype="bfloat16")
    assert check_run(mt.RunSpec(model=cudnn, data=LM, mesh=sizes, rules=rules)) == []
