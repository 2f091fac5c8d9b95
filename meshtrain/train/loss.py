"""Training losses: ``(logits, targets) -> mean loss``, the form `train_step` takes."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from meshtrain.models.base import ModelOutput

LossFn = Callable[[jax.Array, jax.Array], jax.Array]
LOSS_IMPLS = ("xla", "pallas", "auto")
LOSSES = ("cross_entropy", "mse")


def cross_entropy(logits: jax.Array, targets: jax.Array, *, impl: str = "xla") -> jax.Array:
    """Mean softmax cross-entropy over every target.

    Logits a model masks to a large negative value (a padded vocabulary, e.g.
    `meshtrain.models.layers.PADDED_LOGIT`) add exactly nothing to the loss and get no
    gradient, with either `impl`.

    Args:
        logits: [..., C] float.
        targets: [...] integer class ids.
        impl: ``"xla"`` (optax, in float32), or ``"pallas"`` / ``"auto"`` for the chunked
            kernel `meshtrain.kernels.token_cross_entropy`.

    Returns:
        A float32 scalar.
    """
    if impl != "xla":
        from meshtrain import kernels

        return kernels.token_cross_entropy(logits, targets, impl=impl).mean()
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return losses.mean()


def cross_entropy_with(impl: str) -> LossFn:
    """`cross_entropy` with its kernel fixed: the loss the `Trainer` uses for ``loss_impl``."""
    if impl not in LOSS_IMPLS:
        raise ValueError(f"loss_impl={impl!r}: choose from {', '.join(LOSS_IMPLS)}")
    return lambda logits, targets: cross_entropy(logits, targets, impl=impl)


def mse(logits: jax.Array, targets: jax.Array, *, impl: str = "xla") -> jax.Array:
    """Mean squared error between the logits and the one-hot targets (the surveys' proof of
    concept trains with it), averaged over every element.

    Args:
        logits: [..., C] float.
        targets: [...] integer class ids.
        impl: ``"xla"`` (jnp), or ``"pallas"`` / ``"auto"`` for the hand-written kernels
            `meshtrain.kernels.mean_squared_error`.

    Returns:
        A float32 scalar.
    """
    from meshtrain import kernels

    onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
    return kernels.mean_squared_error(logits, onehot, impl=impl).mean()


def loss_with(name: str, impl: str) -> LossFn:
    """The `Trainer`'s loss for ``TrainConfig.loss`` (`LOSSES`) and ``loss_impl``."""
    if name not in LOSSES:
        raise ValueError(f"loss={name!r}: choose from {', '.join(LOSSES)}")
    if name == "mse":
        return lambda logits, targets: mse(logits, targets, impl=impl)
    return cross_entropy_with(impl)


def loss_and_metrics(loss_fn: LossFn, output, targets: jax.Array):
    """The training loss of a model's `output` on `targets`, and the metrics beside it.

    `output` is bare logits, or a `meshtrain.models.ModelOutput` whose ``aux_loss`` is added
    to the task loss and whose ``metrics`` are reported; `loss_fn` may return a scalar or
    ``(scalar, metrics)``. With auxiliary terms the metrics hold ``task_loss`` too.

    Args:
        loss_fn: ``(logits, targets) -> mean loss`` (or ``(loss, metrics)``).
        output: the model's output.
        targets: the batch's targets.

    Returns:
        ``(loss, metrics)``: a float32 scalar and a dict of float32 scalars.
    """
    logits = output.logits if isinstance(output, ModelOutput) else output
    loss = loss_fn(logits, targets)
    metrics = {}
    if isinstance(loss, tuple):
        loss, metrics = loss[0], dict(loss[1])
    if isinstance(output, ModelOutput):
        metrics = {**metrics, **output.metrics, "task_loss": loss}
        loss = loss + output.aux_loss
    return loss, metrics
