"""One stop step for every process: a SIGTERM/SIGINT that reaches any process of a job (or
all of them, from the launcher) stops all of them after the same step, which they all save.

The process that receives the signal first proposes to stop `LEAD` steps past the steps it
has dispatched, in the key-value store of `jax.distributed` (the first proposal is kept;
later ones are ignored). Every process reads the key after each step and stops once it has
run the agreed step. The lead is safe because the training loop waits for step ``i - 1``
after dispatching step ``i``, and step ``i - 1`` finishes only when every process has
dispatched it, so no process is more than one step ahead of another when it reads the key.
A single process stops after its current step, as before.

A stop needs every process: when one is gone (killed, its host lost), the next step's
collectives never finish. So a signalled process first calls the roll (`RollCall`), which
every process's own thread answers within milliseconds, whatever its main thread is doing.
If a process does not answer within `ANSWER_S`, the signalled one says which, and that
nothing was saved, and exits with `PEER_GONE_EXIT` instead of waiting for the distributed
runtime's heartbeat timeout to end it. A job whose processes all answer stops as above.
A step whose collective fails (as gloo's do at once when a peer dies) calls the roll too, and
exits the same way when a process is gone.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections.abc import Callable

import jax

from meshtrain._compat import jax_distributed_client
from meshtrain.checkpoint import CheckpointManager
from meshtrain.checkpoint.dirs import saved_steps
from meshtrain.train.hooks import StopSignals

LEAD = 2  # steps past the proposer's own count: covers a process one step ahead of it
_FITS = itertools.count()  # one key per fit() call, in the same order on every process
# The status of a process that got a stop signal while a peer was gone (EX_TEMPFAIL, "try
# again": a restart resumes from the newest checkpoint).
PEER_GONE_EXIT = 75
ANSWER_S = 5.0  # how long a live process may take to answer the roll (it takes milliseconds)
_WAIT_MS = 600_000  # one wait of the answering thread for the roll; it waits again after


class StopDisagreement(RuntimeError):
    """A process had run past the stop step the job agreed on (the lead was too short)."""


def _exists(error: Exception) -> bool:
    """Whether a key-value store error says the key was set already."""
    return "ALREADY_EXISTS" in str(error)


class RollCall:
    """Which processes of a job still answer; each answers from a thread of its own.

    Every process starts one (`start`) and ends it (`close`); `call` asks them all. A process
    answers once per fit: the roll tells a gone process from a live one, and a process that
    is gone after it answered is left to the distributed runtime, as before.

    Args:
        client: the `jax.distributed` key-value client.
        key: this fit's key prefix (the same on every process), for the roll alone.
        rank: this process's index.
        processes: how many processes the job has.
    """

    def __init__(self, client, key: str, rank: int, processes: int):
        self._client, self._key = client, key
        self.rank, self.processes = rank, processes
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts answering: a thread waits for the roll, then answers it."""
        self._thread = threading.Thread(target=self._answer, name="meshtrain-roll", daemon=True)
        self._thread.start()

    def _answer(self) -> None:
        """The thread: waits for the roll to be called, then says this process is here."""
        while True:
            try:
                self._client.blocking_key_value_get(self._key + "call", _WAIT_MS)
                break
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    return  # the coordinator is gone or shutting down
        try:
            self._client.key_value_set(f"{self._key}here/{self.rank}", "1")
        except jax.errors.JaxRuntimeError:
            pass

    def _ask(self, by: str) -> bool:
        """Calls the roll (the first call is kept); False when the coordinator is gone."""
        try:
            self._client.key_value_set(self._key + "call", by)
        except jax.errors.JaxRuntimeError as e:
            return _exists(e)
        return True

    def call(self, timeout_s: float) -> list[int]:
        """The processes that did not answer within `timeout_s` seconds (0: the coordinator,
        when it cannot be reached)."""
        if not self._ask(f"signal to {self.rank}"):
            return [0]
        deadline = time.monotonic() + timeout_s
        missing = set(range(self.processes)) - {self.rank}
        while missing:
            try:
                found = self._client.key_value_dir_get(self._key + "here/")
            except jax.errors.JaxRuntimeError:
                return [0]
            missing -= {int(k.rsplit("/", 1)[1]) for k, _ in found}
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return sorted(missing)

    def close(self) -> None:
        """Stops answering: calls the roll (every process answers it) and waits for the
        thread, so that no request is in flight when `jax.distributed` shuts down."""
        if self._thread is None:
            return
        if self._ask(f"end of {self.rank}"):
            self._thread.join(timeout=5)
        self._thread = None


