"""`TrainConfig`: the settings of the training loop."""

from __future__ import annotations

import dataclasses

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

    def __post_init__(self):
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps={self.steps!r}: the step count must be ≥ 1 (e.g. --steps 300)")
        for name in ("accum_steps", "eval_batches", "log_every", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be ≥ 1")
        if self.eval_every < 0:
            raise ValueError(f"eval_every={self.eval_every}: must be ≥ 0 (0 = only at the end)")
        if self.loss_impl not in LOSS_IMPLS:
            raise ValueError(
                f"loss_impl={self.loss_impl!r}: choose from {', '.join(LOSS_IMPLS)} "
                "(e.g. --loss-impl pallas)"
            )
        if self.loss not in LOSSES:
            raise ValueError(
                f"loss={self.loss!r}: choose from {', '.join(LOSSES)} (e.g. --loss mse)"
            )
