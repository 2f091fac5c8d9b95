"""Training: the pure train step, losses, optimizers, and the `Trainer` loop.

- `step`: `train_step` (pure), `eval_loss`, and their jitted, sharded forms;
- `loss`: `cross_entropy` and the ``loss_impl`` switch;
- `optim`: `OptimConfig`, `make_optimizer`, `make_schedule`;
- `config`: `TrainConfig`; `hooks`: the save schedule, the non-finite stop, signals;
- `trainer`: the `Trainer`.
"""

from meshtrain.train.config import TrainConfig
from meshtrain.train.hooks import NonFiniteError, StopSignals
from meshtrain.train.loss import cross_entropy
from meshtrain.train.optim import OPTIMIZERS, OptimConfig, make_optimizer, make_schedule
from meshtrain.train.step import eval_loss, jit_eval_step, jit_train_step, train_step
from meshtrain.train.trainer import Trainer

__all__ = [
    "OPTIMIZERS",
    "NonFiniteError",
    "OptimConfig",
    "StopSignals",
    "TrainConfig",
    "Trainer",
    "cross_entropy",
    "eval_loss",
    "jit_eval_step",
    "jit_train_step",
    "make_optimizer",
    "make_schedule",
    "train_step",
]
