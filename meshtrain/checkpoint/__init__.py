"""Checkpoints: asynchronous, atomic orbax saves, and restores onto any mesh, with fallback.

A checkpoint directory holds one sub-directory per saved step (``<dir>/<step>/``), each with
four items:

- ``state``: the `TrainState` (step, parameters, optimizer state, other model variables);
- ``data``: the training data iterator's position (JSON);
- ``meta``: the JSON facts the run hands down: its config, the mesh it was written from, the
  seed;
- ``digests``: digests of every array and of the two JSON items, checked when the step is
  read, so that a step whose bytes changed is skipped like an unreadable one (`integrity`).

Orbax writes each step into a temporary directory and renames it when complete, so a step
exists only once fully written; leftovers of an interrupted save are removed when a manager
opens the directory for writing. Restoring reads every array straight into the layout of an
abstract target (`meshtrain.state.abstract_target`), on any mesh and any device count, never
through one host's full copy. A step that cannot be read is reported and skipped for the
previous one; it is never deleted or overwritten (see `CheckpointManager.set_aside`).

- `manager`: `CheckpointConfig`, `CheckpointManager`, `restore`;
- `dirs`: which directory a run writes to, and what must hold before it does;
- `targets`: the mesh facts a checkpoint records, and layout comparisons;
- `digests`: the digests of arrays (on their devices, whatever their sharding) and JSON items;
- `integrity`: the ``digests`` item: what a step records at save and checks at restore.
"""

from meshtrain.checkpoint.dirs import (
    checkpoint_directory,
    directory_problems,
    holds_run,
    open_for_run,
)
from meshtrain.checkpoint.manager import (
    UNREADABLE_SUFFIX,
    CheckpointConfig,
    CheckpointManager,
    CheckpointWarning,
    Restored,
    restore,
)
from meshtrain.checkpoint.targets import layout_mismatch, mesh_meta

__all__ = [
    "UNREADABLE_SUFFIX",
    "CheckpointConfig",
    "CheckpointManager",
    "CheckpointWarning",
    "Restored",
    "checkpoint_directory",
    "directory_problems",
    "holds_run",
    "layout_mismatch",
    "mesh_meta",
    "open_for_run",
    "restore",
]
