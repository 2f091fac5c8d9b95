"""Where a run writes: a fresh run refuses a directory inside, at or around an earlier run,
and one that is a file or cannot be written; each is one line and exit 2 from the CLI,
before anything compiles, and the earlier run is left byte for byte as it was."""

import hashlib
import os
from pathlib import Path

import pytest

from meshtrain import cli
from meshtrain.checkpoint import CheckpointConfig, directory_problems

# One worker trains the module-scoped earlier run for all of them (under --dist loadgroup).
pytestmark = pytest.mark.xdist_group("run_dirs")

TINY = ["--gpt.d-model", "32", "--gpt.n-layers", "2", "--data.seq-len", "16",
        "--data.batch-size", "16", "--sample-tokens", "0", "--eval-every", "0",
        "--no-progress", "--data.source", "synthetic"]  # fmt: skip


def _digest(root: Path) -> dict[str, str]:
    """Every file under `root` with the hash of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """A real 1-step run with a checkpoint and metrics."""
    root = tmp_path_factory.mktemp("runs")
    run = root / "earlier"
    assert cli.main(["train", *TINY, "--steps", "1", "--run-dir", str(run)]) == 0
    assert (run / "checkpoints" / "1").is_dir() and (run / "metrics.jsonl").is_file()
    return run


def _refused(capsys, argv, *needles):
    code = cli.main(["train", *TINY, "--steps", "1", *argv])
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("meshtrain train: error: "), err
    for needle in needles:
        assert needle in lines[0], err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (lambda run: ["--run-dir", str(run / "checkpoints")], ["is inside the earlier run"]),
        (lambda run: ["--run-dir", str(run / "a" / "b")], ["is inside the earlier run"]),
        (
            lambda run: ["--run-dir", str(run.parent / "new"), "--checkpoint-dir", str(run)],
            ["is an earlier run's directory"],
        ),
        (lambda run: ["--run-dir", str(run.parent)], ["contains the earlier run"]),
        (lambda run: ["--run-dir", str(run)], ["already holds steps [1]", "--resume"]),
        (lambda run: ["--run-dir", str(run / "metrics.jsonl")], ["is a file, not a directory"]),
        (
            lambda run: [
                "--run-dir",
                str(run.parent / "new2"),
                "--checkpoint-dir",
                str(run / "metrics.jsonl" / "ck"),
            ],  # fmt: skip
            ["metrics.jsonl is a file, so it cannot be created"],
        ),
    ],
)
def test_a_fresh_run_refuses_to_write_into_or_around_an_earlier_one(
    capsys, earlier_run, argv, needles
):
    before = _digest(earlier_run.parent)
    _refused(capsys, argv(earlier_run), *needles)
    assert _digest(earlier_run.parent) == before
    assert not (earlier_run / "checkpoints" / "checkpoints").exists()


def test_resuming_the_earlier_run_is_still_allowed(earlier_run):
    problems = directory_problems(
        run_dir=str(earlier_run), checkpoint=CheckpointConfig(resume=True)
    )
    assert problems == []


def test_a_directory_that_cannot_be_written_is_one_line(capsys, tmp_path, monkeypatch):
    """Root may write anywhere, so the permission answer is faked; the message is real."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == locked else real(p, m))
    line = _refused(capsys, ["--run-dir", str(locked / "run")])
    assert f"cannot be created: {locked} is not writable" in line
