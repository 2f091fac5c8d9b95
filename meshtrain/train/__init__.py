"""Training: the pure train step, optimizers, and the `Trainer` loop."""

from meshtrain.train.optim import OPTIMIZERS, OptimConfig, make_optimizer, make_schedule
from meshtrain.train.step import (
    TrainState,
    cross_entropy,
    eval_loss,
    init_train_state,
    jit_eval_step,
    jit_train_step,
    train_step,
)

__all__ = [
    "OPTIMIZERS",
    "OptimConfig",
    "TrainState",
    "cross_entropy",
    "eval_loss",
    "init_train_state",
    "jit_eval_step",
    "jit_train_step",
    "make_optimizer",
    "make_schedule",
    "train_step",
]
