"""A stop signal while a peer is gone: the process says so and exits at once with
`PEER_GONE_EXIT`, instead of waiting for the distributed heartbeat. A live job still stops
after one agreed step, saves it and exits 0.

The job is the tiny GPT of `test_distributed`, 2 processes × 2 CPU devices on loopback,
started by hand (as ``srun`` starts them), with a heartbeat timeout far longer than the bound
asserted, so that the heartbeat cannot be what ends a process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from test_distributed import RUN_TIMEOUT, TINY_TRAIN, _start

from meshtrain.checkpoint.dirs import saved_steps
from meshtrain.distributed import free_port
from meshtrain.train import stopping
from meshtrain.train.hooks import StopSignals
from meshtrain.train.stopping import PEER_GONE_EXIT, AgreedStop, RollCall

HEARTBEAT_S = 120  # far past every bound below
EXIT_BOUND_S = 10.0  # from SIGTERM to exit when a peer is gone: the roll's wait, plus slack
JOB = [*(a for a in TINY_TRAIN if a != "--no-save"), "--mesh", "data=4", "--strategy", "dp",
       "--steps", "100000", "--log-every", "1", "--eval-every", "0", "--save-every", "25",
       "--hang-floor-s", "0"]  # fmt: skip


def _job(tmp_path: Path) -> tuple[list[subprocess.Popen], Path]:
    """Starts the 2 processes; returns them, and the run directory, once a checkpoint is
    committed (the next save is 25 steps away: a peer lost during a save makes the save's
    gloo exchange fail instead, which this does not test)."""
    port, run_dir = free_port(), tmp_path / "run"
    args = [*JOB, "--run-dir", str(run_dir)]
    # No compilation cache: an executable with collectives read back from it can hang gloo.
    env = {"MESHTRAIN_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S), "JAX_ENABLE_COMPILATION_CACHE": "0"}
    procs = [_start(r, 2, port, args, tmp_path / f"p{r}.log", **env) for r in range(2)]
    deadline = time.monotonic() + RUN_TIMEOUT
    metrics = run_dir / "metrics.jsonl"
    while not (saved_steps(run_dir / "checkpoints") and _lines(metrics) >= 2):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            _end(procs)
            pytest.fail(f"training never got going:\n{(tmp_path / 'p0.log').read_text()[-3000:]}")
        time.sleep(0.1)
    return procs, run_dir


def _lines(path: Path) -> int:
    """The lines of `path` so far (0 before it exists)."""
    return path.read_text().count("\n") if path.exists() else 0


def _end(procs: list[subprocess.Popen]) -> None:
    """Kills whatever still runs."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.mark.slow
def test_sigterm_while_a_peer_is_gone_exits_at_once_saying_so(tmp_path):
    """SIGKILL process 1, then SIGTERM process 0 (what ``srun --kill-on-bad-exit`` does):
    process 0 names process 1, says nothing was saved, names the newest committed checkpoint
    and exits with `PEER_GONE_EXIT` within seconds, long before the heartbeat would end it."""
    procs, run_dir = _job(tmp_path)
    try:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        procs[0].send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        try:
            code = procs[0].wait(timeout=HEARTBEAT_S / 2)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process 0 still running {HEARTBEAT_S / 2} s after its SIGTERM")
        took = time.monotonic() - signalled
    finally:
        _end(procs)
    log = (tmp_path / "p0.log").read_text()
    assert code == PEER_GONE_EXIT, log[-3000:]
    lines = [x for x in log.splitlines() if x.startswith("meshtrain: SIGTERM: ")]
    newest = saved_steps(run_dir / "checkpoints")[-1]
    assert len(lines) == 1, log[-3000:]
    assert "process 1 is gone" in lines[0] and "nothing was saved" in lines[0], lines
    assert f"newest committed checkpoint: step {newest} " in lines[0], (lines, newest)
    assert f"exiting with status {PEER_GONE_EXIT}" in lines[0], lines
    # The roll may start a moment before the signal: gloo fails the step at once when its
    # peer dies, and the failed step calls the roll too.
    assert took < EXIT_BOUND_S, (took, log[-3000:])
    print(f"process 0 exited {took:.1f} s after its SIGTERM, process 1 gone")


