"""Settings without effect (`meshtrain.effect.NEEDS`): every row of the table, generated from
it, is refused with its feature off and accepted with it on; the CLI refuses one in one line
and exit code 2 before anything compiles; the CLI page lists every row."""

from __future__ import annotations

import dataclasses
import pathlib
import random
import sys

import pytest

from meshtrain import cli
from meshtrain.check import check_run
from meshtrain.cli.parsing import flag_table
from meshtrain.cli.train import TrainJob
from meshtrain.effect import NEEDS, Needs, job_problems, no_effect_problems
from meshtrain.models import families
from meshtrain.models.base import DataSpec
from meshtrain.problem import Problem
from meshtrain.run import RunSpec

ROOT = pathlib.Path(__file__).parent.parent
BASE = RunSpec(data=DataSpec("lm", 8, 16, 256), mesh={"data": 8})


def _changed(run, changes: dict):
    """`run` (a `RunSpec` or a `TrainJob`) with `changes` (dotted paths:
    ``"precision.policy"``, or a whole ``"mesh"``)."""
    if isinstance(run, RunSpec):
        run = run.resolved()
    by_part: dict[str, dict] = {}
    for path, value in changes.items():
        part, _, name = path.partition(".")
        if name:
            by_part.setdefault(part, {})[name] = value
        else:
            run = dataclasses.replace(run, **{part: value})
    for part, fields in by_part.items():
        run = dataclasses.replace(run, **{part: dataclasses.replace(getattr(run, part), **fields)})
    return run


def _run(needs: Needs, changes: dict):
    """The smallest run of `needs`' model family (the default job, for scope ``job``),
    changed."""
    if needs.scope == "job":
        return _changed(TrainJob(), changes)
    model = families()[needs.family or "gpt"].config()
    return _changed(BASE.replace(model=model), changes)


def _problems(needs: Needs, run) -> list[Problem]:
    """What the row's scope refuses in `run`."""
    return job_problems(run) if needs.scope == "job" else no_effect_problems(run)


def _fields(needs: Needs, run) -> list[str]:
    return [p.field for p in _problems(needs, run)]


@pytest.mark.parametrize("needs", NEEDS, ids=[n.field for n in NEEDS])
def test_a_setting_is_refused_while_its_feature_is_off_and_counts_once_it_is_on(needs):
    value, turn_off, turn_on = needs.example
    assert value != needs.default
    assert _fields(needs, _run(needs, turn_off)) == []  # at its default it is never refused
    (problem,) = _problems(needs, _run(needs, {**turn_off, needs.at: value}))
    assert problem.field == needs.field and problem.value == value
    line = str(problem)
    assert "has no effect" in line and f"drop {needs.flag} or " in line, line
    assert "\n" not in line
    assert needs.field not in _fields(needs, _run(needs, {**turn_on, needs.at: value}))


@pytest.mark.parametrize("needs", NEEDS, ids=[n.field for n in NEEDS])
def test_each_row_names_a_flag_of_meshtrain_train_whose_default_is_the_rows(needs):
    table = flag_table(TrainJob)
    assert needs.flag in table, f"{needs.flag}: not a flag of meshtrain train"
    path = table[needs.flag].split(".")
    job = TrainJob()
    for name in path:
        job = getattr(job, name)
    assert job == needs.default  # so the default job is never refused


def test_every_setting_without_effect_is_refused_at_once_by_the_run_check():
    # several rows at once, drawn afresh: the run check names each, once, in the table's order
    rows = [n for n in NEEDS if n.scope == "run" and n.family in (None, "gpt") and not n.example[1]]
    chosen = random.sample(rows, 3)
    run = _run(chosen[0], {n.at: n.example[0] for n in chosen})
    order = [n.field for n in NEEDS if n in chosen]
    assert [p.field for p in check_run(run) if "has no effect" in p.message] == order


def test_loss_scaling_settings_are_refused_under_fp32_and_under_fp16_with_scaling_off():
    run = _changed(BASE.replace(model=families()["gpt"].config()), {"precision.policy": "fp32"})
    scaled = {"precision.loss_scale_init": 1024.0}
    (line,) = [str(p) for p in no_effect_problems(_changed(run, scaled))]
    assert line == (
        "loss_scale_init=1024.0: has no effect under --precision fp32: it belongs to fp16's loss "
        "scaling; drop --loss-scale-init or use --precision fp16 (with --loss-scale auto or "
        "dynamic)"
    )
    off = {"precision.policy": "fp16", "precision.loss_scale": "off", **scaled}
    (line,) = [str(p) for p in no_effect_problems(_changed(run, off))]
    assert "has no effect with --loss-scale off" in line
    assert no_effect_problems(_changed(run, {**off, "precision.loss_scale": "auto"})) == []


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["--loss-scale-init", "1024"], "loss_scale_init=1024.0: has no effect under --precision"),
        (["--offload-memory-kind", "unpinned_host"], "offload_memory_kind='unpinned_host': has"),
        (["--gather-once"], "gather_once=True: has no effect on a mesh with pipe=1"),
        (["--no-save", "--keep-last", "5"], "keep_last=5: has no effect with --no-save"),
    ],
)
def test_the_cli_refuses_a_flag_without_effect_in_one_line_before_compiling(
    capsys, monkeypatch, tmp_path, argv, start
):
    from meshtrain.train import trainer

    def never(*args, **kwargs):  # pragma: no cover - the failure it reports
        raise AssertionError("the step was built")

    monkeypatch.setattr(trainer, "init_train_state", never)
    monkeypatch.chdir(tmp_path)
    small = ["--data.source", "synthetic", "--gpt.n-layers", "1", "--gpt.d-model", "32"]
    run_dir = tmp_path / "run"
    code = cli.main(["train", *small, *argv, "--run-dir", str(run_dir), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    (line,) = err.strip().splitlines()
    assert line.startswith(f"meshtrain train: error: {start}"), line
    assert "Traceback" not in err + out
    assert not run_dir.exists()


def test_the_cli_page_lists_every_setting_without_effect():
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from no_effect import rows

    assert [r[0] for r in rows()] == [n.flag for n in NEEDS]
    page = (ROOT / "docs" / "cli.md").read_text()
    assert "```{meshtrain-no-effect}" in page