class AgreedStop:
    """The step at which every process stops, once any of them got a stop signal.

    Use it as a context manager around the training loop: in a job of several processes, it
    then answers the roll and, on a signal while a peer is gone, ends this process with
    `PEER_GONE_EXIT`.

    Args:
        signals: this process's `StopSignals` (its `received` starts the agreement).
        checkpoints: the run's checkpoints, whose newest committed step a process that
            exits for a gone peer names; None when the run keeps none.
    """

    def __init__(self, signals: StopSignals, checkpoints: CheckpointManager | None = None):
        self.signals = signals
        self.step: int | None = None
        self._client = jax_distributed_client() if jax.process_count() > 1 else None
        self._fit = next(_FITS)
        self._key = f"meshtrain/stop/{self._fit}/"
        self._proposed = False
        self._theirs = "a signal"  # the signal of the process whose proposal won
        self._checkpoints = checkpoints
        self._roll: RollCall | None = None
        self._polls = 0
        self._stepped = threading.Event()  # a step completed: every process answers the roll
        self._closed = threading.Event()
        self._ending = threading.Lock()

    def __enter__(self) -> AgreedStop:
        if self._client is not None:
            key = f"meshtrain/roll/{self._fit}/"
            self._roll = RollCall(self._client, key, jax.process_index(), jax.process_count())
            self._roll.start()
            self.signals.at_first(self._check_peers)
        return self

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        if kind is None:
            self._closed.set()
        elif isinstance(error, jax.errors.JaxRuntimeError) and self._stepped.is_set():
            # A collective fails at once when a peer dies (gloo on CPU): the same line and
            # status as a signal while a peer is gone, rather than a traceback.
            first = (str(error).strip().splitlines() or [""])[0][:200]
            failed = f"a step failed ({type(error).__name__}: {first})"
            self._end_if_gone(lambda: self.signals.received or failed)
        if self._roll is not None:
            self._roll.close()

    @property
    def reason(self) -> str:
        """This process's signal, else the one another process got: "SIGTERM" or "SIGINT to
        another process"."""
        return self.signals.received or f"{self._theirs} to another process"

    def poll(self, dispatched: int) -> int | None:
        """The agreed stop step (None while no process asked to stop).

        Args:
            dispatched: how many steps this process has run (the train state's step).

        Raises:
            StopDisagreement: this process already ran past the agreed step.
        """
        self._polls += 1
        if self._polls == 2:  # the loop waited for its first step before this second poll
            self._stepped.set()
        if self.step is not None:
            return self.step
        if self._client is None:
            self.step = dispatched if self.signals.received else None
            return self.step
        if self.signals.received and not self._proposed:
            self._proposed = True
            try:  # the first proposal wins; a later one fails here and is ignored
                proposal = f"{dispatched + LEAD} {self.signals.received}"
                self._client.key_value_set(self._key + "step", proposal)
            except jax.errors.JaxRuntimeError as e:
                if not _exists(e):
                    raise
        found = self._client.key_value_dir_get(self._key)
        if not found:
            return None
        step, self._theirs = found[0][1].split()
        self.step = int(step)
        if dispatched > self.step:
            raise StopDisagreement(
                f"process {jax.process_index()} had run {dispatched} steps when its job agreed "
                f"to stop after step {self.step}"
            )
        return self.step

    def _check_peers(self, signal_name: str) -> None:
        """On the first signal (a thread of its own): exits with `PEER_GONE_EXIT` when another
        process does not answer the roll.

        Only after a step of this fit completed: every process had then started answering,
        so a silent one is gone rather than still starting.
        """
        while not self._stepped.wait(0.2):
            if self._closed.is_set():
                return
        self._end_if_gone(lambda: signal_name)

    def _end_if_gone(self, what: Callable[[], str]) -> None:
        """Exits with `PEER_GONE_EXIT`, saying ``what()`` happened, when another process does
        not answer the roll; one caller at a time (a signal and a failed step may race)."""
        with self._ending:
            if self._roll is None or self._closed.is_set():
                return
            gone = self._roll.call(ANSWER_S)
            if not gone or self._closed.is_set():
                return
            print(self._gone_line(what(), gone), file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(PEER_GONE_EXIT)

    def _gone_line(self, what: str, gone: list[int]) -> str:
        """The one line a process that exits for gone peers prints, after `what` happened."""
        who = ", ".join(map(str, gone))
        who = f"process {who} is" if len(gone) == 1 else f"processes {who} are"
        if self._checkpoints is None:
            newest = "the run keeps no checkpoints"
        else:
            directory = self._checkpoints.directory
            steps = saved_steps(directory)
            newest = (
                f"newest committed checkpoint: step {steps[-1]} ({directory / str(steps[-1])})"
                if steps
                else f"no checkpoint committed in {directory}"
            )
        return (
            f"meshtrain: {what}: {who} gone (no answer within {ANSWER_S:g} s), so the "
            f"job cannot agree on a step to stop at and nothing was saved; {newest}; exiting "
            f"with status {PEER_GONE_EXIT}"
        )