@pytest.mark.slow
def test_sigterm_to_one_process_of_a_live_job_still_stops_both_after_a_saved_step(tmp_path):
    """Only process 1 gets SIGTERM; process 0 answers the roll from its own thread, so both
    stop after the same agreed step, save it and exit 0."""
    procs, run_dir = _job(tmp_path)
    try:
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        _end(procs)
    logs = [(tmp_path / f"p{r}.log").read_text() for r in range(2)]
    assert codes == [0, 0], [log[-2000:] for log in logs]
    step = saved_steps(run_dir / "checkpoints")[-1]
    assert f"meshtrain: SIGTERM to another process: stopped after step {step};" in logs[0]
    assert "is gone" not in logs[0] + logs[1]


class _Store:
    """The key-value calls `RollCall` makes, in memory (one store shared by fake processes)."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self.changed:
            if key in self.values:
                raise _jax_error(f"ALREADY_EXISTS: {key}")
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise _jax_error(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        with self.changed:
            return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def _jax_error(text: str) -> Exception:
    import jax

    return jax.errors.JaxRuntimeError(text)


def test_the_roll_names_exactly_the_processes_that_do_not_answer():
    """Processes 0, 1 and 3 of 4 answer from their threads; 2 never started: the roll names 2
    after its wait, and ends with no thread left waiting."""
    store = _Store()
    rolls = [RollCall(store, "roll/", r, 4) for r in range(4)]
    for r in (0, 1, 3):
        rolls[r].start()
    start = time.monotonic()
    assert rolls[0].call(0.5) == [2]
    assert 0.5 <= time.monotonic() - start < 3
    store.values["roll/here/2"] = "1"  # a late answer counts on the next call
    assert rolls[3].call(0.5) == []
    for r in (0, 1, 3):
        rolls[r].close()
        assert rolls[r]._thread is None
    assert all(t.name != "meshtrain-roll" for t in threading.enumerate())


@pytest.mark.parametrize("peer_answers", [False, True])
def test_a_step_that_fails_while_a_peer_is_gone_exits_saying_so(monkeypatch, capsys, peer_answers):
    """A collective error out of a fit of 2 processes calls the roll: with process 1 gone the
    process names it and exits with `PEER_GONE_EXIT`; with process 1 answering, the error
    propagates unchanged."""
    store = _Store()
    monkeypatch.setattr(stopping.jax, "process_count", lambda: 2)
    monkeypatch.setattr(stopping, "jax_distributed_client", lambda: store)
    monkeypatch.setattr(stopping, "ANSWER_S", 0.3)
    exits: list[int] = []
    monkeypatch.setattr(stopping.os, "_exit", exits.append)
    with StopSignals() as signals, pytest.raises(stopping.jax.errors.JaxRuntimeError):
        stop = AgreedStop(signals)
        peer = RollCall(store, f"meshtrain/roll/{stop._fit}/", 1, 2)
        if peer_answers:
            peer.start()
        with stop:
            stop.poll(0)
            stop.poll(1)  # a step completed
            raise _jax_error("INTERNAL: Connection closed by peer [127.0.0.1]:40000")
    peer.close()
    err = capsys.readouterr().err
    if peer_answers:
        assert exits == [] and "is gone" not in err, err
        return
    assert exits == [PEER_GONE_EXIT], err
    assert err.startswith(
        "meshtrain: a step failed (JaxRuntimeError: INTERNAL: Connection closed by peer"
    ), err
    assert "process 1 is gone" in err and f"exiting with status {PEER_GONE_EXIT}" in err, err
