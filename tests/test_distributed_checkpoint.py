"""Checkpoints across process counts: real processes on 127.0.0.1, every run time-bounded.

Six steps of the tiny GPT of `test_distributed` on the mesh data=2 × fsdp=4 with strategy fsdp
(every parameter is sharded over all 8 devices, so each process holds only part of it):

- straight: 1 process × 8 devices trains the 6 steps (``meshtrain train``), saving step 3 too;
- 2 → 1: 2 processes × 4 devices train steps 1-3 of the same 6-step job and save
  (``meshtrain launch``), then 1 process × 8 devices resumes (``meshtrain train --resume``);
- 1 → 2: the reverse, from the straight run's step-3 checkpoint and log, copied to a run
  directory of its own (as if that job had ended there). Before the 2-process resume a damaged
  step 5 is planted: both processes skip it, process 0 sets it aside as ``5.unreadable``, and
  both go on from step 3, saving every step (so step 5 is written afresh next to the one set
  aside).

The resumed runs must log the straight run's losses and end with its parameters, optimizer
state, step and data position, within the fp32 tolerances of `test_distributed` (the process
count changes only the order of cross-device sums).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from _helpers import TINY_JOB
from test_distributed import LOSS_RTOL, PARAM_ATOL, ROOT, _env, _wait

from meshtrain import checkpoint as ckpt
from meshtrain import cli
from meshtrain.layout import rules_for
from meshtrain.mesh import make_mesh
from meshtrain.metrics import read_jsonl
from meshtrain.models import build_model
from meshtrain.optim import make_optimizer
from meshtrain.state import abstract_train_state

pytestmark = [
    pytest.mark.slow,
    # One worker runs the module-scoped `runs` (about 80 s) for all three tests; ungrouped,
    # --dist loadgroup hands tests to both workers and each would start its own runs.
    pytest.mark.xdist_group("distributed_checkpoint"),
]

TIMEOUT = 300  # hard bound on each run, in seconds
MESH, STRATEGY, STEPS, SPLIT = "data=2,fsdp=4", "fsdp", 6, 3
JOB = [
    *TINY_JOB, "--mesh", MESH, "--strategy", STRATEGY, "--steps", str(STEPS), "--log-every", "1",
    "--eval-every", "0", "--save-every", "0",
]  # fmt: skip
# The CLI's job, stopped after step argv[1] of its schedule; fit() saves (and waits) at the end.
STOP_AFTER = (
    "import sys\n"
    "from meshtrain import cli\n"
    "from meshtrain.cli.train import build_trainer\n"
    "trainer = build_trainer(cli.parse(['train', *sys.argv[2:]]))\n"
    "trainer.fit(until=int(sys.argv[1]))\n"
    "trainer.checkpoints.close()\n"
)
# Optimizer moments: relative agreement (AdamW's second moments are ~1e-6 and smaller), with
# each entry also allowed OPT_RTOL of its leaf's largest: a first moment near a cancellation
# (1.7e-6 in a leaf of ~1e-3) differed by 1.8e-4 of itself between process counts.
OPT_RTOL, OPT_ATOL = 1e-4, 1e-10


def _train(nproc: int, run_dir: Path, *extra: str, stop_after: int | None = None):
    """Starts the 6-step job on `nproc` processes × 8 // nproc devices; with `stop_after`, the
    same job stopped and saved after that step."""
    devices = 8 // nproc
    args = ["--devices", str(devices), *JOB, "--run-dir", str(run_dir), *extra]
    if stop_after is None:
        command = ["train", *args]
    else:
        command = [sys.executable, "-c", STOP_AFTER, str(stop_after), *args]
    if nproc == 1:
        argv = [sys.executable, "-m", "meshtrain.cli", *command] if stop_after is None else command
    else:
        argv = [sys.executable, "-m", "meshtrain.cli", "launch", "--nproc", str(nproc),
                "--devices-per-proc", str(devices), "--", *command]  # fmt: skip
    return subprocess.Popen(
        argv, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def _wait_all(procs: dict[str, subprocess.Popen], part: str) -> dict[str, str]:
    """Waits for every run (each bounded by TIMEOUT); kills the rest if one fails."""
    try:
        return {name: _wait(p, f"{name} ({part})", timeout=TIMEOUT) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _files(directory: Path) -> list[str]:
    """Every path under `directory`, relative to it, sorted."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The straight run and the first part of 2 → 1 together, then both resumes."""
    base = tmp_path_factory.mktemp("dist_ckpt")
    start = time.monotonic()
    first = _wait_all(
        {
            "straight 1×8": _train(1, base / "straight", "--save-every", str(SPLIT)),
            "2→1": _train(2, base / "2to1", stop_after=SPLIT),
        },
        "first part",
    )
    # 1 → 2 starts where a 1-process job saved step 3 and ended: the straight run's
    # checkpoint and log of steps 1-3 (one process fewer to start and compile for).
    first["1→2"] = first["straight 1×8"]
    (base / "1to2" / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        base / "straight" / "checkpoints" / str(SPLIT), base / "1to2" / "checkpoints" / str(SPLIT)
    )
    logged = (base / "straight" / "metrics.jsonl").read_text().splitlines(keepends=True)
    (base / "1to2" / "metrics.jsonl").write_text("".join(logged[:SPLIT]))
    halves = {name: _losses(base / name) for name in ("2to1", "1to2")}
    damaged = base / "1to2" / "checkpoints" / "5"  # a newer step whose arrays cannot be read
    shutil.copytree(base / "1to2" / "checkpoints" / str(SPLIT), damaged)
    (damaged / "state" / "manifest.ocdbt").unlink()
    damaged_files = _files(damaged)
    second = _wait_all(
        {
            "2→1": _train(1, base / "2to1", "--resume"),
            "1→2": _train(2, base / "1to2", "--resume", "--save-every", "1"),
        },
        "resume",
    )
    print(f"checkpoint runs across process counts: {time.monotonic() - start:.0f} s wall")
    return base, first, second, halves, damaged_files


