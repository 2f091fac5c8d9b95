"""Runs that heal themselves, on real processes (2 × 4 simulated CPU devices, loopback).

The multi-process tests share `benchmarks/soak.py`'s job and its functions: the tiny GPT, here
for 12 steps with a checkpoint every 2 (the soak's 40 and 4 give the faults no more to show).
Each compares a healed run's losses with one uninterrupted run's, step by step (a re-run step's
last value), bit for bit. Faults come from
``tests/_faults/sitecustomize.py`` (a host that is gone; a hang on SIGUSR1).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _helpers import load_benchmark

from meshtrain import cli
from meshtrain.cli.launch import parse as parse_launch
from meshtrain.distributed import with_collective_timeout
from meshtrain.launch import plan
from meshtrain.launch.resize import CannotResize, resized
from meshtrain.train import events
from meshtrain.train.hooks import StopSignals
from meshtrain.train.stopping import AgreedStop
from meshtrain.train.watchdog import HANG_EXIT, PEER_WAIT_S, Watchdog

ROOT = Path(__file__).resolve().parents[1]
soak = load_benchmark("soak")  # the soak's job and functions
# Every fault lands after a first commit (step 2) with steps left to run. A launch costs far
# more than its steps (each process starts Python, joins, traces, compiles: process 1 always,
# since only process 0 writes the compilation cache), so a test heals several faults in one run
# where the proof allows.
soak.STEPS, soak.SAVE_EVERY = 12, 2

FAULTS = str(ROOT / "tests" / "_faults")
# Seconds past a watchdog's bound: its check interval, the wait for its peers' stacks and its
# exit.
BOUND_SLACK = 4.0 + PEER_WAIT_S


def _faults_env(**extra: str) -> dict[str, str]:
    """PYTHONPATH with the fault injector first, plus `extra`."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{FAULTS}{os.pathsep}{path}" if path else FAULTS, **extra}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("resilience")


@pytest.fixture(scope="module")
def uninterrupted(base):
    """The uninterrupted 2-process run's losses."""
    return soak.reference(base)


# The tests that compare with the uninterrupted run: on one worker, which runs it once.
shares_the_reference = pytest.mark.xdist_group("resilience")


# ---------------------------------------------------------------- multi-process, restarts


