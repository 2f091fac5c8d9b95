"""Optimizers (AdamW, LAMB, LARS, SGD+momentum), warm-up + cosine schedule, gradient clipping."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from meshtrain import validate
from meshtrain.problem import Problem

OPTIMIZERS = ("adamw", "lamb", "lars", "sgd")
_NO_DECAY = ("bias", "scale")  # variable names that never get weight decay


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig(validate.Checked):
    """Optimizer, schedule and clipping.

    The learning rate at step s (0-based, one step per batch consumed) of a run of S steps,
    with W = min(warmup_steps, S − 1) warm-up steps, peak step P = max(W − 1, 0) and
    lr_min = lr · min_lr_ratio:

    - s < P (warm-up, only when W ≥ 2): ``lr · (s + 1) / W``, so step 0 runs at lr / W;
    - s ≥ P (decay): ``lr_min + (lr − lr_min) · ½ · (1 + cos(π · (s − P) / (S − 1 − P)))``,
      exactly ``lr`` at step P and exactly ``lr_min`` at the last step S − 1;
    - S = 1: the single step runs at ``lr``; steps past S − 1 stay at ``lr_min``.

    Args:
        optimizer: adamw, lamb, lars or sgd (SGD with momentum).
        lr: peak learning rate, reached at the last warm-up step.
        warmup_steps: linear warm-up steps, the last of which runs at `lr` (0 or 1: start at
            `lr`).
        min_lr_ratio: the cosine ends at ``lr · min_lr_ratio`` on the last step.
        weight_decay: decoupled weight decay on matrices (not on biases or norm scales);
            every optimizer applies it.
        b1: first-moment decay (adamw, lamb).
        b2: second-moment decay (adamw, lamb).
        eps: denominator epsilon (adamw, lamb).
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

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        v = validate
        problems = v.one_of("optimizer", self.optimizer, OPTIMIZERS, example="lamb")
        problems += v.above("lr", self.lr, 0, example="3e-3", note="the learning rate")
        problems += v.non_negative("warmup_steps", self.warmup_steps, example=20)
        problems += v.in_range("min_lr_ratio", self.min_lr_ratio, 0, 1, example=0.1)
        for name in ("weight_decay", "clip_norm", "eps"):
            problems += v.non_negative(name, getattr(self, name), integer=False)
        for name in ("b1", "b2", "momentum"):
            problems += v.in_range(name, getattr(self, name), 0, 1, closed="[)", example=0.9)
        return problems


def make_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up to `lr`, then a cosine down to ``lr · min_lr_ratio`` at the last step.

    The formula, with its step indices, is in `OptimConfig`'s docstring. Both end points are
    set by their own branch, so they are exactly ``lr`` and ``lr · min_lr_ratio`` in float32.

    Args:
        config: optimizer settings (`lr`, `warmup_steps`, `min_lr_ratio`).
        total_steps: S, the steps in the run (≥ 1); the last one is S − 1.

    Returns:
        ``schedule(step) -> lr``, float32, traceable under `jax.jit` for an integer step.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps}: a schedule needs at least one step")
    peak = float(config.lr)
    floor = float(config.lr * config.min_lr_ratio)
    last = total_steps - 1  # S − 1
    warmup = min(config.warmup_steps, last)  # W
    top = max(warmup - 1, 0)  # P: the step that runs at the peak
    decay_steps = max(last - top, 1)  # S − 1 − P; 0 only when S = 1, where no step decays

    def schedule(step):
        s = jnp.asarray(step)
        rising = peak * (s + 1) / max(warmup, 1)  # used for s < P, so only when W ≥ 2
        t = jnp.clip((s - top) / decay_steps, 0.0, 1.0)
        falling = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * t))
        lr = jnp.where(s < top, rising, falling)
        lr = jnp.where(s == top, peak, lr)
        return jnp.where((s >= last) & (s > top), floor, lr).astype(jnp.float32)

    return schedule


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
