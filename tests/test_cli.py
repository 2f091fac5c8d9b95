"""Tests for the ``meshtrain`` command: help, flag parsing, clean errors, an end-to-end run."""

import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import tyro
from _helpers import TINY_JOB, fresh_env

from meshtrain import cli
from meshtrain.cli import train as cli_train
from meshtrain.cli.train import TrainJob
from meshtrain.metrics import read_jsonl


def _help(capsys, argv):
    """Runs `main(argv)` for a --help; returns its stdout."""
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def _flags() -> dict[str, tuple[str | None, str]]:
    """Every config field's flag → (TrainJob field of its section or None, field name)."""
    hints = typing.get_type_hints(TrainJob, include_extras=True)
    flags = {}
    for f in dataclasses.fields(TrainJob):
        hint = hints[f.name]
        annotated = typing.get_origin(hint) is typing.Annotated
        cls = typing.get_args(hint)[0] if annotated else hint
        if not dataclasses.is_dataclass(cls):
            flags["--" + f.name.replace("_", "-")] = (None, f.name)
            continue
        omit = annotated and tyro.conf.OmitArgPrefixes in hint.__metadata__
        prefix = "--" if omit else f"--{f.name}."
        inner = typing.get_type_hints(cls, include_extras=True)
        for g in dataclasses.fields(cls):
            marks = getattr(inner[g.name], "__metadata__", ())
            named = next((m.name for m in marks if getattr(m, "name", None)), g.name)
            flags[prefix + named.replace("_", "-")] = (f.name, g.name)
    return flags


