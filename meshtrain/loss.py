"""Training losses: ``(logits, targets) -> mean loss``, the form `train_step` takes."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from meshtrain.models.base import ModelOutput

LossFn = Callable[[jax.Array, jax.Array], jax.Array]
LOSS_IMPLS = ("xla", "pallas", "auto")
LOSSES = ("cross_entropy", "mse")


def masked_mean(values: jax.Array, mask: jax.Array | None) -> jax.Array:
    """The float32 mean of `values` over the entries where `mask` (same shape) is true; of all
    entries without a mask. An all-false mask gives 0, not NaN."""
    values = values.astype(jnp.float32)
    if mask is None:
        return values.mean()
    total = jnp.where(mask, values, 0.0).sum()
    return total / jnp.maximum(mask.sum(), 1).astype(jnp.float32)


def loss_mask(batch) -> jax.Array | None:
    """The tokens a packed batch's loss counts (``segment_ids > 0``: no padding); None for a
    batch without ``segment_ids``."""
    seg = batch.get("segment_ids")
    return None if seg is None else seg > 0


def cross_entropy(
    logits: jax.Array, targets: jax.Array, *, impl: str = "xla", mask: jax.Array | None = None
) -> jax.Array:
    """Mean softmax cross-entropy over every target (over the targets `mask` keeps).

    Logits a model masks to a large negative value (a padded vocabulary, e.g.
    `meshtrain.models.layers.PADDED_LOGIT`) add exactly nothing to the loss and get no
    gradient, with either `impl`.

    Args:
        logits: [..., C] float.
        targets: [...] integer class ids.
        impl: ``"xla"`` (optax, in float32), or ``"pallas"`` / ``"auto"`` for the chunked
            kernel `meshtrain.kernels.token_cross_entropy`.
        mask: [...] booleans, the targets that count (a packed batch's real tokens, see
            `loss_mask`); None: all. The mean is over the kept targets.

    Returns:
        A float32 scalar.
    """
    if impl != "xla":
        from meshtrain import kernels

        return masked_mean(kernels.token_cross_entropy(logits, targets, impl=impl), mask)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return masked_mean(losses, mask)


def cross_entropy_with(impl: str) -> LossFn:
    """`cross_entropy` with its kernel fixed: the loss the `Trainer` uses for ``loss_impl``."""
    if impl not in LOSS_IMPLS:
        raise ValueError(f"loss_impl={impl!r}: choose from {', '.join(LOSS_IMPLS)}")
    return lambda logits, targets, mask=None: cross_entropy(logits, targets, impl=impl, mask=mask)


def mse(
    logits: jax.Array, targets: jax.Array, *, impl: str = "xla", mask: jax.Array | None = None
) -> jax.Array:
    """Mean squared error between the logits and the one-hot targets (the surveys' proof of
    concept trains with it), averaged over every element.

    Args:
        logits: [..., C] float.
        targets: [...] integer class ids.
        impl: ``"xla"`` (jnp), or ``"pallas"`` / ``"auto"`` for the hand-written kernels
            `meshtrain.kernels.mean_squared_error`.
        mask: [...] booleans, the targets that count; None: all.

    Returns:
        A float32 scalar.
    """
    from meshtrain import kernels

    onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
    return masked_mean(kernels.mean_squared_error(logits, onehot, impl=impl), mask)


def loss_with(name: str, impl: str) -> LossFn:
    """The `Trainer`'s loss for ``TrainConfig.loss`` (`LOSSES`) and ``loss_impl``."""
    if name not in LOSSES:
        raise ValueError(f"loss={name!r}: choose from {', '.join(LOSSES)}")
    if name == "mse":
        return lambda logits, targets, mask=None: mse(logits, targets, impl=impl, mask=mask)
    return cross_entropy_with(impl)


def _takes_mask(loss_fn: LossFn) -> bool:
    """True when `loss_fn` accepts a ``mask=`` keyword."""
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):
        return True  # cannot tell: let the call itself say
    return any(p.kind is p.VAR_KEYWORD or p.name == "mask" for p in params)


def loss_and_metrics(
    loss_fn: LossFn,
    output,
    targets: jax.Array,
    mask: jax.Array | None = None,
    task_weight: jax.Array | None = None,
):
    """The training loss of a model's `output` on `targets`, and the metrics beside it.

    `output` is bare logits, or a `meshtrain.models.ModelOutput` whose ``aux_loss`` is added
    to the task loss and whose ``metrics`` are reported; `loss_fn` may return a scalar or
    ``(scalar, metrics)``. With auxiliary terms the metrics hold ``task_loss`` too.

    Args:
        loss_fn: ``(logits, targets) -> mean loss`` (or ``(loss, metrics)``); with a `mask`
            it is called ``loss_fn(logits, targets, mask=mask)``.
        output: the model's output.
        targets: the batch's targets.
        mask: the targets that count (a packed batch's `loss_mask`), or None for all.
        task_weight: a float32 scalar the task loss (not the auxiliary terms) is multiplied by:
            a microbatch's share of the real tokens (see `meshtrain.train.step`); None: 1.

    Returns:
        ``(loss, metrics)``: a float32 scalar and a dict of float32 scalars.

    Raises:
        ValueError: a `mask`, and a `loss_fn` that takes no ``mask=`` keyword.
    """
    logits = output.logits if isinstance(output, ModelOutput) else output
    if mask is None:
        loss = loss_fn(logits, targets)
    elif not _takes_mask(loss_fn):
        raise ValueError(
            f"loss_fn {getattr(loss_fn, '__name__', type(loss_fn).__name__)}: a packed batch "
            "needs a loss that averages over real tokens only, called as loss_fn(logits, "
            "targets, mask=segment_ids > 0); add the mask= keyword (see "
            "meshtrain.loss.cross_entropy) or train on plain windows (--data.no-packing)"
        )
    else:
        loss = loss_fn(logits, targets, mask=mask)
    metrics = {}
    if isinstance(loss, tuple):
        loss, metrics = loss[0], dict(loss[1])
    if task_weight is not None:
        loss = loss * task_weight
    if isinstance(output, ModelOutput):
        metrics = {**metrics, **output.metrics, "task_loss": loss}
        loss = loss + output.aux_loss
    return loss, metrics
