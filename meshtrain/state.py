"""The train state: its type, where each part lives on a mesh, and how it is created.

A `TrainState` is a plain pytree: the step count, the model's parameters as a nested dict
(float32 master weights), the optax state, and any other model variables. The NNX graph is
kept aside (`nnx.GraphDef`) and merged back inside the step, so the state can go straight to
`jax.jit` shardings, optax and orbax.

This module sits below both `meshtrain.train` (which creates and updates states) and
`meshtrain.checkpoint` (which saves and restores them), and imports neither.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.layout import Rules, named, state_specs


class TrainState(NamedTuple):
    """Everything a step reads and writes."""

    step: jax.Array  # int32 []: batches consumed
    params: dict  # nnx.Param variables, nested dict of float32 arrays
    opt_state: Any  # optax state
    rest: dict  # other model variables (usually empty)
    comm: dict = {}  # replica-sync state (meshtrain.replicas): residuals, local SGD; usually empty


def abstract_model(ctor: Callable[[], nnx.Module]) -> tuple[nnx.GraphDef, nnx.State]:
    """Traces `ctor` without allocating anything: the graph and a state of shape structs."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(ctor)
    return nnx.split(abstract)


def create_sharded_model(ctor: Callable[[], nnx.Module], mesh: Mesh, rules: Rules) -> nnx.Module:
    """Builds an NNX model whose variables are born sharded: no device ever holds it whole.

    The constructor is traced abstractly, the layout is resolved from `rules`, and the
    initialisers run inside one `jax.jit` whose outputs carry that layout.

    Args:
        ctor: a zero-argument function returning the model, e.g. ``lambda: GPT(cfg, rngs=...)``.
        mesh: the device mesh.
        rules: logical-axis rules (see `rules_for`).

    Returns:
        The model, every variable a `jax.Array` laid out on `mesh`.
    """
    graphdef, abstract_state = abstract_model(ctor)
    shardings = named(state_specs(abstract_state, rules.params, mesh), mesh)

    def init():
        with nnx.use_eager_sharding(False):
            return nnx.to_pure_dict(nnx.state(ctor()))

    pure = jax.jit(init, out_shardings=shardings)()
    nnx.replace_by_pure_dict(abstract_state, pure)
    return nnx.merge(graphdef, abstract_state)


def state_layout(
    param_vars: nnx.State, rest_vars: nnx.State, tx, mesh: Mesh, rules: Rules
) -> tuple[dict, dict, Any, TrainState]:
    """Where each part of a train state lives on `mesh`.

    Returns:
        ``(params, rest, abstract_opt_state, shardings)``: the variables as pure dicts, the
        optimizer state's shapes, and a `TrainState` of `NamedSharding`s.
    """
    param_sh = named(state_specs(param_vars, rules.params, mesh, warn=False), mesh)
    rest_sh = named(state_specs(rest_vars, rules.params, mesh, warn=False), mesh)
    opt_param_specs = state_specs(param_vars, rules.optimizer_table, mesh, warn=False)
    params, rest = nnx.to_pure_dict(param_vars), nnx.to_pure_dict(rest_vars)
    abstract_opt = jax.eval_shape(tx.init, params)
    opt_specs = optax.tree_map_params(
        tx,
        lambda _, spec: spec,
        abstract_opt,
        opt_param_specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
    replicated = NamedSharding(mesh, P())
    shardings = TrainState(replicated, param_sh, named(opt_specs, mesh), rest_sh)
    return params, rest, abstract_opt, shardings


def init_train_state(
    ctor: Callable[[], nnx.Module],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules: Rules,
    params: dict | None = None,
) -> tuple[nnx.GraphDef, TrainState, TrainState]:
    """Creates the model and optimizer state directly sharded on `mesh`.

    Args:
        ctor: zero-argument model constructor.
        tx: the optax transformation.
        mesh: the device mesh.
        rules: logical-axis rules; ``rules.optimizer_table`` lays out the optimizer state.
        params: parameters to start from instead of the initialisers' (the nested dict of
            ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``, e.g. a pretrained checkpoint's);
            moved into the state's layout. The parameter initialisers then never run.

    Returns:
        ``(graphdef, state, shardings)``, where `shardings` is a `TrainState` of `NamedSharding`s.
    """
    if params is None:
        model = create_sharded_model(ctor, mesh, rules)
    else:
        graphdef, abstract = abstract_model(ctor)
        model = nnx.merge(graphdef, abstract)
        if jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param))):  # other variables: initialise
            model = create_sharded_model(ctor, mesh, rules)
    graphdef, param_vars, rest_vars = nnx.split(model, nnx.Param, ...)
    initial, rest, _, shardings = state_layout(param_vars, rest_vars, tx, mesh, rules)
    if params is not None:
        shapes = lambda tree: jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), tree)
        if shapes(dict(params)) != shapes(initial):
            raise ValueError(
                "init_train_state: params do not fit the model (their tree, shapes or dtypes "
                "differ from the model's parameters); build them for this model's config"
            )
        initial = jax.device_put(dict(params), shardings.params)
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(initial)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return graphdef, TrainState(step, initial, opt_state, rest), shardings


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