def _logged(run_dir: Path) -> int:
    """The lines of a run's metrics.jsonl: its steps so far, before any restart."""
    try:
        return (run_dir / "metrics.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


@pytest.mark.slow
@shares_the_reference
def test_killed_process_restarts_and_matches_the_uninterrupted_run(base, uninterrupted):
    """The crash soak's two kinds of trial, in one run healed twice: one of the 2 processes
    SIGKILLed at a random moment, then, once the restarted job has committed a step of its own,
    one SIGKILLed the moment a save is being written.

    The random moment is up to 0.2 s after a step drawn from 3 to 5: counted in steps, not
    seconds, so that both kills come before the job ends however fast its steps run."""
    rng = random.Random()
    run_dir = base / "killed"
    proc = soak.launch(run_dir, "--max-restarts", "2", "--restart-delay", "0")
    kills = []  # (victim, the steps committed when it was killed, whether a save was cut)
    try:
        soak.wait_for(lambda: soak.committed(run_dir), 180, "a first checkpoint", proc)
        at = rng.randint(3, 5)
        soak.wait_for(lambda: _logged(run_dir) >= at, 60, f"step {at}", proc)
        time.sleep(rng.uniform(0.0, 0.2))
        victim, kept = rng.randrange(2), soak.committed(run_dir)
        os.kill(soak.child(proc, victim), signal.SIGKILL)
        kills.append((victim, kept, soak.saving(run_dir)))
        # The restart's first step is logged with its record; a save seen after a newer
        # commit is the restarted job's (not the temporary directory the kill left behind).
        soak.wait_for(lambda: soak.restarts(run_dir), 180, "the first restart", proc)
        resumed = soak.restarts(run_dir)[0]["resumed"]
        soak.wait_for(lambda: soak.committed(run_dir)[-1] > resumed, 60, "a new commit", proc)
        soak.wait_for(lambda: soak.saving(run_dir), 60, "a save in progress", proc)
        victim, kept = rng.randrange(2), soak.committed(run_dir)
        os.kill(soak.child(proc, victim), signal.SIGKILL)
        kills.append((victim, kept, soak.saving(run_dir)))
    finally:
        out = soak.finish(proc)
    assert proc.returncode == 0, out[-4000:]
    records = soak.restarts(run_dir)
    assert len(records) == 2, (records, out[-3000:])
    for record, (victim, kept, _) in zip(records, kills, strict=True):
        assert record["cause"] == f"process {victim}: killed by SIGKILL", record
        # no step lost beyond the uncommitted ones: the newest committed step was resumed
        assert record["resumed"] == record["committed"] >= kept[-1], (record, kept)
        assert record["seconds_to_first_step"] <= 60, record
    got = soak.losses(run_dir)
    bad = [s for s in uninterrupted if got.get(s) != uninterrupted[s]]
    assert sorted(got) == sorted(uninterrupted) and not bad, f"losses differ at steps {bad}"
    print(records, kills)


def _stopped_after(out: str, why: str) -> int:
    """The step every process stopped after and saved, as the launcher and process 0 said."""
    line = [x for x in out.splitlines() if x.startswith("[launch] all 2 processes stopped")]
    assert len(line) == 1, out[-3000:]
    step = int(line[0].split("after step ")[1].split()[0])
    assert f"[p0] meshtrain: {why}: stopped after step {step}" in out, out[-3000:]
    return step


@pytest.mark.slow
@shares_the_reference
def test_hung_process_is_ended_by_its_watchdog_then_sigterm_stops_the_restarted_job(
    base, uninterrupted
):
    """Process 1 hangs: a watchdog ends it and the launcher restarts the job. Then SIGTERM to
    process 1 alone stops the restarted job (both processes save the step process 1
    proposed, and the launcher exits 0: a stop is not a failure); ``--resume`` finishes it
    with the uninterrupted run's losses."""
    floor = 6.0
    run_dir = base / "hang"
    job = ["--hang-floor-s", str(floor)]
    proc = soak.launch(
        run_dir, "--max-restarts", "1", "--restart-delay", "0", job=job, extra_env=_faults_env()
    )
    try:
        soak.wait_for(lambda: soak.committed(run_dir), 180, "a first checkpoint", proc)
        os.kill(soak.child(proc, 1), signal.SIGUSR1)
        hung_at = time.time()
        # The restart's record is written once its first step is done: the job runs again.
        soak.wait_for(lambda: soak.restarts(run_dir), 180, "the restart's first step", proc)
        os.kill(soak.child(proc, 1), signal.SIGTERM)
    finally:
        out = soak.finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "[p1] fault: hanging now" in out
    (record,) = soak.restarts(run_dir)  # the hang's; the stop is not a failure
    assert "hung: no step done for" in record["cause"], record
    hung = record["cause"].split(":")[0].removeprefix("process ")  # whichever fired first
    assert record["exit_codes"][hung] == HANG_EXIT, record
    # The watchdog fired within the bound it printed (whole seconds): the floor, unless a
    # loaded machine made 20 median steps longer.
    said = [x for x in out.splitlines() if x.startswith(f"[p{hung}] meshtrain: watchdog: ")]
    assert len(said) == 1, out[-3000:]
    bound = float(said[0].split("(bound ")[1].split(" s = max(")[0])
    assert bound >= floor, said
    took = record["time"] - hung_at
    assert took <= bound + 0.5 + BOUND_SLACK, (took, said, out[-3000:])
    stacks = sorted((run_dir / "hangs").glob("p1-*.txt"))
    assert stacks, sorted((run_dir / "hangs").iterdir())
    text = stacks[0].read_text()
    assert "in _hang" in text and "in fit" in text, text  # hung inside the training loop
    assert record["resumed"] == record["committed"]
    step = _stopped_after(out, "SIGTERM to another process")
    assert record["resumed"] < step < soak.STEPS and soak.committed(run_dir)[-1] == step
    resumed = soak.finish(soak.launch(run_dir, job=[*job, "--resume"]))
    assert f"resumed from {run_dir / 'checkpoints' / str(step)}" in resumed, resumed[-3000:]
    assert soak.losses(run_dir) == uninterrupted


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_process_after_one_saved_step(base):
    """The launcher passes SIGTERM to both processes, so both propose a step and the first
    proposal wins: every process saves the same step, and the launcher exits 0."""
    run_dir = base / "sigterm-launcher"
    proc = soak.launch(run_dir, "--max-restarts", "1")
    try:
        soak.wait_for(lambda: soak.committed(run_dir), 180, "a first checkpoint", proc)
        proc.send_signal(signal.SIGTERM)
    finally:
        out = soak.finish(proc)
    assert proc.returncode == 0, out[-4000:]
    step = _stopped_after(out, "SIGTERM")
    assert step < soak.STEPS and soak.committed(run_dir)[-1] == step
    assert not soak.restarts(run_dir)  # a stop is not a failure


@pytest.mark.slow
@shares_the_reference
def test_a_process_that_cannot_come_back_leaves_the_job_on_one_process(base, uninterrupted):
    run_dir, marker = base / "resize", base / "host-1-gone"
    proc = soak.launch(
        run_dir, "--max-restarts", "3", "--min-nproc", "1", "--restart-delay", "0",
        extra_env=_faults_env(FAULT_GONE_RANK="1", FAULT_GONE_MARKER=str(marker)),
    )  # fmt: skip
    try:
        soak.wait_for(lambda: len(soak.committed(run_dir)) >= 2, 180, "two checkpoints", proc)
        marker.touch()
        os.kill(soak.child(proc, 1), signal.SIGKILL)
    finally:
        out = soak.finish(proc)
    assert proc.returncode == 0, out[-4000:]
    assert out.count("[p1] fault: the host of process 1 is gone") == 2, out[-3000:]
    assert (
        "[launch] process 1 failed 2 starts in a row: its host is taken as gone; continuing on "
        "1 process(es): mesh data=2,tensor=2, 2 accumulation steps (the same global batch)"
    ) in out, out[-3000:]
    records = soak.restarts(run_dir)
    assert len(records) == 3 and records[-1]["nproc"] == 1, records
    resumed = records[-1]["resumed"]
    assert resumed == records[0]["committed"]  # nothing was saved while process 1 was gone
    got = soak.losses(run_dir)
    # A fresh 1-process resume from that checkpoint, with the resized job, logs the same.
    fresh = base / "resize-fresh"
    (fresh / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / str(resumed), fresh / "checkpoints" / str(resumed))
    single = subprocess.run(
        [sys.executable, "-m", "meshtrain.cli", "train", "--devices", "4", *soak.train_flags(),
         "--mesh", "data=2,tensor=2", "--accum-steps", "2", "--run-dir", str(fresh), "--resume"],
        cwd=ROOT, env=soak.env(), capture_output=True, text=True, timeout=soak.TIMEOUT,
    )  # fmt: skip
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    want = soak.losses(fresh)
    after = range(resumed + 1, soak.STEPS + 1)
    assert sorted(want) == list(after)
    assert [got[s] for s in after] == [want[s] for s in after]
    # The same global batch: the loss curve goes on as the 2-process run's would have
    # (only the order of the sums differs).
    np.testing.assert_allclose(
        [got[s] for s in after], [uninterrupted[s] for s in after], rtol=1e-4
    )


# ---------------------------------------------------------------- the launcher, no jax


def _launch_script(script: str, *flags: str, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-m", "meshtrain.cli", "launch", "--nproc", "2", *flags, "--",
         sys.executable, "-c", script],
        cwd=ROOT, env=soak.env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_restarts_exhausted_end_with_one_line_and_the_failure_status():
    script = (
        "import os, sys, time\n"
        "r = os.environ['MESHTRAIN_PROCESS_ID']\n"
        "print('start', os.environ['MESHTRAIN_RESTART'], flush=True)\n"
        "if r == '1':\n    time.sleep(0.3); sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    done = _launch_script(script, "--max-restarts", "1", "--restart-delay", "0")
    assert done.returncode == 3, done.stdout
    assert "[p1] start 0" in done.stdout and "[p1] start 1" in done.stdout
    assert "[launch] restart 1 of 1 on 2 process(es) in 0 s, from the start" in done.stdout
    last = done.stdout.strip().splitlines()[-1]
    assert last == (
        "[launch] restarts exhausted (1 of 1 used); giving up with exit code 3; no checkpoint "
        "was committed"
    ), done.stdout
    assert time.monotonic() - start < 60


def test_a_refused_job_is_not_restarted():
    done = _launch_script("import sys; sys.exit(2)", "--max-restarts", "3")
    assert done.returncode == 2, done.stdout
    assert "refused the job (exit code 2): not restarting" in done.stdout
    assert "restart 1" not in done.stdout


def test_a_script_whose_process_keeps_failing_at_start_goes_on_with_fewer():
    script = (
        "import os, sys, time\n"
        "r, n = os.environ['MESHTRAIN_PROCESS_ID'], os.environ['MESHTRAIN_NUM_PROCESSES']\n"
        "if r == '1':\n    sys.exit(1)\n"
        "if n == '2':\n    time.sleep(60)\n"
        "print('alone:', n, 'process', flush=True)\n"
    )
    done = _launch_script(script, "--max-restarts", "3", "--min-nproc", "1", "--restart-delay", "0")
    assert done.returncode == 0, done.stdout
    assert "continuing on 1 process(es)\n" in done.stdout
    assert "[p0] alone: 1 process" in done.stdout
    no_room = _launch_script(script, "--max-restarts", "3", "--restart-delay", "0")
    assert no_room.returncode == 1, no_room.stdout
    assert "--min-nproc 2 allows no fewer than 2 processes: giving up" in no_room.stdout


def test_ctrl_c_to_the_launcher_stops_every_process():
    script = "import time; print('up', flush=True); time.sleep(120)"
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshtrain.cli", "launch", "--nproc", "2", "--max-restarts", "2",
         "--grace", "1", "--", sys.executable, "-c", script],
        cwd=ROOT, env=soak.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    children = [soak.child(proc, r) for r in range(2)]
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "[launch] interrupted; stopping all processes" in out
    for pid in children:  # none is left behind (gone, or a zombie awaiting its parent)
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_launch_settings_are_checked_before_anything_starts():
    for flags, message in [
        (["--max-restarts", "-1"], "launch --max-restarts -1: must be ≥ 0"),
        (["--min-nproc", "3"], "launch --min-nproc 3: must be between 1 and --nproc 2"),
        (["--min-nproc", "1"], "launch --min-nproc 1 needs restarts"),
        (["--max-restarts", "1", "--restart-delay", "-1"], "--restart-delay -1.0: must be ≥ 0"),
    ]:
        settings = parse_launch(["--nproc", "2", *flags, "--", "train"])
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            plan(settings)
    done = subprocess.run(
        [sys.executable, "-m", "meshtrain.cli", "launch", "--nproc", "2", "--min-nproc", "1",
         "--", "train"], cwd=ROOT, env=soak.env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "needs restarts" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


# ---------------------------------------------------------------- in-process units


@pytest.mark.parametrize(
    "mesh, nproc, to, devices, accum, want",
    [
        ("data=4,tensor=2", 2, 1, 4, 1, ("data=2,tensor=2", 2)),
        ("data=2,fsdp=2,tensor=2", 2, 1, 4, 1, ("fsdp=2,tensor=2", 2)),  # data first
        ("data=2,fsdp=4", 4, 1, 2, 2, ("fsdp=2", 8)),  # then fsdp
        ("pipe=2,data=-1", 4, 2, 2, 1, ("pipe=2,data=2", 2)),  # a fill axis, resolved
    ],
)
def test_resize_shrinks_the_batch_axes_and_keeps_the_global_batch(
    mesh, nproc, to, devices, accum, want
):
    job = cli.parse(["train", "--mesh", mesh, "--accum-steps", str(accum), "--data.batch-size",
                     "16"])  # fmt: skip
    assert resized(job, nproc, to, devices) == want


@pytest.mark.parametrize(
    "mesh, nproc, to, batch, extra, message",
    [
        ("pipe=2,tensor=4", 2, 1, 16, [], "only the batch axes shrink"),
        ("data=8", 3, 2, 16, [], "not a whole factor"),
        ("data=8", 2, 1, 12, [], "global batch 12 does not split into 2 microbatches"),
        ("data=8", 2, 1, 16, ["--sync-every", "4"], r"keeps each replica's parameters"),
        ("data=8", 2, 1, 16, ["--grad-compression", "int8"], "error-feedback residuals"),
        ("data=8", 2, 1, 16, ["--staleness", "1"], "the gradients still in flight"),
    ],
)
def test_resize_refuses_what_it_cannot_keep(mesh, nproc, to, batch, extra, message):
    job = cli.parse(["train", "--mesh", mesh, "--data.batch-size", str(batch), *extra])
    with pytest.raises(CannotResize, match=message):
        resized(job, nproc, to, 8 // nproc)


def test_resize_command_prints_the_flags_and_refuses_in_one_line(capsys):
    from meshtrain.cli.resize import main as resize_main

    flags = ["--mesh", "data=2,fsdp=2,tensor=2", "--data.batch-size", "16"]
    assert resize_main(["--nproc", "2", "--to", "1", "--devices-per-proc", "4", "--", *flags]) == 0
    job = cli.parse(["train", *flags, *capsys.readouterr().out.split()])
    assert (job.mesh, job.train.accum_steps) == ("fsdp=2,tensor=2", 2)
    bad = ["--nproc", "2", "--to", "1", "--devices-per-proc", "4", "--", "--mesh", "pipe=8"]
    assert resize_main(bad) == 2
    err = capsys.readouterr().err.strip()
    assert "only the batch axes shrink" in err and len(err.splitlines()) == 1


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_watchdog_bound_arming_suspension_and_dump(tmp_path):
    clock, exits = _Clock(), []
    dog = Watchdog(10.0, 3.0, run_dir=str(tmp_path), rank=1, clock=clock, exit=exits.append)
    clock.now += 1000  # the first step compiles: not armed before it completes
    assert not dog.check()
    for step in range(1, 6):
        dog.step_done(step)
        clock.now += 0.5  # a median step of 0.5 s: the bound is max(10 × 0.5, 3) = 5 s
    assert dog.bound() == pytest.approx(5.0)
    dog.step_done(6)
    with dog.suspended():
        clock.now += 60  # a first evaluation: not timed
        assert not dog.check()
    clock.now += 4.9
    assert not dog.check() and not exits
    clock.now += 0.2
    assert dog.check() and exits == [HANG_EXIT]
    text = (tmp_path / "hangs" / "p1-step6.txt").read_text()
    assert text.startswith("process 1: no step completed for 5.1 s after step 6 (bound 5.0 s)")
    assert "test_watchdog_bound_arming_suspension_and_dump" in text  # this thread's stack
    assert Watchdog(20, 0).enabled is False


def test_watchdog_answers_the_launchers_request_for_stacks(tmp_path, monkeypatch):
    monkeypatch.setenv(events.EVENTS_VAR, str(tmp_path / "events.jsonl"))
    dog = Watchdog(10.0, 3.0, run_dir=str(tmp_path), rank=0, exit=pytest.fail)
    dog.step_done(7)
    assert not dog.answer_request()
    Path(events.dump_request()).touch()
    assert dog.answer_request() and not dog.answer_request()  # once
    (event,) = events.read(tmp_path / "events.jsonl")
    assert event["event"] == "stacks" and event["rank"] == 0 and event["step"] == 7
    assert "asked after another process hung" in Path(event["stacks"]).read_text()


@pytest.mark.parametrize("peer_answers", [True, False], ids=["peer-answers", "peer-silent"])
def test_a_firing_watchdog_asks_its_peers_for_stacks_before_it_exits(
    tmp_path, monkeypatch, peer_answers
):
    """Process 0's exit can end its peers' runtime: their stacks are asked for first."""
    monkeypatch.setenv(events.EVENTS_VAR, str(tmp_path / "events.jsonl"))
    clock, exits = _Clock(), []
    dog = Watchdog(10.0, 3.0, run_dir=str(tmp_path), rank=0, processes=2, clock=clock,
                   exit=exits.append)  # fmt: skip
    peer = Watchdog(10.0, 3.0, run_dir=str(tmp_path), rank=1, exit=pytest.fail)
    peer.step_done(5)

    def answer():  # the peer's watchdog thread, polling
        while not exits:
            if peer_answers and peer.answer_request():
                return
            time.sleep(0.02)

    thread = threading.Thread(target=answer)
    thread.start()
    dog.step_done(5)
    clock.now += 3.5
    started = time.monotonic()
    assert dog.check() and exits == [HANG_EXIT]
    waited = time.monotonic() - started
    thread.join()
    kinds = [(e["event"], e["rank"]) for e in events.read(tmp_path / "events.jsonl")]
    if peer_answers:
        assert kinds == [("hang", 0), ("stacks", 1)] and waited < PEER_WAIT_S, (kinds, waited)
        assert (tmp_path / "hangs" / "p1-step5-asked.txt").exists()
    else:
        assert kinds == [("hang", 0)] and waited >= PEER_WAIT_S, (kinds, waited)
    assert not dog.answer_request()  # its own stacks are written already


def test_events_round_trip_and_a_partial_line_waits(tmp_path, monkeypatch):
    path = tmp_path / "events.jsonl"
    events.report("start", step=3)  # no MESHTRAIN_EVENTS: nothing written
    assert not path.exists()
    monkeypatch.setenv(events.EVENTS_VAR, str(path))
    events.report("start", step=3, run_dir="r")
    events.report("first_step", step=4)
    with open(path, "a") as f:
        f.write('{"event": "hang"')  # still being written
    got = events.read(path)
    assert [(e["event"], e["step"]) for e in got] == [("start", 3), ("first_step", 4)]
    assert events.read(path, skip=1)[0]["event"] == "first_step"
    monkeypatch.setenv(events.RESTART_VAR, "2")
    assert events.restart_count() == 2


def test_a_single_process_stops_after_its_current_step():
    with StopSignals() as signals:
        stop = AgreedStop(signals)
        assert stop.poll(5) is None
        signals.received = "SIGTERM"
        assert stop.poll(6) == 6 and stop.poll(7) == 6 and stop.reason == "SIGTERM"


def test_collective_timeout_flags_are_added_unless_given():
    assert with_collective_timeout("--a=1", 30).split() == [
        "--a=1",
        "--xla_cpu_collective_timeout_seconds=30",
        "--xla_gpu_nccl_termination_timeout_seconds=30",
    ]
    given = "--xla_cpu_collective_timeout_seconds=5"
    assert with_collective_timeout(given, 30).split()[0] == given
    assert with_collective_timeout(given, 30).count("xla_cpu_collective_timeout") == 1
