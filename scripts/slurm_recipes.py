"""The Scaling out guide's SLURM recipe, run on a real SLURM (the CI stage's checks).

Each recipe submits ``cluster/slurm/train.sbatch`` (the script the guide includes) with the
tiny GPT of ``benchmarks/soak.py`` on 2 tasks × 4 simulated CPU devices, and checks what the
guide promises:

- ``straight``: the job's losses equal ``meshtrain launch --nproc 2``'s bit for bit;
- ``kill``: one task SIGKILLed after a first checkpoint; the next attempt resumes the newest
  committed step within 60 s of the kill and finishes with the uninterrupted run's losses;
- ``term``: ``scancel --signal=TERM`` stops both tasks after one agreed step, which is saved;
  the job ends without requeueing;
- ``time_limit``: the time limit's signal stops the job at an agreed step (when it arrives
  after the first step), the job requeues itself, and the requeued job resumes the newest
  committed step and finishes the run.

Needs a running SLURM (``SLURM_CONF``; ``scripts/ci_slurm.sh`` starts one). Prints one JSON
line; exits 1 when a recipe fails.

    python scripts/slurm_recipes.py --work DIR [--only kill,term]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "cluster" / "slurm" / "train.sbatch"
_SPEC = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(_SPEC)  # the soak's job, launcher and readers
_SPEC.loader.exec_module(soak)
soak.STEPS, soak.SAVE_EVERY = 12, 2
TIMEOUT = 240  # seconds any one job may take
# The time-limit recipe's run: long enough that SLURM's warning signal (sent up to a minute
# early, at the controller's next periodic check) arrives before the run is done.
LONG_STEPS = 1000
# A resized job accumulates two microbatches where each device had one: the same batch,
# summed in another order (float32).
RESIZE_RTOL = 1e-5


class RecipeFailed(AssertionError):
    """A recipe did not do what the guide says."""


def meshtrain_bin() -> str:
    """The meshtrain command of this interpreter's environment."""
    return str(Path(sys.executable).with_name("meshtrain"))


def submit(run_dir: Path, *options: str, flags: list[str], **env: str) -> int:
    """Submits the guide's batch script for a 2-task job; returns the job id."""
    argv = ["sbatch", "--parsable", "--nodes=1", "--ntasks=2", f"--output={run_dir}.out",
            *options, str(SBATCH), str(run_dir), "--devices", "4", *flags]  # fmt: skip
    job_env = soak.env(MESHTRAIN=meshtrain_bin(), MESHTRAIN_RETRY_DELAY="1", **env)
    out = subprocess.run(argv, cwd=ROOT, env=job_env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().split(";")[0])


