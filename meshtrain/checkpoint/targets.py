"""What a checkpoint records about its mesh, and whether a saved state fits a target."""

from __future__ import annotations

from typing import Any

import jax

from meshtrain._tree import path_str
from meshtrain.mesh import mesh_sizes
from meshtrain.state import TrainState


def mesh_meta(mesh: jax.sharding.Mesh) -> dict:
    """The facts about a mesh a checkpoint records: axis sizes, device count, platform."""
    sizes = {axis: int(n) for axis, n in mesh_sizes(mesh).items()}
    platform = mesh.devices.flat[0].platform
    return {"axes": sizes, "devices": int(mesh.devices.size), "platform": platform}


def layout_mismatch(saved: Any, target: TrainState) -> str | None:
    """Compares the saved tree's paths, shapes and dtypes with the target's; None if they fit."""
    saved_leaves = {
        path_str(p): (tuple(m.shape), str(m.dtype))
        for p, m in jax.tree_util.tree_leaves_with_path(saved)
    }
    want = {
        path_str(p): (tuple(x.shape), str(x.dtype))
        for p, x in jax.tree_util.tree_leaves_with_path(target._asdict())
    }
    problems = [f"{k} missing from the checkpoint" for k in want if k not in saved_leaves]
    problems += [f"{k} not in the model" for k in saved_leaves if k not in want]
    problems += [
        f"{k} is {saved_leaves[k][1]}{list(saved_leaves[k][0])} in the checkpoint, "
        f"{want[k][1]}{list(want[k][0])} in the model"
        for k in want
        if k in saved_leaves and saved_leaves[k] != want[k]
    ]
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "the model does not match: " + "; ".join(problems[:3]) + more