def test_help_reads_well(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    top = _help(capsys, ["--help"])
    assert "usage: meshtrain" in top and "train" in top
    assert "Traceback" not in top
    text = _help(capsys, ["train", "--help"])
    assert "usage: meshtrain train" in text
    for flag in ("--mesh", "--strategy", "--steps", "--lr", "--gpt.d-model", "--data.source"):
        assert flag in text, flag
    # Every field of every config has a flag, and the help is taken from the docstrings.
    missing = [flag for flag in _flags() if flag not in text]
    assert not missing, f"flags missing from the help: {missing}"
    assert "optimizer steps to run" in text and "peak learning rate" in text
    assert "(default: 200)" in text  # TrainJob's own default for the step count


# The transformer fields the GPT and the MoE both have: one value each, checked under both.
_TRANSFORMER = {
    "vocab-size": (["300"], 300),
    "max-seq-len": (["64"], 64),
    "d-model": (["48"], 48),
    "n-heads": (["6"], 6),
    "n-kv-heads": (["3"], 3),
    "d-ff": (["96"], 96),
    "rope-theta": (["500.0"], 500.0),
    "norm-eps": (["1e-6"], 1e-6),
    "tie-embeddings": ([], True),
    "remat": (["full"], "full"),
    "dtype": (["bfloat16"], "bfloat16"),
    "fp8": ([], True),
    "attention-impl": (["auto"], "auto"),
    "sliding-window": (["8"], 8),
    "vocab-multiple": (["64"], 64),
}

# A non-default, valid value for every config field: flag → (command-line words, expected).
OVERRIDES = {
    "--mesh": (["data=4,tensor=2"], "data=4,tensor=2"),
    "--strategy": (["fsdp"], "fsdp"),
    "--context-parallel": (["ulysses"], "ulysses"),
    "--devices": (["4"], 4),
    "--model": (["mlp"], "mlp"),
    "--prompt": (["class "], "class "),
    "--sample-tokens": (["3"], 3),
    "--save": ([], False),  # given as --no-save
    "--init-from": (["hf:/tmp/gpt2"], "hf:/tmp/gpt2"),
    "--export-hf": (["/tmp/tuned"], "/tmp/tuned"),
    "--steps": (["300"], 300),
    "--accum-steps": (["2"], 2),
    "--grad-compression": (["topk:0.01"], "topk:0.01"),
    "--error-feedback": ([], False),  # given as --no-error-feedback
    "--sync-every": (["4"], 4),
    "--outer-optimizer": (["nesterov"], "nesterov"),
    "--outer-lr": (["0.5"], 0.5),
    "--outer-momentum": (["0.8"], 0.8),
    "--staleness": (["2"], 2),
    "--gossip": (["torus"], "torus"),
    "--client-fraction": (["0.25"], 0.25),
    "--client-seed": (["5"], 5),
    "--precision": (["fp16"], "fp16"),
    "--loss-scale": (["off"], "off"),
    "--loss-scale-init": (["1024"], 1024.0),
    "--loss-scale-period": (["500"], 500),
    "--matmul-precision": (["highest"], "highest"),
    "--offload": (["optimizer"], "optimizer"),
    "--offload-memory-kind": (["unpinned_host"], "unpinned_host"),
    "--eval-every": (["5"], 5),
    "--eval-batches": (["2"], 2),
    "--log-every": (["3"], 3),
    "--seed": (["7"], 7),
    "--run-dir": (["/tmp/elsewhere"], "/tmp/elsewhere"),
    "--tensorboard": ([], True),
    "--progress": ([], False),  # given as --no-progress
    "--max-bad-steps": (["2"], 2),
    "--hang-factor": (["8"], 8.0),
    "--hang-floor-s": (["60"], 60.0),
    "--checkpoint-dir": (["/tmp/ckpts"], "/tmp/ckpts"),
    "--save-every": (["25"], 25),
    "--keep-last": (["5"], 5),
    "--keep-every": (["1000"], 1000),
    "--async-save": ([], False),  # given as --no-async-save
    "--resume": ([], True),
    "--optimizer": (["lamb"], "lamb"),
    "--lr": (["1e-3"], 1e-3),
    "--warmup-steps": (["5"], 5),
    "--min-lr-ratio": (["0.5"], 0.5),
    "--weight-decay": (["0.01"], 0.01),
    "--b1": (["0.8"], 0.8),
    "--b2": (["0.9"], 0.9),
    "--eps": (["1e-6"], 1e-6),
    "--momentum": (["0.8"], 0.8),
    "--clip-norm": (["2.0"], 2.0),
    "--data.source": (["text"], "text"),
    "--data.path": (["/tmp/corpus.txt"], "/tmp/corpus.txt"),
    "--data.seq-len": (["64"], 64),
    "--data.batch-size": (["8"], 8),
    "--data.seed": (["3"], 3),
    "--data.val-fraction": (["0.1"], 0.1),
    "--data.max-bytes": (["1000"], 1000),
    "--data.tokenizer": (["/tmp/tok/tokenizer.json"], "/tmp/tok/tokenizer.json"),
    "--data.packing": ([], False),  # given as --data.no-packing
    "--data.eval-path": (["/tmp/held.txt"], "/tmp/held.txt"),
    "--data.client-alpha": (["0.1"], 0.1),
    "--gpt.style": (["gpt2"], "gpt2"),
    **{f"--gpt.{name}": value for name, value in _TRANSFORMER.items()},
    "--gpt.n-layers": (["6"], 6),
    "--gpt.norm-impl": (["pallas"], "pallas"),
    "--gpt.restart-positions": ([], False),  # given as --gpt.no-restart-positions
    "--loss-impl": (["pallas"], "pallas"),
    "--mlp.num-features": (["8"], 8),
    "--mlp.num-classes": (["3"], 3),
    "--mlp.d-model": (["16"], 16),
    "--mlp.d-hidden": (["32"], 32),
    "--mlp.n-layers": (["3"], 3),
    "--schedule": (["circular"], "circular"),
    "--microbatches": (["8"], 8),
    "--repeats": (["2"], 2),
    "--gather-once": ([], True),
    "--dist.mode": (["on"], "on"),
    "--dist.coordinator": (["10.0.0.1:1234"], "10.0.0.1:1234"),
    "--dist.num-processes": (["4"], 4),
    "--dist.process-id": (["2"], 2),
    "--dist.heartbeat-timeout-s": (["9"], 9),
    "--dist.init-timeout-s": (["30"], 30),
    "--dist.shutdown-timeout-s": (["20"], 20),
    "--dist.collective-timeout-s": (["90"], 90),
    "--mlp.dtype": (["bfloat16"], "bfloat16"),
    "--mlp.fp8": ([], True),
    "--loss": (["mse"], "mse"),
    "--data.image-shape": (["16", "16", "1"], (16, 16, 1)),
    "--cnn.preset": (["vgg"], "vgg"),
    "--cnn.widths": (["8", "16"], (8, 16)),
    "--cnn.depth": (["2"], 2),
    "--cnn.image-size": (["16"], 16),
    "--cnn.in-channels": (["3"], 3),
    "--cnn.num-classes": (["5"], 5),
    "--cnn.hidden": (["32"], 32),
    "--cnn.norm": (["group"], "group"),
    "--cnn.groups": (["2"], 2),
    "--cnn.act-impl": (["pallas"], "pallas"),
    "--cnn.dtype": (["bfloat16"], "bfloat16"),
    **{f"--moe.{name}": value for name, value in _TRANSFORMER.items()},
    "--moe.n-layers": (["4"], 4),
    "--moe.n-experts": (["4"], 4),
    "--moe.top-k": (["1"], 1),
    "--moe.d-expert": (["32"], 32),
    "--moe.moe-every": (["2"], 2),
    "--moe.shared-expert": (["16"], 16),
    "--moe.dispatch": (["dropless"], "dropless"),
    "--moe.capacity-factor": (["2.0"], 2.0),
    "--moe.renormalize": ([], False),  # given as --moe.no-renormalize
    "--moe.aux-loss-coef": (["0.02"], 0.02),
    "--moe.z-loss-coef": (["0.0"], 0.0),
    "--moe.grouped-impl": (["xla"], "xla"),
    "--moe.router-losses": (["mixtral"], "mixtral"),
    "--moe.router-scores": (["sigmoid"], "sigmoid"),
    "--moe.routed-scale": (["2.5"], 2.5),
    "--moe.expert-groups": (["2"], 2),
    "--moe.groups-per-token": (["2"], 2),
    "--moe.bias-update-rate": (["0.001"], 0.001),
}
# Fields only style llama takes (OVERRIDES makes the GPT a gpt2): checked in a second job.
LLAMA_OVERRIDES = {
    "--gpt.rope-scaling": (["llama3"], "llama3"),
    "--gpt.rope-factor": (["32"], 32.0),
    "--gpt.rope-low-freq-factor": (["2"], 2.0),
    "--gpt.rope-high-freq-factor": (["8"], 8.0),
    "--gpt.rope-original-max-seq-len": (["4096"], 4096),
    "--gpt.qkv-bias": ([], True),
    **{f"--{model}.head-dim": (["16"], 16) for model in ("gpt", "moe")},
    **{f"--{model}.qk-norm": ([], True) for model in ("gpt", "moe")},
}
# Latent attention's fields (llama style, none of the settings it refuses): a third job.
MLA_OVERRIDES = {
    f"--{model}.{flag}": value
    for model in ("gpt", "moe")
    for flag, value in {
        "attention": (["mla"], "mla"),
        "mla-q-rank": (["16"], 16),
        "mla-kv-rank": (["32"], 32),
        "mla-nope-dim": (["8"], 8),
        "mla-rope-dim": (["4"], 4),
        "mla-v-dim": (["12"], 12),
    }.items()
}
MLA_OVERRIDES["--gpt.n-kv-heads"] = (["0"], 0)  # the CLI's GPT has 2; latent attention takes 0


def _get(job, section, name):
    """A field of `job` (section None) or of one of its config sections."""
    return getattr(job if section is None else getattr(job, section), name)


def _negated(flag):
    """tyro's off switch of a boolean flag: --save → --no-save, --gpt.x → --gpt.no-x."""
    head, dot, name = flag[2:].rpartition(".")
    return f"--{head}{dot}no-{name}"


def test_parse_documented_example():
    argv = "train --mesh data=4,tensor=2 --strategy fsdp --steps 300 --lr 1e-3"
    job = cli.parse(argv.split() + ["--gpt.n-layers", "6", "--data.source", "synthetic"])
    assert isinstance(job, TrainJob)
    assert job.mesh == "data=4,tensor=2" and job.strategy == "fsdp"
    assert job.train.steps == 300 and job.optim.lr == 1e-3
    assert job.gpt.n_layers == 6 and job.data.source == "synthetic"
    # Everything else keeps its default.
    default = cli.parse(["train"])
    assert job.gpt == dataclasses.replace(default.gpt, n_layers=6)
    assert job.train == dataclasses.replace(default.train, steps=300)
    assert job.optim == dataclasses.replace(default.optim, lr=1e-3)
    assert job.data == dataclasses.replace(default.data, source="synthetic")
    assert job.mlp == default.mlp and job.model == default.model == "gpt"
    assert default.train.steps == 200 and default.gpt.n_kv_heads == 2


@pytest.mark.parametrize(
    "overrides", [OVERRIDES, LLAMA_OVERRIDES, MLA_OVERRIDES], ids=["all", "llama-only", "mla"]
)
def test_every_config_field_can_be_overridden(overrides):
    flags = _flags()
    untested = sorted(set(flags) - set(OVERRIDES) - set(LLAMA_OVERRIDES) - set(MLA_OVERRIDES))
    assert not untested, f"new config fields: add a value for {untested} to OVERRIDES"
    default = cli.parse(["train"])
    argv = ["train"]
    for flag, (words, want) in overrides.items():
        section, name = flags[flag]
        assert _get(default, section, name) != want, f"{flag}: pick a non-default value"
        if words:
            argv += [flag, *words]
        else:  # a boolean: --x or --no-x
            argv.append(flag if want else _negated(flag))
    job = cli.parse(argv)
    for flag, (_, want) in overrides.items():
        section, name = flags[flag]
        assert _get(job, section, name) == want, flag


def test_the_run_summary_shows_chunks_per_stage_and_what_gathering_once_holds():
    import math

    import jax
    from flax import nnx

    from meshtrain import make_mesh, rules_for
    from meshtrain._units import fmt_bytes
    from meshtrain.models.base import DataSpec

    argv = ["train", "--mesh", "pipe=2,fsdp=4", "--strategy", "fsdp", "--gpt.n-layers", "4"]
    job = cli.parse([*argv, "--schedule", "interleaved-1f1b", "--repeats", "2", "--gather-once"])
    mesh = make_mesh(job.mesh)
    rules = rules_for(job.strategy, mesh)
    spec = DataSpec("lm", 16, 32, 256)

    def pipeline_line(job):
        lines = cli_train.run_spec(job, spec, mesh, rules).summary()
        return next(line for line in lines if line.startswith("pipeline "))

    assert pipeline_line(job) == (
        "pipeline interleaved-1f1b · 2 stages · 4 microbatches · v=2 chunks per stage · "
        "stage weights gathered once per step"
    )
    # Every stacked layer weight is split over fsdp: a device keeps its stage's half of them.
    model = nnx.eval_shape(lambda: job.gpt.build(rngs=nnx.Rngs(0)))
    blocks = nnx.state(model, nnx.Param)["blocks"]
    whole = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(blocks)) / 2
    assert cli_train.gathered_line(job, mesh, rules) == (
        f"gather once: +{fmt_bytes(whole)} of stage weights per device"
    )
    plain = cli.parse([*argv, "--schedule", "zb-h1"])
    assert pipeline_line(plain) == "pipeline zb-h1 · 2 stages · 4 microbatches"


