"""The data-parallel replicas and how they synchronise: local SGD and DiLoCo (`local_sgd`)."""

from meshtrain.replicas.local_sgd import (
    OUTER_OPTIMIZERS,
    local_init,
    local_shardings,
    local_step,
    outer_optimizer,
)

__all__ = ["OUTER_OPTIMIZERS", "local_init", "local_shardings", "local_step", "outer_optimizer"]
