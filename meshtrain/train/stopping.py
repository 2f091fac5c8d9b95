"""One stop step for every process: a SIGTERM/SIGINT that reaches any process of a job (or
all of them, from the launcher) stops all of them after the same step, which they all save.

The process that receives the signal first proposes to stop `LEAD` steps past the steps it
has dispatched, in the key-value store of `jax.distributed` (the first proposal is kept;
later ones are ignored). Every process reads the key after each step and stops once it has
run the agreed step. The lead is safe because the training loop waits for step ``i - 1``
after dispatching step ``i``, and step ``i - 1`` finishes only when every process has
dispatched it, so no process is more than one step ahead of another when it reads the key.
A single process stops after its current step, as before.
"""

from __future__ import annotations

import itertools

import jax

from meshtrain._compat import jax_distributed_client
from meshtrain.train.hooks import StopSignals

LEAD = 2  # steps past the proposer's own count: covers a process one step ahead of it
_FITS = itertools.count()  # one key per fit() call, in the same order on every process


class StopDisagreement(RuntimeError):
    """A process had run past the stop step the job agreed on (the lead was too short)."""


class AgreedStop:
    """The step at which every process stops, once any of them got a stop signal.

    Args:
        signals: this process's `StopSignals` (its `received` starts the agreement).
    """

    def __init__(self, signals: StopSignals):
        self.signals = signals
        self.step: int | None = None
        self._client = jax_distributed_client() if jax.process_count() > 1 else None
        self._key = f"meshtrain/stop/{next(_FITS)}/"
        self._proposed = False
        self._theirs = "a signal"  # the signal of the process whose proposal won

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
                if "ALREADY_EXISTS" not in str(e):
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
