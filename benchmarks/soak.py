"""Multi-process crash soak: kill one of 2 processes at a random moment, let ``meshtrain launch
--max-restarts`` restart the job, and check that it resumed the newest committed step and
finished with the losses of an uninterrupted run.

Each trial launches the tiny GPT on 2 processes × 4 simulated CPU devices (``data=4,tensor=2``,
a checkpoint every 4 steps), waits for a first checkpoint, then SIGKILLs process 0 or 1 (drawn
at random): a quarter of the trials the moment a save is being written, the rest after a
random delay. The trial passes when

- the launcher restarted once and the job finished (exit 0);
- the restart resumed exactly the newest step committed when the processes were stopped, so
  no step was lost beyond the uncommitted ones;
- the finished run's losses, step by step (a re-run step's last value), equal the
  uninterrupted run's bit for bit.

Prints one JSON line: trials, passes, kills mid-save, steps lost, the median and max seconds
from the death to the first resumed step.

    python benchmarks/soak.py              # 50 trials, about 30 minutes on a 2-core CPU
    python benchmarks/soak.py --trials 4   # a quick check

The test suite runs two trials (tests/test_resilience.py) with these functions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The job's length and checkpoint interval, read whenever a job starts: the test suite sets
# shorter ones on its own copy of this module.
STEPS, SAVE_EVERY = 40, 4
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
TIMEOUT = 300  # seconds any one launch may take


def train_flags() -> list[str]:
    """The ``meshtrain train`` flags of the job: `STEPS` steps, a checkpoint every `SAVE_EVERY`."""
    return [
        "--gpt.d-model", "32", "--gpt.n-layers", "2", "--gpt.max-seq-len", "16",
        "--data.source", "synthetic", "--data.seq-len", "16", "--data.batch-size", "8",
        "--data.val-fraction", "0", "--sample-tokens", "0", "--no-progress",
        "--mesh", "data=4,tensor=2", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
        "--keep-last", "100", "--log-every", "1", "--eval-every", "0",
    ]  # fmt: skip


def env(**extra: str) -> dict[str, str]:
    """This environment without MESHTRAIN_* variables, with cheap compiles, plus `extra`."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("MESHTRAIN_")}
    flags = f"{out.get('XLA_FLAGS', '')} {FAST_COMPILE}".split()
    out["XLA_FLAGS"] = " ".join(dict.fromkeys(flags))  # each once (a compilation-cache key)
    out["JAX_PLATFORMS"] = "cpu"
    out.update(extra)
    return out


def launch(run_dir: Path, *flags: str, job=(), extra_env=None) -> subprocess.Popen:
    """Starts ``meshtrain launch --nproc 2 --devices-per-proc 4 FLAGS -- train`` with the job's
    flags (`train_flags`), then `job`; its output goes to ``<run_dir>.log``."""
    log = open(f"{run_dir}.log", "w")  # noqa: SIM115 - closed by `finish`
    argv = [sys.executable, "-m", "meshtrain.cli", "launch", "--nproc", "2",
            "--devices-per-proc", "4", *flags, "--", "train", *train_flags(), *job,
            "--run-dir", str(run_dir)]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env(**(extra_env or {})), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    proc.log = log
    return proc


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT) -> str:
    """Waits for a launch (killing it past `timeout`); returns its output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        proc.log.close()
    return Path(proc.log.name).read_text()


def child(launcher: subprocess.Popen, rank: int, timeout: float = 60) -> int:
    """The pid of process `rank` among the launcher's children."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                environ = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == launcher.pid and f"MESHTRAIN_PROCESS_ID={rank}".encode() in environ:
                return int(entry.name)
        time.sleep(0.1)
    raise TimeoutError(f"no process {rank} under launcher {launcher.pid}")


def committed(run_dir: Path) -> list[int]:
    """The committed checkpoint steps of a run."""
    directory = Path(run_dir) / "checkpoints"
    names = [p.name for p in directory.iterdir()] if directory.exists() else []
    return sorted(int(n) for n in names if n.isdigit())