def test_each_feature_writes_its_own_run_summary_line():
    from meshtrain.layout import rules_for
    from meshtrain.offload import Offload
    from meshtrain.replicas import SyncConfig

    sync = SyncConfig(grad_compression="int8")
    sizes = {"data": 4, "tensor": 2}
    assert sync.describe(rules_for("dp+tp", sizes), sizes) == (
        "replicas: 4 over data · gradients int8 with error feedback"
    )
    assert Offload(optimizer=True, memory_kind="unpinned_host").describe(2.5e6) == (
        "offload optimizer · 2.50 MB per device in unpinned_host memory, fetched and written "
        "back each step"
    )


def test_the_cli_prints_the_run_summary_the_trainer_logs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags = ["--model", "moe", "--moe.n-layers", "1", "--moe.d-model", "32",
             "--moe.max-seq-len", "16", "--data.source", "synthetic", "--data.seq-len", "16",
             "--data.batch-size", "8", "--mesh", "data=4,expert=2", "--sync-every", "4",
             "--client-fraction", "0.5", "--no-save", "--run-dir", ""]  # fmt: skip
    job = cli.parse(["train", *flags])
    said: list[str] = []
    trainer = cli_train.build_trainer(job, said.append)
    assert said == trainer.summary, said  # the same lines, once each
    assert "replicas: 4 clients over data (each with its expert devices)" in said[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "steps=0"),
        (["--lr", "-1"], "lr=-1"),
        (["--sync-every", "0"], "sync_every=0"),
        (["--staleness", "-1"], "staleness=-1"),
        (["--grad-compression", "topk:1.5"], "fraction must be a number in (0, 1]"),
        (["--grad-compression", "int4"], "choose from none, bf16, int8"),
        (["--grad-compression", "int8", "--mesh", "fsdp=8", "--strategy", "fsdp"], "dp, zero1"),
        (["--outer-optimizer", "nesterov"], "add --sync-every"),
        (["--sync-every", "4", "--mesh", "pipe=2,data=4"], "pipelines"),
        (["--strategy", "fsdp2"], "fsdp2"),
        (["--mesh", "data=3,tensor=2"], "≠ 8 devices"),
        (["--gpt.remat", "bogus"], "bogus"),
        (["--model", "resnet"], "resnet"),
        (["--keep-last", "0"], "keep_last=0"),
        (["--resume", "--no-save"], "resume=True: needs checkpoints"),
        (["--data.path", "notes.txt"], "add --data.source text"),
        (["--data.client-alpha", "0"], "data.client_alpha=0.0: must be a number > 0"),
        (["--data.client-alpha", "0.1"], "client data needs replicas that step apart"),
        (["--data.source", "arrays", "--data.path", "notes.txt"], "is not an .npz archive"),
        (["--model", "cnn"], "the CNN needs image classification data"),
        (["--model", "cnn", "--data.source", "images", "--data.path", "x.npz"], "no such file"),
        (["--model", "cnn", "--data.source", "digits", "--cnn.image-size", "28"], "8×8×1"),
    ],
)
def test_errors_are_one_line_and_exit_2(capsys, monkeypatch, tmp_path, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("hello there\n")  # a relative --data.path
    try:
        code = cli.main(["train", *argv, "--run-dir", str(tmp_path / "run"), "--no-progress"])
    except SystemExit as e:  # pragma: no cover - the failure shown below
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("meshtrain train: error: ") and message in lines[0], err
    assert "Traceback" not in err + out
    assert "tyro" not in err  # no internal names leak
    assert not (tmp_path / "run").exists()  # rejected before anything ran


def test_a_run_that_ends_on_a_non_finite_loss_stops_with_exit_1(capsys, monkeypatch, tmp_path):
    """Bad data can leave the last steps' loss nan without five bad steps in a row: such a run
    must not end ``done`` with exit 0."""
    from meshtrain.cli import train as cli_train

    real = cli_train._summary

    def ends_on_nan(trainer, history):
        return {**real(trainer, history), "final_loss": float("nan")}

    monkeypatch.setattr(cli_train, "_summary", ends_on_nan)
    argv = ["train", "--mesh", "data=8", "--strategy", "dp", "--steps", "2", *TINY_JOB]
    argv += ["--run-dir", str(tmp_path / "run")]
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert "meshtrain train: stopped: the final loss is nan" in err, err
    assert "done in" not in out
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()  # the checkpoints are kept


@pytest.mark.slow
def test_console_script_end_to_end_twice_keeps_the_first_run(tmp_path):
    """The installed ``meshtrain`` script, run twice in fresh processes (where jax must not
    start before the CLI simulates the devices) at the default run_dir: the first run trains,
    saves and samples; the second, the same job, moves to runs/default-1 and leaves the first
    run as it was."""
    script = Path(sys.executable).parent / "meshtrain"
    assert script.exists(), script
    argv = [
        str(script),
        "train",
        "--steps", "12",
        "--gpt.d-model", "32",
        "--gpt.n-layers", "2",
        "--data.seq-len", "32",
        "--data.batch-size", "16",
        "--sample-tokens", "16",
        "--eval-every", "0",
    ]  # fmt: skip
    env = fresh_env()  # no device count: the CLI must simulate the devices
    outs = []
    for _ in range(2):
        proc = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420, check=False
        )
        assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        outs.append(proc.stdout)
    out = outs[0]
    assert "data=2 × fsdp=2 × tensor=2 (8 cpu devices)" in out, out
    assert "loss" in out and "final loss" in out, out
    assert "kernels: attention xla · norm xla · loss xla\n" in out, out  # set, not auto
    assert "sample:\ndef " in out, out
    run_dir = tmp_path / "runs" / "default"
    ckpt = run_dir / "checkpoints" / "12"
    assert f"checkpoint saved to {ckpt}" in out, out
    assert (ckpt / "state").is_dir() and (ckpt / "data").is_dir()
    meta = json.loads((ckpt / "meta" / "metadata").read_text())
    job = meta["config"]["job"]
    assert job["train"]["steps"] == 12 and job["gpt"]["d_model"] == 32
    assert meta["mesh"]["axes"] == {
        "pipe": 1,
        "data": 2,
        "fsdp": 2,
        "expert": 1,
        "seq": 1,
        "tensor": 2,
    }
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["split"] == "train"]
    assert steps and steps == sorted(steps) and steps[-1] == 12
    # The second run: elsewhere, and the first run's files as they were.
    assert "this run writes to runs/default-1" in outs[1], outs[1]
    again = tmp_path / "runs" / "default-1"
    assert f"checkpoint saved to {again / 'checkpoints' / '12'}" in outs[1], outs[1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["12"]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [
        r["step"] for r in read_jsonl(again / "metrics.jsonl")
    ]  # one run's rows each, none appended to the first's


def test_default_job_moves_to_a_fresh_run_dir_instead_of_touching_an_earlier_run(
    tmp_path, monkeypatch
):
    from meshtrain.cli import train as cli_mod

    monkeypatch.chdir(tmp_path)
    said = []
    job = cli_mod.parse([])
    assert cli_mod._fresh_default_run_dir(job, said.append) is job  # nothing there yet
    (tmp_path / "runs/default/checkpoints/200").mkdir(parents=True)
    (tmp_path / "runs/default-1").mkdir()
    moved = cli_mod._fresh_default_run_dir(job, said.append)
    assert moved.train.run_dir == "runs/default-2"
    assert "runs/default-2" in said[-1]
    assert sorted(p.name for p in (tmp_path / "runs/default/checkpoints").iterdir()) == ["200"]
    # Asked to resume, or given a run_dir of its own, the job is left as it is.
    resume = cli_mod.parse(["--resume"])
    assert cli_mod._fresh_default_run_dir(resume, said.append) is resume
    explicit = cli_mod.parse(["--run-dir", "runs/default-1"])
    assert cli_mod._fresh_default_run_dir(explicit, said.append) is explicit


@pytest.mark.slow
def test_resuming_with_another_model_size_is_one_line_and_changes_nothing(tmp_path):
    """A run's checkpoint, then ``meshtrain train --resume`` with another --gpt.d-model: one
    line, exit 2, no warnings before it, and nothing set aside as if it were damaged."""
    flags = ["--gpt.n-layers", "1", "--gpt.max-seq-len", "16", "--data.source", "synthetic",
             "--data.seq-len", "16", "--data.batch-size", "8", "--sample-tokens", "0",
             "--run-dir", str(tmp_path / "run")]  # fmt: skip
    # The checkpoint the CLI's own trainer writes (in this process; no step compiled).
    trainer = cli_train.build_trainer(
        cli.parse(["train", *flags, "--gpt.d-model", "32"]), say=print
    )
    trainer.save(wait=True)
    trainer.checkpoints.close()
    ckpts = tmp_path / "run" / "checkpoints"
    before = {str(p.relative_to(ckpts)): p.stat().st_mtime_ns for p in ckpts.rglob("*")}
    assert sorted(p.name for p in ckpts.iterdir()) == ["0"]
    script = Path(sys.executable).parent / "meshtrain"
    env = fresh_env()
    proc = subprocess.run(
        [str(script), "train", *flags, "--gpt.d-model", "64", "--resume"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no warnings before it
    line = lines[0]
    assert line.startswith("meshtrain train: error: checkpoint ") and len(line) < 500, line
    assert "was written with a different model" in line and "parameters differ" in line, line
    assert "same model and optimizer settings" in line and "--run-dir" in line, line
    after = {str(p.relative_to(ckpts)): p.stat().st_mtime_ns for p in ckpts.rglob("*")}
    assert after == before  # nothing set aside, renamed, written or deleted
