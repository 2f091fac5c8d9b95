"""Training: the pure train step, losses, optimizers, and the `Trainer` loop.

- `step`: `train_step` (pure), `eval_loss`, and their jitted, sharded forms;
- `loss`: `cross_entropy` and the ``loss_impl`` switch;
- `optim`: `OptimConfig`, `make_optimizer`, `make_schedule`;
- `config`: `TrainConfig`; `hooks`: the save schedule, the non-finite stop, signals;
- `stopping`: one stop step for every process; `watchdog`: the hang watchdog; `events`: what a
  launched process tells its launcher;
- `trainer`: the `Trainer`.

The step and the `Trainer` read a `meshtrain.run.RunSpec`, which holds this package's configs;
they load on first use, so that importing a config never needs the run description first.
"""

import importlib

from meshtrain.train.config import TrainConfig
from meshtrain.train.hooks import NonFiniteError, StopSignals
from meshtrain.train.loss import cross_entropy
from meshtrain.train.optim import OPTIMIZERS, OptimConfig, make_optimizer, make_schedule

_LATER = {
    "eval_loss": "meshtrain.train.step",
    "jit_eval_step": "meshtrain.train.step",
    "jit_train_step": "meshtrain.train.step",
    "train_step": "meshtrain.train.step",
    "Trainer": "meshtrain.train.trainer",
}

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


def __getattr__(name: str):
    """The step functions and the `Trainer`, imported on first use."""
    if name in _LATER:
        return getattr(importlib.import_module(_LATER[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LATER))
