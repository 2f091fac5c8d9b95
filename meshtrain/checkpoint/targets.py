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
    """Compares the saved tree's paths, shapes and dtypes with the target's.

    Returns:
        None if they fit; else one line naming what differs and showing the two simplest
        arrays, e.g. "a different model: 2 of 9 parameters differ (norm/scale is [64] in the
        checkpoint, [32] in the model; ...)".
    """

    def leaves(tree) -> dict[str, tuple[tuple[int, ...], str]]:
        return {
            _path(p): (tuple(x.shape), str(x.dtype))
            for p, x in jax.tree_util.tree_leaves_with_path(tree)
        }

    have, want = leaves(saved), leaves(target._asdict())
    names = have.keys() | want.keys()
    differ = [k for k in names if have.get(k) != want.get(k)]
    if not differ:
        return None
    params = [k for k in differ if k.startswith("params/")]
    if params:
        total = sum(k.startswith("params/") for k in names)
        head, shown = f"a different model: {len(params)} of {total} parameters differ", params
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
