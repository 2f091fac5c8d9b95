"""The ``meshtrain`` command as one package: every subcommand listed and helped, every mistake
one line on stderr with exit code 2 and nothing written, ``--init-from`` resolved once."""

import dataclasses
import hashlib
import re
import typing
from pathlib import Path

import pytest

from meshtrain.cli import COMMANDS, main, parse, parsing
from meshtrain.cli.train import TrainJob
from meshtrain.models import families

GPT2 = Path(__file__).parent / "fixtures" / "hf" / "gpt2"  # n_positions 32, vocab 256


def test_help_lists_every_command_and_each_command_helps_itself(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    assert top.startswith("usage: meshtrain")
    for name, line in COMMANDS.items():
        assert re.search(rf"^  {name} +{re.escape(line)}$", top, re.M), name
    assert list(COMMANDS) == ["train", "inspect", "plan", "bench", "prepare", "generate", "launch"]
    for name in COMMANDS:
        assert main([name, "--help"]) == 0, name
        out = capsys.readouterr().out
        assert out.splitlines()[0].startswith(f"usage: meshtrain {name} "), (name, out[:200])


def _box_flags(text: str) -> set[str]:
    """The flags tyro's help lists at the start of its option rows."""
    rows = re.findall(r"^(?:│ | {1,2})(--[a-z][\w.-]*)(?:, (--[a-z][\w.-]*))?", text, re.M)
    return {f for pair in rows for f in pair if f}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_flag_table_is_exactly_what_tyro_offers(capsys, monkeypatch, name):
    """Did-you-mean and the flags given are read from `flag_table`: it must match the help."""
    import importlib

    monkeypatch.setenv("COLUMNS", "80")  # one column of options
    assert main([name, "--help"]) == 0
    shown = _box_flags(capsys.readouterr().out) - {"--help"}
    module = importlib.import_module(f"meshtrain.cli.{name}")
    settings = [v for k, v in vars(module).items() if k.endswith(("Settings", "Job"))]
    cls = {"train": TrainJob}.get(name) or [c for c in settings if c is not TrainJob][0]
    assert set(parsing.flag_table(cls)) == shown


def test_train_job_has_one_field_per_registered_family():
    hints = typing.get_type_hints(TrainJob)
    fields = {f.name: f for f in dataclasses.fields(TrainJob)}
    assert families(), "no model family registered"
    for name, family in families().items():
        assert name in fields, f"family {name!r} has no TrainJob field: add `{name}: ...`"
        assert hints[name] is family.config and fields[name].default == family.default, name
    job = parse(["train", "--model", "mlp"])
    assert job.model_config() is job.mlp


def test_no_command_and_a_misspelt_command_are_one_line(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshtrain: error: no command")
    assert all(name in err[0] for name in COMMANDS)
    assert main(["trian", "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["meshtrain: error: trian: unknown command; did you mean train?"]


def _tree(root: Path) -> dict[str, str]:
    """Every path under `root` → the hash of its bytes ("dir" for a directory)."""
    return {
        str(p.relative_to(root)): "dir"
        if p.is_dir()
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


# (command line, words the one line must hold). Run in a directory holding notes.txt,
# plan.json and plans/ (see the test); none of them may change, nothing may appear.
MISTAKES = [
    ("train --steps 1e3", "--steps 1e3: not a whole number; write it as digits: --steps 1000"),
    ("train --lr abc", "--lr abc: not a number; e.g. --lr "),
    ("train --stpes 3", "unknown flag --stpes; did you mean --steps?"),
    ("train --gpt.n-layres 3", "unknown flag --gpt.n-layres; did you mean --gpt.n-layers?"),
    ("train extra", "unexpected argument 'extra'"),
    ("train --config missing.json", "--config missing.json: cannot read it"),
    ("train --moe.n-experts 4", "--moe.n-experts: a flag of the moe model, but --model is gpt"),
    ("train --model moe --gpt.n-layers 2", "add --model gpt, or drop the --gpt.* flags"),
    ("train --context-parallel ulysses", "--context-parallel ulysses: the mesh"),
    ("train --mesh data=8 --context-parallel ring", "no seq axis > 1"),
    ("train --steps 0", "steps=0"),
    ("inspect --steps x", "--steps x: not a whole number"),
    ("inspect --jsno", "unknown flag --jsno; did you mean --json?"),
    ("inspect --cnn.depth 2", "add --model cnn"),
    ("plan --devices 6.5", "--devices 6.5: not a whole number"),
    ("plan --wirte out.json", "unknown flag --wirte; did you mean --write?"),
    ("plan --write plan.json", "--write plan.json: the file exists; add --overwrite"),
    ("plan --write plans", "--write plans: a directory; give a file name"),
    ("plan --write nowhere/plan.json", "no directory nowhere"),
    ("bench --steps 1e3", "--steps 1e3: not a whole number; write it as digits: --steps 1000"),
    ("bench --size 7b", "--size 7b: choose from tiny, 125m, 350m, 1.3b"),
    ("bench --style lama", "--style lama: choose from llama, gpt2; did you mean llama?"),
    ("bench --stesp 2", "unknown flag --stesp; did you mean --steps?"),
    ("bench --batch -1", "batch=-1: must be an integer ≥ 0; e.g. --batch 0"),
    ("prepare no/such/dir --out corpus", "no/such/dir"),
    ("prepare --out corpus", "inputs=(): give files or directories"),
    ("prepare notes.txt --out corpus --workers two", "--workers two: not a whole number"),
    ("prepare notes.txt --out corpus --feild body", "did you mean --field?"),
    ("generate no/such/run", "no/such/run: no meshtrain checkpoint there"),
    ("generate", "missing SOURCE; e.g. meshtrain generate"),
    ("generate run --tokens 1e2", "--tokens 1e2: not a whole number; write it as digits"),
    ("generate run --top-p abc", "--top-p abc: not a number"),
    ("generate run --tmperature 0", "did you mean --temperature?"),
    ("launch", "missing --nproc; e.g. meshtrain launch --nproc 2"),
    ("launch --nproc two -- train", "--nproc two: not a whole number"),
    ("launch --nprc 2 -- train", "unknown flag --nprc; did you mean --nproc?"),
    ("launch --nproc 2", "no command"),
]


@pytest.mark.parametrize(("argv", "needle"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_mistake_is_one_line_exit_2_and_writes_nothing(
    capsys, monkeypatch, tmp_path, argv, needle
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("hello there\n")
    (tmp_path / "plan.json").write_text('{"mesh": "data=8"}')
    (tmp_path / "plans").mkdir()
    before = _tree(tmp_path)
    words = argv.split()
    code = main(words)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (out, err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"meshtrain {words[0]}: error: "), lines[0]
    assert needle in lines[0], lines[0]
    assert "Traceback" not in out + err and "tyro" not in err and "╭" not in err
    assert _tree(tmp_path) == before


def test_plan_overwrite_replaces_the_file(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.json").write_text("{}")
    argv = ["plan", "--model", "tiny", "--devices", "8", "--device", "cpu-sim", "--confirm", "0"]
    assert main([*argv, "--write", "plan.json", "--overwrite"]) == 0
    assert "mesh" in (tmp_path / "plan.json").read_text()
    capsys.readouterr()


def test_given_names_the_fields_the_flags_set():
    argv = ["--gpt.d-model", "128", "--no-save", "--steps=5", "--data.no-packing", "x"]
    assert parsing.given(argv, TrainJob) == {"gpt.d_model", "save", "train.steps", "data.packing"}


def test_init_from_is_resolved_once_per_run(capsys, monkeypatch, tmp_path):
    from meshtrain.hf import finetune
    from meshtrain.train.trainer import Trainer

    calls = []
    real = finetune.resolve

    def counted(job, given=frozenset()):
        calls.append(sorted(given))
        return real(job, given)

    monkeypatch.setattr(finetune, "resolve", counted)
    monkeypatch.setattr(Trainer, "fit", lambda self, *a, **k: [])  # built, never stepped
    argv = ["train", "--init-from", f"hf:{GPT2}", "--mesh", "data=8", "--strategy", "dp"]
    argv += ["--gpt.remat", "full", "--data.source", "synthetic", "--data.seq-len", "16"]
    argv += ["--no-save", "--run-dir", "", "--sample-tokens", "0", "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    assert len(calls) == 1
    assert {"init_from", "gpt.remat", "data.source", "save"} <= set(calls[0])
    assert "weights and tokenizer from hf:" in capsys.readouterr().out


def test_generate_refuses_a_prompt_longer_than_the_context(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["generate", f"hf:{GPT2}", "--prompt", "x" * 40, "--tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("meshtrain generate: error: prompt: 40 tokens")
        and "--prompt" in err[0]
    )
    assert "context of 32" in err[0] and "at most 32" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_generate_from_a_checkpoint_prints_no_library_warnings(capfd, tmp_path):
    from meshtrain.cli import parse
    from meshtrain.cli.train import build_trainer

    flags = ["--gpt.n-layers", "1", "--gpt.d-model", "32", "--gpt.max-seq-len", "16"]
    flags += ["--data.source", "synthetic", "--data.seq-len", "16", "--data.batch-size", "8"]
    flags += ["--mesh", "data=8", "--strategy", "dp", "--run-dir", str(tmp_path / "run")]
    trainer = build_trainer(parse(["train", *flags]), say=lambda *a: None)
    trainer.save(wait=True)
    trainer.checkpoints.close()
    capfd.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", "ab", "--tokens", "2"]) == 0
    out, err = capfd.readouterr()
    assert out.startswith("ab") and err == "", err


def test_meshtrain_debug_shows_the_traceback(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MESHTRAIN_DEBUG", "1")
    with pytest.raises(ValueError, match="no meshtrain checkpoint there"):
        main(["generate", "no/such/run"])


def test_launch_takes_the_command_after_its_flags():
    from meshtrain.cli.launch import parse as parse_launch

    a = parse_launch(["--nproc", "2", "--", "train", "--steps", "5"])
    b = parse_launch(["--nproc=2", "--port", "0", "train", "--steps", "5"])
    assert a.command == b.command == ("train", "--steps", "5") and a.nproc == b.nproc == 2


def test_bench_choices_are_the_sizes_and_kernels_that_exist():
    from meshtrain.bench import SIZES
    from meshtrain.cli.bench import BenchSettings
    from meshtrain.kernels import ATTENTION_IMPLS, IMPLS

    hints = typing.get_type_hints(BenchSettings)
    assert typing.get_args(hints["size"]) == tuple(SIZES)
    assert set(typing.get_args(hints["attention"])) == {"default", *ATTENTION_IMPLS}
    assert set(typing.get_args(hints["norm"])) == set(typing.get_args(hints["loss"])) == set(IMPLS)


def test_prepare_writes_beside_other_files_only_with_overwrite(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("def f():\n    return 1\n" * 20)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "keep.md").write_text("mine")
    argv = ["prepare", "notes.txt", "--out", "corpus", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not empty" in err[0] and "--overwrite" in err[0], err
    assert sorted(p.name for p in (tmp_path / "corpus").iterdir()) == ["keep.md"]
    assert main([*argv, "--overwrite"]) == 0
    names = {p.name for p in (tmp_path / "corpus").iterdir()}
    assert "keep.md" in names and len(names) > 1
    assert (tmp_path / "corpus" / "keep.md").read_text() == "mine"
