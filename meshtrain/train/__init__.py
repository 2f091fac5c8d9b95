"""Training: the pure train step and the `Trainer` loop.

- `step`: `train_step` (pure), `eval_loss`, and their jitted, sharded forms;
- `hooks`: the save schedule, the non-finite stop, signals;
- `stopping`: one stop step for every process; `watchdog`: the hang watchdog; `events`: what a
  launched process tells its launcher;
- `trainer`: the `Trainer`.

The step and the `Trainer` read a `meshtrain.run.RunSpec`. The settings it holds live below
this package (`meshtrain.run.TrainConfig`, `meshtrain.optim`, `meshtrain.loss`), and are
exported here as well.
"""

from meshtrain.loss import cross_entropy
from meshtrain.optim import OPTIMIZERS, OptimConfig, make_optimizer, make_schedule
from meshtrain.run import TrainConfig
from meshtrain.train.hooks import NonFiniteError, StopSignals
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
