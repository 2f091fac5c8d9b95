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


_SCALE = "opt_state/scale"  # the loss scale of meshtrain.precision.loss_scale.LossScaleState


def layout_mismatch(saved: Any, target: TrainState) -> str | None:
    """Compares the saved tree's paths, shapes and dtypes with the target's.

    Returns:
        None if they fit; else one line naming what differs and showing the two simplest
        arrays, e.g. "a different model: 2 of 9 parameters differ (norm/scale is [64] in the
        checkpoint, [32] in the model; ...)".
    """

    def leaves(tree) -> dict[str, tuple[tuple[int, ...], str]]:
        return {
            path_str(p): (tuple(x.shape), str(x.dtype))
            for p, x in jax.tree_util.tree_leaves_with_path(tree)
        }

    have, want = leaves(saved), leaves(target._asdict())  # an empty comm has no leaves
    names = have.keys() | want.keys()
    differ = [k for k in names if have.get(k) != want.get(k)]
    if not differ:
        return None
    params = [k for k in differ if k.startswith("params/")]
    if params:
        total = sum(k.startswith("params/") for k in names)
        head, shown = f"a different model: {len(params)} of {total} parameters differ", params
    elif any(k.startswith("comm/") for k in differ):
        head, shown = (
            "other synchronisation settings (--grad-compression with error feedback, "
            f"--sync-every, --staleness): {len(differ)} arrays differ",
            differ,
        )
    elif _SCALE in differ:  # meshtrain.precision.with_loss_scale's state, in one of the two
        saved_has = _SCALE in have
        resumes = "fp16" if saved_has else "fp32, bf16 or fp8"
        head, shown = (
            f"{'' if saved_has else 'no '}loss scaling, and this run has "
            f"{'none' if saved_has else 'one'} (--precision fp16 keeps its loss scale in the "
            f"optimizer state; --precision {resumes} resumes it)",
            [_SCALE],
        )
    elif any(k.startswith("opt_state/") for k in differ):
        head, shown = f"a different optimizer: {len(differ)} optimizer-state arrays differ", differ
    else:
        head, shown = f"different model variables: {len(differ)} arrays differ", differ
    # Lowest rank first: the clearest example (a norm's scale) leads.
    shown.sort(key=lambda k: (len((want.get(k) or have[k])[0]), k))

    def describe(k: str) -> str:
        name = k.removeprefix("params/")
        if k not in have:
            return f"{name} is missing from the checkpoint"
        if k not in want:
            return f"{name} is not in the model"
        same_dtype = have[k][1] == want[k][1]
        saved_k, want_k = (("" if same_dtype else d) + str(list(s)) for s, d in (have[k], want[k]))
        return f"{name} is {saved_k} in the checkpoint, {want_k} in the model"

    more = f"; and {len(shown) - 2} more" if len(shown) > 2 else ""
    return f"{head} (" + "; ".join(map(describe, shown[:2])) + more + ")"
