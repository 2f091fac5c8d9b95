"""Optimizers (AdamW, LAMB, LARS, SGD+momentum), warmup + cosine schedule, gradient clipping."""

from __future__ import annotations

import dataclasses

import jax
import optax

OPTIMIZERS = ("adamw", "lamb", "lars", "sgd")
_NO_DECAY = ("bias", "scale")  # variable names that never get weight decay


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Optimizer, schedule and clipping.

    Args:
        optimizer: adamw, lamb, lars or sgd (SGD with momentum).
        lr: peak learning rate, reached after warmup.
        warmup_steps: linear warmup from 0 to `lr`.
        min_lr_ratio: the cosine decays to ``lr · min_lr_ratio`` at the last step.
        weight_decay: decoupled weight decay on matrices (not on biases or norm scales).
        b1: first-moment decay (adamw, lamb).
        b2: second-moment decay (adamw, lamb).
        eps: denominator epsilon.
        momentum: momentum (sgd, lars).
        clip_norm: clip gradients to this global norm; 0 turns clipping off.
    """

    optimizer: str = "adamw"
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9
    clip_norm: float = 1.0

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer={self.optimizer!r}: unknown optimizer; "
                f"choose from {', '.join(OPTIMIZERS)}"
            )
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr}: the learning rate must be > 0 (e.g. --lr 3e-3)")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps}: must be ≥ 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio}: must lie in [0, 1]")
        if self.weight_decay < 0 or self.clip_norm < 0 or self.eps < 0:
            raise ValueError(
                f"weight_decay={self.weight_decay}, clip_norm={self.clip_norm}, eps={self.eps}: "
                "none may be negative"
            )
        for name in ("b1", "b2", "momentum"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must lie in [0, 1)")


def make_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to `lr`, then cosine decay to ``lr · min_lr_ratio`` at `total_steps`."""
    warmup = min(config.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=config.lr * config.min_lr_ratio,
    )


def decay_mask(params):
    """True for leaves that get weight decay: everything but biases and norm scales."""

    def keep(path, _):
        last = path[-1]
        return str(getattr(last, "key", last)) not in _NO_DECAY

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """The optax transformation for `config`: clipping, then the optimizer with its schedule.

    Args:
        config: optimizer settings.
        total_steps: optimizer steps in the run (sets the cosine length).

    Returns:
        An `optax.GradientTransformation`.
    """
    lr = make_schedule(config, total_steps)
    c = config
    if c.optimizer == "adamw":
        opt = optax.adamw(
            lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay, mask=decay_mask
        )
    elif c.optimizer == "lamb":
        opt = optax.lamb(
            lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay, mask=decay_mask
        )
    elif c.optimizer == "lars":
        opt = optax.lars(
            lr,
            weight_decay=c.weight_decay,
            weight_decay_mask=decay_mask,
            trust_ratio_mask=decay_mask,
            momentum=c.momentum,
        )
    else:
        opt = optax.chain(
            optax.add_decayed_weights(c.weight_decay, mask=decay_mask),
            optax.sgd(lr, momentum=c.momentum),
        )
    if c.clip_norm > 0:
        opt = optax.chain(optax.clip_by_global_norm(c.clip_norm), opt)
    return opt
