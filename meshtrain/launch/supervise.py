"""The launcher's restart loop: start the processes, watch them, and on a failure stop the
rest and start again from the newest checkpoint, on fewer processes when one cannot come back.

Each start (a *generation*) gets its own events file (`meshtrain.train.events`), from which
the launcher learns the run directory, the step each start resumed from, when its first step
finished, which process hung and whether the processes agreed to stop. Every restart is
printed and appended to ``<run_dir>/restarts.jsonl``: the cause, the exit codes, the newest
committed step, the step resumed, and the seconds from the failure to the first resumed step.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

from meshtrain.checkpoint.dirs import saved_steps
from meshtrain.distributed import free_port
from meshtrain.launch import process_env
from meshtrain.launch.procs import Generation, describe
from meshtrain.launch.resize import CannotResize, resized
from meshtrain.train import events
from meshtrain.train.watchdog import HANG_EXIT

START_FAILURES = 2  # a process that fails this many starts in a row is taken as gone
RESTARTS_FILE = "restarts.jsonl"
REFUSED = 2  # the exit status of a job refused before it ran: a restart cannot help


def _status(code: int) -> int:
    """The launcher's exit status for a process's exit code (128 + N for signal N)."""
    return code if code > 0 else 128 - code


class Supervisor:
    """Runs the job's processes until they finish, restarting them after failures.

    Args:
        settings: the `meshtrain.cli.launch.LaunchSettings`.
        command: each process's command (`meshtrain.launch.plan`).
        devices: simulated CPU devices per process.
        read_job: reads a train command's words into its `meshtrain.cli.train.TrainJob`
            (what a smaller job is sized from); None: a train job is never resized.
    """

    def __init__(self, settings, command: list[str], devices: int, read_job=None):
        self.settings, self.command, self.devices = settings, command, devices
        self.read_job = read_job
        self.nproc = settings.nproc
        self.min_nproc = settings.min_nproc or settings.nproc
        self.train = command[1:4] == ["-m", "meshtrain.cli", "train"]
        self.restarts = 0
        self.run_dir = self.checkpoints = ""
        self.extra: list[str] = []  # flags added to a resized train command
        self._start_failures: dict[int, int] = {}
        self._pending: dict | None = None  # the restart whose first step is awaited
        self._failed_at = 0.0
        self._terms = 0
        self._lock = threading.Lock()
        self._dir = Path(tempfile.mkdtemp(prefix="meshtrain-launch-"))
        self._gen: Generation | None = None

    def say(self, message: str) -> None:
        """Prints one ``[launch]`` line."""
        with self._lock:
            print(f"[launch] {message}", flush=True)

    def run(self) -> int:
        """Starts generations until one finishes or a failure is final; returns the status."""
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            while True:
                status = self._generation()
                if status is not None:
                    return status
        except KeyboardInterrupt:
            self.say("interrupted; stopping all processes")
            if self._gen is not None:
                self._gen.stop(self.settings.grace)
            return 130
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            shutil.rmtree(self._dir, ignore_errors=True)

    def _on_sigterm(self, signum, frame) -> None:
        """Counts SIGTERMs; the watch loop forwards them (no printing in a handler)."""
        self._terms += 1

    def _command(self) -> list[str]:
        """This generation's command: a restarted train job resumes, in the same run directory."""
        command = list(self.command)
        if self.train and self.restarts and self.checkpoints:
            command += ["--resume"] + (["--run-dir", self.run_dir] if self.run_dir else [])
        return command + self.extra

    def _generation(self) -> int | None:
        """Starts and watches one generation; the launcher's exit status, or None to restart."""
        opts = self.settings
        port = opts.port if opts.port and not self.restarts else free_port()
        path = self._dir / f"events-{self.restarts}.jsonl"
        envs = []
        for rank in range(self.nproc):
            env = process_env(rank, self.nproc, port, self.devices, opts.heartbeat_timeout)
            env.update({events.EVENTS_VAR: str(path), events.RESTART_VAR: str(self.restarts)})
            envs.append(env)
        command = self._command()
        if not self.restarts:
            self.say(
                f"{self.nproc} processes × {self.devices} CPU devices · coordinator "
                f"127.0.0.1:{port} · {' '.join(command)}"
            )
        gen = self._gen = Generation(command, envs, self._lock)
        watch = _Watch(path)
        forwarded = 0
        while True:
            if self._terms > forwarded:
                forwarded = self._forward(gen, forwarded)
            self._drain(watch)
            codes = gen.codes()
            # A process killed or hung is the cause; the others' errors are its consequence.
            failed = sorted(
                ((r, c) for r, c in enumerate(codes) if c not in (None, 0)),
                key=lambda rc: (rc[1] > 0 and rc[1] != HANG_EXIT, rc[0]),
            )
            if failed:
                self._drain(watch)
                return self._failure(gen, codes, failed[0], watch)
            if all(c == 0 for c in codes):
                gen.flush()
                self._drain(watch)
                return self._finished(watch)
            time.sleep(0.1)

    def _forward(self, gen: Generation, forwarded: int) -> int:
        """Passes the launcher's SIGTERMs on: the first asks for an agreed stop, a second
        kills."""
        if forwarded == 0:
            self.say("SIGTERM: every process stops after one agreed step and saves it")
            gen.signal(signal.SIGTERM)
        else:
            self.say("second SIGTERM: stopping every process now")
            gen.signal(signal.SIGKILL)
        return self._terms

    def _drain(self, watch: _Watch) -> None:
        """Reads the generation's new events and learns from each."""
        for event in watch.new():
            self._on_event(event)

    def _on_event(self, event: dict) -> None:
        """Learns from one event: the run directory, the resumed step, the first step's time."""
        kind = event.get("event")
        if kind == "start":
            self.run_dir = event.get("run_dir", "")
            self.checkpoints = event.get("checkpoints", "")
            if self._pending is not None:
                self._pending["resumed"] = event["step"]
        elif kind == "first_step" and self._pending is not None:
            record, self._pending = self._pending, None
            record["first_step"] = event["step"]
            record["seconds_to_first_step"] = round(time.monotonic() - self._failed_at, 2)
            self.say(
                f"restart {record['restart']}: resumed from step {record.get('resumed')} "
                f"(newest committed: {record['committed']}); step {event['step']} done "
                f"{record['seconds_to_first_step']:.1f} s after the failure"
            )
            self._log(record)

    def _cause(self, rank: int, code: int, watch: _Watch) -> str:
        """Why process `rank` failed, in words."""
        hang = watch.hangs.get(rank)
        if code == HANG_EXIT and hang:
            return (
                f"hung: no step done for {hang['idle_s']:.0f} s after step {hang['step']}; "
                f"stacks in {hang['stacks']}"
            )
        return describe(code)

    def _newest_committed(self) -> int | None:
        """The newest committed checkpoint step of the run, None if none."""
        steps = saved_steps(Path(self.checkpoints)) if self.checkpoints else []
        return steps[-1] if steps else None

    def _failure(self, gen: Generation, codes, first, watch: _Watch) -> int | None:
        """Stops the generation after a failure; the exit status, or None to restart."""
        opts = self.settings
        rank, code = first
        failed_at, failed_time = time.monotonic(), time.time()
        gen.flush(rank)  # its last lines first, then the verdict
        others = [r for r, c in enumerate(codes) if c is None]
        stopping = f"; stopping process(es) {', '.join(map(str, others))}" if others else ""
        cause = self._cause(rank, code, watch)
        self.say(f"process {rank} failed ({cause}){stopping}")
        if rank in watch.hangs and others:
            self._collect_stacks(others, watch)
        if not opts.max_restarts or self._terms:
            gen.stop(opts.grace)
            return _status(code)
        gen.stop(0)  # the others cannot save without their peer: no grace to wait out
        if code == REFUSED:
            self.say(f"process {rank} refused the job (exit code {REFUSED}): not restarting")
            return REFUSED
        committed = self._newest_committed()
        if self.restarts >= opts.max_restarts:
            where = (
                f"newest checkpoint: step {committed} in {self.checkpoints}; --resume continues"
                if committed is not None
                else "no checkpoint was committed"
            )
            self.say(
                f"restarts exhausted ({self.restarts} of {opts.max_restarts} used); giving up "
                f"with {describe(code)}; {where}"
            )
            return _status(code)
        if watch.started:
            self._start_failures = {}
        else:
            self._start_failures[rank] = self._start_failures.get(rank, 0) + 1
            if self._start_failures[rank] >= START_FAILURES and not self._shrink(rank):
                return _status(code)
        if self._pending is not None:  # the previous restart never got to its first step
            self._log(self._pending)
        self.restarts += 1
        self._failed_at = failed_at
        self._pending = {
            "restart": self.restarts,
            "cause": f"process {rank}: {cause}",
            "exit_codes": {str(r): c for r, c in enumerate(codes)},
            "nproc": self.nproc,
            "committed": committed,
            "time": failed_time,
        }
        self.say(
            f"restart {self.restarts} of {opts.max_restarts} on {self.nproc} process(es) in "
            f"{opts.restart_delay:g} s, from "
            + (f"step {committed}" if committed is not None else "the start (no checkpoint)")
        )
        time.sleep(opts.restart_delay)
        return None if not self._terms else _status(-signal.SIGTERM)

    def _collect_stacks(self, ranks: list[int], watch: _Watch, wait_s: float = 5.0) -> None:
        """Asks the live processes for their stacks (a hang's cause may be a peer) and waits
        up to `wait_s` for them."""
        Path(events.dump_request(str(watch.path))).touch()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not set(ranks) <= set(watch.stacks):
            time.sleep(0.1)
            self._drain(watch)
        got = [f"{r}: {watch.stacks[r]}" for r in ranks if r in watch.stacks]
        if got:
            self.say(f"stacks of the other process(es) · {' · '.join(got)}")

    def _shrink(self, rank: int) -> bool:
        """Drops the process that keeps failing at start when the job can run without it."""
        gone = f"process {rank} failed {START_FAILURES} starts in a row: its host is taken as gone"
        if self.nproc - 1 < self.min_nproc:
            self.say(
                f"{gone}; --min-nproc {self.min_nproc} allows no fewer than {self.nproc} "
                "processes: giving up"
            )
            return False
        reasons = []
        for to in range(self.nproc - 1, self.min_nproc - 1, -1):
            change = ""
            if self.train:
                try:
                    mesh, accum = resized(self._job(), self.settings.nproc, to, self.devices)
                except CannotResize as e:
                    reasons.append(f"{to}: {e}")
                    continue
                self.extra = ["--mesh", mesh, "--accum-steps", str(accum)]
                change = f": mesh {mesh}, {accum} accumulation steps (the same global batch)"
            self.nproc = to
            self._start_failures = {}
            self.say(f"{gone}; continuing on {to} process(es){change}")
            return True
        self.say(f"{gone}; no smaller job fits ({'; '.join(reasons)}): giving up")
        return False

    def _job(self):
        """The train job the command describes, as first given."""
        if self.read_job is None:
            raise CannotResize("no reader for the train command was given")
        try:
            return self.read_job(self.command[4:])
        except (ValueError, SystemExit) as e:
            raise CannotResize(f"cannot read the train command ({e})") from None

    def _finished(self, watch: _Watch) -> int:
        """Reports a generation whose processes all exited 0; returns 0."""
        if self._pending is not None:  # finished without a first step (nothing left to run)
            self._log(self._pending)
            self._pending = None
        steps = sorted(set(watch.stopped.values()))
        who = f"all {self.nproc} processes" if self.nproc > 1 else "the process"
        if len(steps) == 1 and len(watch.stopped) == self.nproc:
            self.say(f"{who} stopped after step {steps[0]} and saved it; --resume continues")
        elif steps:
            self.say(f"processes stopped after different steps: {watch.stopped}")
        else:
            self.say(f"{who} finished")
        return 0

    def _log(self, record: dict) -> None:
        """Appends a restart's record to ``<run_dir>/restarts.jsonl``."""
        if self.run_dir:
            with open(Path(self.run_dir) / RESTARTS_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")


class _Watch:
    """The events of one generation, read as they arrive."""

    def __init__(self, path: Path):
        self.path = path
        self.seen = 0
        self.started = False
        self.stopped: dict[int, int] = {}  # rank → the step it stopped after and saved
        self.hangs: dict[int, dict] = {}
        self.stacks: dict[int, str] = {}  # rank → where its stacks were written on request

    def new(self) -> list[dict]:
        """The events written since the last call."""
        found = events.read(self.path, skip=self.seen)
        self.seen += len(found)
        for event in found:
            kind = event.get("event")
            if kind == "start":
                self.started = True
            elif kind == "stop":
                self.stopped[event["rank"]] = event["step"]
            elif kind == "hang":
                self.hangs.setdefault(event["rank"], event)
            elif kind == "stacks":
                self.stacks[event["rank"]] = event["stacks"]
        return found
