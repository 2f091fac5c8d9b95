"""``meshtrain launch`` checks its own settings and a train job's flags once, before any process
starts: each mistake is one line and exit code 2, the job's lines starting ``train``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain import cli
from meshtrain.cli.launch import parse as parse_launch
from meshtrain.launch import plan as plan_launch
from meshtrain.launch import supervise

ROOT = Path(__file__).resolve().parents[1]
HARMLESS = ["--", sys.executable, "-c", "pass"]
# A user's environment on the CPU: no device count carried over from this process.
USER_ENV = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}


@pytest.fixture
def started(monkeypatch):
    """Records each job the launcher would start (its command), starting none."""
    commands = []

    def record(self):
        commands.append(self.command)
        return 0

    monkeypatch.setattr(supervise.Supervisor, "run", record)
    return commands


def _refused(capsys, argv) -> list[str]:
    """The error lines of ``meshtrain launch ARGV``, which must exit with code 2."""
    code = cli.main(["launch", *argv])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert lines and all(line.startswith("meshtrain launch: error: ") for line in lines), err
    return lines


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--grace", "-1"], "launch --grace -1.0: must be ≥ 0 seconds"),
        (["--grace", "inf"], "launch --grace inf: must be ≥ 0 seconds, finite"),
        (["--restart-delay", "nan"], "launch --restart-delay nan: must be ≥ 0 seconds"),
        (["--heartbeat-timeout", "0"], "launch --heartbeat-timeout 0: must be a whole number"),
        (["--heartbeat-timeout", "-3"], "launch --heartbeat-timeout -3: must be a whole number"),
    ],
)
def test_the_launchers_own_settings_are_one_line_before_anything_starts(
    flags, message, started, capsys
):
    with pytest.raises(ValueError, match=message):
        plan_launch(parse_launch(["--nproc", "2", *flags, *HARMLESS]))
    lines = _refused(capsys, ["--nproc", "2", *flags, *HARMLESS])
    assert len(lines) == 1 and message in lines[0] and "e.g. --" in lines[0], lines
    assert not started


@pytest.mark.parametrize(
    ("launch", "job", "message"),
    [
        (["--nproc", "2"], ["--lr", "inf"], "train lr=inf: must be a finite number > 0"),
        (["--nproc", "2"], ["--steps", "0"], "train steps=0: must be a positive integer"),
        (["--nproc", "2"], ["--lr", "abc"], "train --lr abc: not a number"),
        # the processes' mesh spans 2 × 2 devices, not the 8 one train alone would simulate
        (["--nproc", "2", "--devices-per-proc", "2"], ["--mesh", "data=8"], "≠ 4 devices"),
        (["--nproc", "2"], ["--model", "mlp", "--gpt.n-layers", "2"], "train --gpt.n-layers"),
        # an axis within a process (fsdp) cannot span the 2 processes
        (
            ["--nproc", "2"],
            ["--mesh", "fsdp=8", "--strategy", "fsdp"],
            "train mesh fsdp=8 cannot be laid out on 2 processes × 4 devices",
        ),
        # the run check, on the abstract model and the whole job's mesh
        (["--nproc", "2"], ["--mesh", "data=8", "--data.batch-size", "12"], "multiple of 8"),
    ],
)
def test_a_refused_train_job_is_reported_once_and_starts_nothing(
    launch, job, message, started, capsys, monkeypatch, tmp_path
):
    monkeypatch.chdir(tmp_path)
    lines = _refused(capsys, [*launch, "--", "train", *job])
    assert len(lines) == 1 and message in lines[0], lines
    assert not started


def test_every_line_of_a_refused_job_names_train(started, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    lines = _refused(capsys, ["--nproc", "2", "--", "train", "--gpt.n-heads", "3"])
    assert len(lines) == 2 and all(": error: train gpt." in line for line in lines), lines
    assert not started


def test_a_job_that_passes_is_started_as_checked(started, capsys, monkeypatch, tmp_path):
    """The check uses the job's devices: 2 processes × 4 make the mesh of 8 it asks for."""
    monkeypatch.chdir(tmp_path)
    argv = ["launch", "--nproc", "2", "--", "train", "--mesh", "data=8", "--steps", "3"]
    assert cli.main(argv) == 0, capsys.readouterr()
    [command] = started
    assert command[3:] == ["train", "--devices", "4", "--mesh", "data=8", "--steps", "3"]


def test_the_console_command_refuses_a_job_before_starting_a_process(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "meshtrain.cli", "launch", "--nproc", "2", "--", "train",
         "--lr", "inf"], cwd=tmp_path, env=USER_ENV, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("meshtrain")]
    assert lines == [
        "meshtrain launch: error: train lr=inf: must be a finite number > 0 (the learning rate); "
        "e.g. --lr 3e-3"
    ], done.stderr
    assert "[p0]" not in done.stdout and "[launch]" not in done.stdout, done.stdout
