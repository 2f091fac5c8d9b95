"""`TrainConfig`: the settings of the training loop."""

from __future__ import annotations

import dataclasses

from meshtrain import validate
from meshtrain.problem import Problem
from meshtrain.train.loss import LOSS_IMPLS, LOSSES


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The training loop.

    Args:
        steps: optimizer steps to run.
        accum_steps: microbatches per step (gradient accumulation).
        eval_every: evaluate every this many steps (0: only at the end).
        eval_batches: held-out batches per evaluation.
        log_every: write metrics every this many steps.
        seed: seed of the parameter initialisers (a model config, or a constructor that
            takes an ``nnx.Rngs``).
        run_dir: where metrics.jsonl (and checkpoints) go; empty: write no files.
        tensorboard: also write TensorBoard event files to run_dir.
        progress: show a progress bar.
        max_bad_steps: stop after this many consecutive steps whose update was skipped for a
            non-finite loss or gradient.
        loss_impl: the cross-entropy kernel: xla (optax), pallas or auto (Pallas on a GPU);
            see kernels/README.md. With ``loss=mse``: the MSE kernels' switch.
        loss: ``cross_entropy`` or ``mse`` (squared error to the one-hot targets, for
            classifiers; the surveys' proof of concept).
        hang_factor: the hang watchdog declares a hang after this many median step times
            without a completed step (`meshtrain.train.watchdog`).
        hang_floor_s: ... and never before this many seconds; 0 turns the watchdog off.
    """

    steps: int = 300
    accum_steps: int = 1
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    seed: int = 0
    run_dir: str = "runs/default"
    tensorboard: bool = False
    progress: bool = True
    max_bad_steps: int = 5
    loss_impl: str = "xla"
    loss: str = "cross_entropy"
    hang_factor: float = 20.0
    hang_floor_s: float = 300.0

    def __post_init__(self):
        validate.reject(self)

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        v = validate
        problems = v.positive("steps", self.steps, example=300)
        for name in ("accum_steps", "eval_batches", "log_every", "max_bad_steps"):
            problems += v.positive(name, getattr(self, name), example=getattr(TrainConfig, name))
        problems += v.non_negative("eval_every", self.eval_every, note="0 = only at the end")
        problems += v.one_of("loss_impl", self.loss_impl, LOSS_IMPLS, example="pallas")
        problems += v.at_least("hang_factor", self.hang_factor, 1, integer=False, example=20)
        problems += v.non_negative(
            "hang_floor_s", self.hang_floor_s, integer=False, example=300, note="0 = no watchdog"
        )
        return problems + v.one_of("loss", self.loss, LOSSES, example="mse")