def saving(run_dir: Path) -> bool:
    """Whether a checkpoint is being written (orbax's temporary directory is there)."""
    directory = Path(run_dir) / "checkpoints"
    try:
        return any("tmp" in p.name for p in directory.iterdir())
    except FileNotFoundError:
        return False


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    """Polls `predicate` every 5 ms until true; fails past `timeout` or if `proc` exits."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the launch ended (status {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def losses(run_dir: Path) -> dict[int, float]:
    """Step → loss from metrics.jsonl; a step logged twice (re-run after a restart) keeps the
    last value."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[row["step"]] = row["loss"]
    return out


def restarts(run_dir: Path) -> list[dict]:
    """The launcher's restart records."""
    path = Path(run_dir) / "restarts.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def reference(base: Path) -> dict[int, float]:
    """The uninterrupted run's losses."""
    run_dir = base / "reference"
    out = finish(launch(run_dir))
    got = losses(run_dir)
    if sorted(got) != list(range(1, STEPS + 1)):
        raise AssertionError(f"the uninterrupted run logged steps {sorted(got)}:\n{out[-3000:]}")
    return got


def trial(base: Path, name: str, want: dict, *, mid_save: bool, victim: int, delay: float):
    """One kill-and-restart trial; returns its record (raises AssertionError on a failure)."""
    run_dir = base / name
    proc = launch(run_dir, "--max-restarts", "2", "--restart-delay", "0")
    try:
        wait_for(lambda: committed(run_dir), 180, "a first checkpoint", proc)
        if mid_save:
            wait_for(lambda: saving(run_dir), 60, "a save in progress", proc)
        else:
            time.sleep(delay)
        kept_before = committed(run_dir)
        os.kill(child(proc, victim), signal.SIGKILL)
        interrupted = saving(run_dir)  # a save's temporary directory outlived the kill
    finally:
        out = finish(proc)
    if proc.returncode != 0:
        raise AssertionError(f"{name}: the launch ended with {proc.returncode}:\n{out[-4000:]}")
    (record,) = restarts(run_dir)
    got = losses(run_dir)
    lost = record["committed"] - record["resumed"]
    if record["resumed"] != record["committed"] or record["committed"] < kept_before[-1]:
        raise AssertionError(f"{name}: resumed {record['resumed']}, committed {kept_before}")
    if got != want:
        bad = [s for s in want if got.get(s) != want[s]][:5]
        raise AssertionError(f"{name}: losses differ from the uninterrupted run at steps {bad}")
    return {
        "trial": name,
        "victim": victim,
        "mid_save": mid_save,
        "interrupted_a_save": interrupted,
        "committed": record["committed"],
        "resumed": record["resumed"],
        "steps_lost": lost,
        "seconds_to_first_step": record["seconds_to_first_step"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        base = Path(tmp)
        want = reference(base)
        records, failures = [], []
        for i in range(args.trials):
            mid_save = i % 4 == 3
            victim, delay = rng.randrange(2), rng.uniform(0.0, 1.5)
            try:
                record = trial(base, f"t{i}", want, mid_save=mid_save, victim=victim, delay=delay)
                records.append(record)
            except AssertionError as e:
                record = {"trial": f"t{i}", "failure": str(e)[:500]}
                failures.append(record["failure"])
            print(json.dumps(record), file=sys.stderr, flush=True)
    seconds = [r["seconds_to_first_step"] for r in records]
    print(
        json.dumps(
            {
                "benchmark": "soak",
                "date": date.today().isoformat(),
                "device": "CPU, 2 processes × 4 simulated devices, loopback",
                "jax_version": version("jax"),
                "command": f"python benchmarks/soak.py --trials {args.trials} --seed {args.seed}",
                "trials": args.trials,
                "passed": len(records),
                "failures": failures,
                "victims": [sum(r["victim"] == v for r in records) for v in (0, 1)],
                "killed_mid_save": sum(r["mid_save"] for r in records),
                "saves_interrupted": sum(r["interrupted_a_save"] for r in records),
                "steps_lost_beyond_uncommitted": sum(r["steps_lost"] for r in records),
                "seconds_to_first_step_median": statistics.median(seconds) if seconds else None,
                "seconds_to_first_step_max": max(seconds) if seconds else None,
                "wall_s": round(time.monotonic() - start),
            }
        )
    )


if __name__ == "__main__":
    main()
