"""Saving and restoring a `TrainState` with orbax, laid out on whatever mesh restores it."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from meshtrain.train.step import TrainState


def save(path: str | Path, state: TrainState, *, meta: dict | None = None) -> Path:
    """Writes `state` (and optional JSON `meta`) to directory `path`; waits until it is on disk.

    Args:
        path: the checkpoint directory; must not exist yet (nothing is overwritten).
        state: the sharded train state.
        meta: JSON-serialisable facts to keep beside it (config, mesh, ...).

    Returns:
        The absolute checkpoint path.
    """
    path = Path(path).absolute()
    if path.exists():
        raise ValueError(f"checkpoint {path} already exists; choose a new path or remove it")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "state", state._asdict())
        ckptr.wait_until_finished()
    if jax.process_index() == 0:
        (path / "meta.json").write_text(json.dumps(meta or {}, indent=2, default=str))
    return path


def restore(path: str | Path, like: TrainState, shardings: TrainState) -> TrainState:
    """Reads a state saved by `save`, laid out with `shardings` (any mesh).

    Args:
        path: the checkpoint directory.
        like: a state (or abstract state) with the target structure, shapes and dtypes.
        shardings: the target `NamedSharding`s, e.g. the ones `init_train_state` returned.

    Returns:
        The restored `TrainState`.
    """
    path = Path(path).absolute()
    if not (path / "state").exists():
        raise ValueError(
            f"checkpoint {path}: no 'state' item found; is this a meshtrain checkpoint?"
        )
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like, shardings
    )
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path / "state", target._asdict())
    return TrainState(**restored)


def read_meta(path: str | Path) -> dict:
    """The JSON metadata saved beside a checkpoint."""
    return json.loads((Path(path) / "meta.json").read_text())