def job(job_id: int) -> dict[str, str]:
    """The job's fields as ``scontrol show job`` gives them."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_job(job_id: int, on_requeue=None, timeout: float = TIMEOUT) -> dict[str, str]:
    """Polls the job until it ends; calls `on_requeue(job)` once when it was requeued."""
    deadline, requeued = time.monotonic() + timeout, False
    while time.monotonic() < deadline:
        fields = job(job_id)
        if on_requeue and not requeued and int(fields.get("Restarts", 0)) > 0:
            requeued = True
            on_requeue(fields)
        if fields["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return fields
        time.sleep(0.2)
    subprocess.run(["scancel", str(job_id)], check=False)
    raise RecipeFailed(f"job {job_id} did not end within {timeout} s")


def task_pid(job_id: int, rank: int, timeout: float = 60) -> int:
    """The pid of the job's training process `rank`."""
    want = {f"SLURM_JOB_ID={job_id}".encode(), f"MESHTRAIN_PROCESS_ID={rank}".encode()}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                environ = set((entry / "environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if entry.name.isdigit() and want <= environ:
                return int(entry.name)
        time.sleep(0.1)
    raise RecipeFailed(f"no training process {rank} in job {job_id}")


def read_events(run_dir: Path) -> list[dict]:
    """Every event the job's processes wrote, in time order."""
    rows = [json.loads(line) for path in run_dir.glob("events-*.jsonl")
            for line in path.read_text().splitlines()]  # fmt: skip
    return sorted(rows, key=lambda r: r["time"])


def ended_well(run_dir: Path, fields: dict[str, str]) -> str:
    """The job's output; fails unless the job completed with exit 0."""
    out = Path(f"{run_dir}.out").read_text()
    if fields["JobState"] != "COMPLETED" or fields["ExitCode"] != "0:0":
        raise RecipeFailed(
            f"{run_dir.name}: {fields['JobState']} {fields['ExitCode']}:\n{out[-3000:]}"
        )
    return out


def same_losses(name: str, got: dict, want: dict, upto: int | None = None) -> None:
    """Fails unless the losses equal the reference's bit for bit (through step `upto`)."""
    steps = [s for s in want if upto is None or s <= upto]
    bad = [s for s in steps if got.get(s) != want[s]]
    if bad:
        raise RecipeFailed(f"{name}: losses differ from the uninterrupted run at steps {bad[:5]}")


def straight(base: Path, want: dict) -> dict:
    """A 2-task job equals `meshtrain launch --nproc 2`."""
    run_dir = base / "straight"
    ended_well(run_dir, wait_job(submit(run_dir, flags=soak.train_flags())))
    same_losses("straight", soak.losses(run_dir), want)
    return {"steps": len(want)}


def kill(base: Path, want: dict) -> dict:
    """A task SIGKILLed mid-run: the next attempt resumes and finishes the same run."""
    run_dir = base / "kill"
    job_id = submit(run_dir, flags=soak.train_flags())
    soak.wait_for(lambda: soak.committed(run_dir), 120, "a first checkpoint")
    os.kill(task_pid(job_id, 1), signal.SIGKILL)
    killed_at = time.time()
    out = ended_well(run_dir, wait_job(job_id))
    starts = [e for e in read_events(run_dir) if e["event"] == "start"]
    firsts = [
        e for e in read_events(run_dir) if e["event"] == "first_step" and e["time"] > killed_at
    ]
    if len(starts) != 2 or not firsts:
        raise RecipeFailed(
            f"kill: expected one resumed attempt, got starts {starts}:\n{out[-3000:]}"
        )
    resumed = starts[1]["step"]
    newest = max(s for s in soak.committed(run_dir) if s <= resumed)
    if resumed == 0 or resumed != newest:
        raise RecipeFailed(f"kill: resumed step {resumed}, newest committed then {newest}")
    seconds = firsts[0]["time"] - killed_at
    if seconds > 60:
        raise RecipeFailed(f"kill: the first resumed step came {seconds:.0f} s after the kill")
    same_losses("kill", soak.losses(run_dir), want)
    return {"resumed_step": resumed, "kill_to_first_resumed_step_s": round(seconds, 1)}


def term(base: Path, want: dict) -> dict:
    """`scancel --signal=TERM`: one agreed step, saved by both tasks; no requeue."""
    run_dir = base / "term"
    job_id = submit(run_dir, flags=soak.train_flags())
    soak.wait_for(lambda: soak.committed(run_dir), 120, "a first checkpoint")
    subprocess.run(["scancel", "--signal=TERM", str(job_id)], check=True)
    fields = wait_job(job_id)
    out = ended_well(run_dir, fields)
    stops = [e for e in read_events(run_dir) if e["event"] == "stop"]
    steps = {e["step"] for e in stops}
    if len(stops) != 2 or len(steps) != 1 or fields.get("Restarts") != "0":
        raise RecipeFailed(
            f"term: stops {stops}, restarts {fields.get('Restarts')}:\n{out[-3000:]}"
        )
    (step,) = steps
    if step not in soak.committed(run_dir) or "submit again to continue" not in out:
        raise RecipeFailed(f"term: step {step} not saved or not reported:\n{out[-3000:]}")
    same_losses("term", soak.losses(run_dir), want, upto=step)
    return {"stopped_step": step}


def time_limit(base: Path, want: dict) -> dict:
    """The time limit's signal: an agreed stop, a requeue, and the requeued job finishes."""
    run_dir = base / "time_limit"
    flags = soak.train_flags()
    flags[flags.index("--steps") + 1] = str(LONG_STEPS)
    flags[flags.index("--save-every") + 1] = "50"
    flags[flags.index("--log-every") + 1] = "50"
    job_id = submit(run_dir, "--time=1", "--signal=B:USR1@10", flags=flags)
    requeue = {}

    def extend(fields: dict) -> None:
        # The requeued job would wait for its begin time and stop again at the same 1-minute
        # limit: give it room to finish (an administrator's `scontrol update`).
        requeue["committed"] = soak.committed(run_dir)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10", "StartTime=now"],
                       check=True)  # fmt: skip

    out = ended_well(run_dir, wait_job(job_id, on_requeue=extend))
    if "the time limit is near" not in out or not requeue:
        raise RecipeFailed(f"time_limit: no time-limit signal or no requeue:\n{out[-3000:]}")
    events = read_events(run_dir)
    starts = [e for e in events if e["event"] == "start"]
    stops = {e["step"] for e in events if e["event"] == "stop"}
    resumed = starts[-1]["step"]
    newest = max(requeue["committed"], default=0)
    if resumed != newest or (stops and stops != {resumed}):
        raise RecipeFailed(f"time_limit: resumed {resumed}; committed {newest}; stopped at {stops}")
    logged = sorted(soak.losses(run_dir))
    if logged[-1] != LONG_STEPS:
        raise RecipeFailed(f"time_limit: the run ended at step {logged[-1]}:\n{out[-3000:]}")
    return {"stopped_step": min(stops, default=None), "resumed_step": resumed}


def resize(base: Path, want: dict) -> dict:
    """The stopped ``term`` run goes on as 1 task with the flags `meshtrain.cli.resize`
    prints (one node cannot lose a node: the job just asks for fewer tasks)."""
    run_dir = base / "term"
    if not soak.committed(run_dir):
        raise RecipeFailed("resize: needs the term recipe's stopped run; run term first")
    stopped = max(soak.committed(run_dir))
    flags = soak.train_flags()
    extra = subprocess.run(
        [sys.executable, "-m", "meshtrain.cli.resize", "--nproc", "2", "--to", "1",
         "--devices-per-proc", "4", "--", *flags],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout.split()  # fmt: skip
    job_id = submit(run_dir, "--ntasks=1", flags=[*flags, *extra])
    ended_well(run_dir, wait_job(job_id))
    got = soak.losses(run_dir)
    same_losses("resize", got, want, upto=stopped)
    later = [s for s in want if s > stopped]
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in later)
    if sorted(got) != sorted(want) or worst > RESIZE_RTOL:
        raise RecipeFailed(f"resize: steps {sorted(got)}; worst relative loss change {worst:.2e}")
    return {"flags": " ".join(extra), "resumed_step": stopped, "max_rel_loss_diff": worst}


RECIPES = {
    "straight": straight,
    "kill": kill,
    "term": term,
    "resize": resize,
    "time_limit": time_limit,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="a directory for the runs")
    parser.add_argument("--only", default=",".join(RECIPES), help="comma-separated recipes")
    args = parser.parse_args()
    names = args.only.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: not a recipe; choose from {', '.join(RECIPES)}")
    args.work.mkdir(parents=True, exist_ok=True)
    result: dict = {"recipes": {}}
    start = time.monotonic()
    want = soak.reference(args.work)  # meshtrain launch --nproc 2, uninterrupted
    result["reference_s"] = round(time.monotonic() - start, 1)
    failed = []
    for name in names:
        began = time.monotonic()
        try:
            record = RECIPES[name](args.work, want)
        except (RecipeFailed, AssertionError, subprocess.CalledProcessError) as e:
            failed.append(name)
            record = {"failed": str(e)[:3000]}
        record["seconds"] = round(time.monotonic() - began, 1)
        result["recipes"][name] = record
        print(f"slurm recipe {name}: {'FAILED' if name in failed else 'ok'} "
              f"({record['seconds']} s)", file=sys.stderr, flush=True)  # fmt: skip
    result["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
