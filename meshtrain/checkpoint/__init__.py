"""Checkpoints: asynchronous, atomic orbax saves, and restores onto any mesh, with fallback.

A checkpoint directory holds one sub-directory per saved step (``<dir>/<step>/``), each with
three items:

- ``state``: the `TrainState` (step, parameters, optimizer state, other model variables);
- ``data``: the training data iterator's position (JSON);
- ``meta``: the full run config, the mesh it was written from, the seed (JSON).

Orbax writes each step into a temporary directory and renames it when complete, so a step
exists only once fully written; leftovers of an interrupted save are removed when a manager
opens the directory for writing. Restoring reads every array straight into the layout of an
abstract target (`jax.ShapeDtypeStruct` with the new `NamedSharding`), on any mesh and any
device count, never through one host's full copy. A step that cannot be read is reported and
skipped for the previous one; it is never deleted or overwritten (see `set_aside`).
"""

from meshtrain.checkpoint.manager import (
    UNREADABLE_SUFFIX,
    CheckpointConfig,
    CheckpointManager,
    CheckpointWarning,
    Restored,
    restore,
)
from meshtrain.checkpoint.run import NonFiniteError, StopSignals, due, open_for_run, run_meta
from meshtrain.checkpoint.targets import abstract_target, abstract_train_state, mesh_meta

__all__ = [
    "UNREADABLE_SUFFIX",
    "CheckpointConfig",
    "CheckpointManager",
    "CheckpointWarning",
    "NonFiniteError",
    "Restored",
    "StopSignals",
    "abstract_target",
    "abstract_train_state",
    "due",
    "mesh_meta",
    "open_for_run",
    "restore",
    "run_meta",
]
