"""Dynamic loss scaling for float16: small gradients kept above float16's underflow.

The backward starts from ``scale × 1`` instead of 1 (`scale_backward`; the loss's value is
untouched), so every gradient comes out `scale` times too large; `unscale` divides them in
float32. A step whose gradients are not finite while its loss is (an overflow) is skipped and
the scale halves; after ``period`` good steps in a row it doubles (`adjust`). `step_scale` is
the train step's whole before-step handling, `settle` its whole after-step handling. Scales
are powers of two, so scaling and unscaling are exact.

The scale lives in the optimizer state (`with_loss_scale` wraps the optax transformation),
so it is checkpointed, restored and resharded with it. DeepMind's jmp has the same scheme but
has not been released since 2022; this is the thirty lines it takes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class LossScaleState(NamedTuple):
    """The optimizer state under loss scaling: the scale, the good steps since it last
    changed, and the wrapped optimizer's own state."""

    scale: jax.Array  # float32 []
    good_steps: jax.Array  # int32 []
    inner: Any


def with_loss_scale(tx: optax.GradientTransformation, init: float) -> optax.GradientTransformation:
    """`tx` whose state also holds a loss scale (`LossScaleState`), for float16 training.

    The update is `tx`'s; the train step reads the scale, scales the backward by it, and
    adjusts it after each step (`settle`). `meshtrain.RunSpec.optimizer` wraps the run's
    optimizer this way when its precision scales the loss.

    Args:
        tx: the optax transformation to wrap.
        init: the first loss scale, a power of two (e.g. 32768).

    Returns:
        The wrapped transformation; its state is ``LossScaleState(scale, good_steps, inner)``.
    """

    def init_fn(params):
        return LossScaleState(jnp.float32(init), jnp.int32(0), tx.init(params))

    def update_fn(updates, state, params=None):
        updates, inner = tx.update(updates, state.inner, params)
        return updates, state._replace(inner=inner)

    return optax.GradientTransformation(init_fn, update_fn)


def state_of(opt_state) -> LossScaleState | None:
    """The loss-scale state of an optimizer state, or None without loss scaling."""
    return opt_state if isinstance(opt_state, LossScaleState) else None


def step_scale(opt_state, required: bool) -> jax.Array | None:
    """The scale a train step's backward starts from: the one in its optimizer state.

    Args:
        opt_state: the optimizer state (a `LossScaleState` under loss scaling).
        required: whether the run scales the loss (`meshtrain.RunSpec.loss_scaling`).

    Returns:
        The scale, float32 ``[]``; None when `opt_state` holds none.

    Raises:
        ValueError: `required`, but the optimizer was built without a loss scale.
    """
    scaler = state_of(opt_state)
    if required and scaler is None:
        raise ValueError(
            "precision: loss scaling keeps its scale in the optimizer state; build the "
            "optimizer with run.optimizer(total_steps) (or meshtrain.precision.with_loss_scale)"
        )
    return None if scaler is None else scaler.scale


@jax.custom_vjp
def scale_backward(loss: jax.Array, scale: jax.Array) -> jax.Array:
    """`loss` itself; its gradient flows back multiplied by `scale`."""
    return loss


def _scale_fwd(loss, scale):
    return loss, scale


def _scale_bwd(scale, g):
    return g * scale.astype(g.dtype), jnp.zeros_like(scale)


scale_backward.defvjp(_scale_fwd, _scale_bwd)


def unscale(grads, scale: jax.Array):
    """Gradients of a scaled backward divided by `scale`, in float32."""
    return jax.tree.map(lambda g: (g.astype(jnp.float32) / scale).astype(g.dtype), grads)


def adjust(state: LossScaleState, finite: jax.Array, period: int) -> LossScaleState:
    """The scale after a step: halved (not below 1) when its gradients were not `finite`,
    doubled after `period` good steps in a row, else kept."""
    good = jnp.where(finite, state.good_steps + 1, 0)
    grow = good >= period
    scale = jnp.where(
        finite,
        jnp.where(grow, state.scale * 2, state.scale),
        jnp.maximum(state.scale / 2, 1.0),
    )
    return state._replace(scale=scale, good_steps=jnp.where(grow, 0, good))


def settle(state: LossScaleState, loss: jax.Array, grad_norm: jax.Array, period: int):
    """The train step's loss-scale bookkeeping after its update; returns ``(state, overflow)``.

    An overflow is a finite loss with non-finite gradients: the scale's doing, so the step
    (already skipped by the caller) halves the scale. A non-finite loss is a bad step, not
    the scale's: it leaves the scale and its count of good steps alone. Only the two scalars
    change; the wrapped optimizer's state is returned as it came.
    """
    finite_loss = jnp.isfinite(loss)
    overflow = finite_loss & ~jnp.isfinite(grad_norm)
    adjusted = adjust(state, ~overflow, period)
    return state._replace(
        scale=jnp.where(finite_loss, adjusted.scale, state.scale),
        good_steps=jnp.where(finite_loss, adjusted.good_steps, state.good_steps),
    ), overflow
