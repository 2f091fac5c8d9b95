"""Abstract restore targets: the shapes, dtypes and shardings a state has on a given mesh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from meshtrain.sharding import Rules, abstract_model
from meshtrain.train.step import TrainState, state_layout


def abstract_target(like: TrainState, shardings: TrainState) -> TrainState:
    """`like`'s shapes and dtypes with `shardings` attached: the layout a restore produces.

    Args:
        like: a state, or any pytree of arrays / `ShapeDtypeStruct`s of the same structure.
        shardings: the target `NamedSharding`s (e.g. from `init_train_state` on the new mesh).

    Returns:
        A `TrainState` of `jax.ShapeDtypeStruct`s.
    """
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like, shardings
    )


def abstract_train_state(
    ctor: Callable[[], nnx.Module], tx: optax.GradientTransformation, mesh: Mesh, rules: Rules
) -> TrainState:
    """The state `init_train_state` would build on `mesh`, as sharded shape structs.

    Nothing is allocated or compiled: this is the target for restoring a checkpoint onto a
    new mesh without first initialising a model there.

    Args:
        ctor: zero-argument model constructor.
        tx: the optax transformation.
        mesh: the target mesh.
        rules: the target logical-axis rules.

    Returns:
        A `TrainState` of `jax.ShapeDtypeStruct`s carrying `NamedSharding`s.
    """
    graphdef, state = abstract_model(ctor)
    _, param_vars, rest_vars = nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)
    params, rest, opt_state, shardings = state_layout(param_vars, rest_vars, tx, mesh, rules)
    shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt_state, rest)
    return abstract_target(shapes, shardings)


def mesh_meta(mesh: jax.sharding.Mesh) -> dict:
    """The facts about a mesh a checkpoint records: axis sizes, device count, platform."""
    sizes = dict(zip(mesh.axis_names, (int(n) for n in mesh.devices.shape), strict=True))
    platform = mesh.devices.flat[0].platform
    return {"axes": sizes, "devices": int(mesh.devices.size), "platform": platform}


def _path(keys) -> str:
    """A pytree path as ``a/b/0/c``, the same whether a level is a dict, list or NamedTuple."""
    parts = []
    for k in keys:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def layout_mismatch(saved: Any, target: TrainState) -> str | None:
    """Compares the saved tree's paths, shapes and dtypes with the target's; None if they fit."""
    saved_leaves = {
        _path(p): (tuple(m.shape), str(m.dtype))
        for p, m in jax.tree_util.tree_leaves_with_path(saved)
    }
    want = {
        _path(p): (tuple(x.shape), str(x.dtype))
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