@pytest.fixture(scope="module")
def target():
    """The job's abstract train state on data=2 × fsdp=4 of this (8-device) process."""
    job = cli.parse(["train", *JOB])
    mesh = make_mesh(MESH)
    tx = make_optimizer(job.optim, job.train.steps)
    return abstract_train_state(
        lambda: build_model(job.model_config()), tx, mesh, rules_for(STRATEGY, mesh)
    )


@pytest.mark.parametrize(
    ("name", "saved_by", "resumed_by"), [("2to1", 2, 1), ("1to2", 1, 2)], ids=["2to1", "1to2"]
)
def test_resume_on_another_process_count_matches_the_straight_run(
    runs, target, name, saved_by, resumed_by
):
    base, first, second, halves, _ = runs
    directory = base / name / "checkpoints"
    key = "2→1" if name == "2to1" else "1→2"
    log = second[key]
    assert ("[p1] meshtrain: process 1 of 2" in first[key]) == (saved_by == 2), first[key][-3000:]
    prefix = "[p0] " if resumed_by > 1 else ""
    assert f"{prefix}resumed from {directory / str(SPLIT)}\n" in log, log[-3000:]
    assert ("[p1] meshtrain: process 1 of 2" in log) == (resumed_by == 2), log[-3000:]

    # steps 1-3 were logged by the first part (on `saved_by` processes), 4-6 by the resume
    straight, resumed = _losses(base / "straight"), _losses(base / name)
    assert [s for s, _ in resumed] == list(range(1, STEPS + 1)), resumed
    assert resumed[:SPLIT] == halves[name] and len(halves[name]) == SPLIT
    assert [s for s, _ in straight] == list(range(1, STEPS + 1))
    assert straight[-1][1] < straight[0][1]
    np.testing.assert_allclose(
        [v for _, v in resumed], [v for _, v in straight], rtol=LOSS_RTOL, atol=0
    )

    want = ckpt.restore(base / "straight" / "checkpoints", target)
    got = ckpt.restore(directory, target)
    assert got.step == want.step == STEPS and int(got.state.step) == STEPS
    assert got.data == want.data and got.data["grain"]["next_index"] == STEPS
    assert got.meta["rng"] == want.meta["rng"]
    pairs = [(jax.tree.leaves(want.state.params), jax.tree.leaves(got.state.params), PARAM_ATOL, 0)]
    pairs.append(
        (jax.tree.leaves(want.state.opt_state), jax.tree.leaves(got.state.opt_state),
         OPT_ATOL, OPT_RTOL)
    )  # fmt: skip
    worst = {}
    for (a_leaves, b_leaves, atol, rtol), what in zip(pairs, ("params", "opt"), strict=True):
        assert a_leaves and len(a_leaves) == len(b_leaves)
        for a, b in zip(a_leaves, b_leaves, strict=True):
            a, b = np.asarray(a), np.asarray(b)
            leaf_atol = max(atol, rtol * float(np.abs(a).max(initial=0.0)))
            np.testing.assert_allclose(b, a, atol=leaf_atol, rtol=rtol, err_msg=f"{name} {what}")
            worst[what] = max(worst.get(what, 0.0), float(np.abs(a - b).max(initial=0.0)))
    dloss = max(abs(x - y) for (_, x), (_, y) in zip(resumed, straight, strict=True))
    print(
        f"{name}: max |Δloss| {dloss:.1e}, max |Δparam| {worst['params']:.1e}, "
        f"max |Δopt| {worst['opt']:.1e}"
    )


def test_two_processes_set_a_damaged_step_aside_and_resume_before_it(runs):
    base, _, second, _, damaged_files = runs
    log = second["1→2"]
    directory = base / "1to2" / "checkpoints"
    for rank in (0, 1):  # both processes find step 5 unreadable and fall back to the same step
        assert any(
            line.startswith(f"[p{rank}] ")
            and f"checkpoint {directory / '5'} cannot be read" in line
            and f"falling back to step {SPLIT}" in line
            for line in log.splitlines()
        ), log[-4000:]
    # process 0 alone renamed it, once; saving steps 4, 5, 6 (keeping the last 3) wrote a new
    # step 5 beside it and deleted step 3, but left the set-aside step exactly as it was
    assert sorted(p.name for p in directory.iterdir()) == ["4", "5", "5.unreadable", "6"]
    assert _files(directory / "5.unreadable") == damaged_files
    assert "state/manifest.ocdbt" in _files(directory / "5")
    assert f"[p0] checkpoint saved to {directory / '6'}\n" in log, log[-3000:]
