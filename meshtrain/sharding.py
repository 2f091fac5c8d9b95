"""Logical axis names, the rule presets that map them to mesh axes, and sharded creation.

Models name the dimensions of their parameters and activations with *logical* names
(``("embed", "mlp")``) and never mention a mesh. A `Rules` table maps each logical name to
zero or more mesh axes. Three tables make up a strategy:

- ``params``: how parameters (and so gradients) are laid out;
- ``optimizer``: how optimizer state is laid out (differs from ``params`` only for ZeRO-1);
- ``activations``: the constraints placed on activations inside the model.

Presets (combine one data strategy with ``tp`` using ``+``, e.g. ``"fsdp+tp"``):

    dp     parameters replicated; the batch split over data × fsdp
    fsdp   ZeRO-3: parameters, gradients and optimizer state sharded over data × fsdp
    hsdp   parameters sharded over fsdp, replicated over data (hybrid sharded DP)
    zero1  parameters replicated; only optimizer state sharded over data × fsdp
    tp     Megatron: attention heads, MLP hidden and vocab split over tensor

The stacked ``layers`` dimension is always split over ``pipe``, so on a mesh with ``pipe > 1``
each pipeline stage holds its own contiguous slice of the blocks; with ``pipe = 1`` the rule
does nothing. A pipelined state is therefore the same pytree as an unpipelined one, laid out
differently, and moves between the two like any other reshard.

The tensor-parallel rules apply whenever the mesh has ``tensor > 1``, so ``--strategy fsdp``
on a mesh ``data=4,tensor=2`` means FSDP over data and Megatron over tensor.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain.mesh import AXES, BATCH_AXES, mesh_sizes

MeshAxes = str | tuple[str, ...] | None

# Logical dimension names used by meshtrain's models.
LOGICAL_AXES: dict[str, str] = {
    "batch": "examples in a batch (activations)",
    "seq": "token positions (activations)",
    "embed": "model width",
    "mlp": "feed-forward hidden width",
    "heads": "query attention heads",
    "kv_heads": "key/value attention heads (GQA groups)",
    "kv": "width of one attention head",
    "vocab": "vocabulary / output classes",
    "pos": "rows of a learned position table",
    "features": "input features of a classifier",
    "layers": "stacked layers",
}

STRATEGIES = ("dp", "fsdp", "hsdp", "zero1", "tp")
_TP_NAMES = ("mlp", "heads", "kv_heads", "vocab")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rules:
    """Logical-name → mesh-axes tables for parameters, optimizer state and activations.

    Args:
        params: layout of parameters and gradients.
        activations: constraints on activations inside the model.
        optimizer: layout of optimizer state; None means the same as ``params``.
        name: a label shown in logs.
    """

    params: Mapping[str, MeshAxes]
    activations: Mapping[str, MeshAxes]
    optimizer: Mapping[str, MeshAxes] | None = None
    name: str = "custom"

    def __post_init__(self):
        for table_name in ("params", "activations", "optimizer"):
            table = getattr(self, table_name)
            for logical, axes in (table or {}).items():
                for axis in _as_tuple(axes):
                    if axis not in AXES:
                        raise ValueError(
                            f"rules.{table_name}[{logical!r}] = {axes!r}: unknown mesh axis "
                            f"{axis!r}; mesh axes are {', '.join(AXES)}"
                        )

    @property
    def optimizer_table(self) -> Mapping[str, MeshAxes]:
        """The optimizer-state table (falls back to ``params``)."""
        return self.params if self.optimizer is None else self.optimizer


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    """``None`` → ``()``, ``"x"`` → ``("x",)``, tuples unchanged."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def rules_for(strategy: str, mesh: Mesh | None = None) -> Rules:
    """The preset `Rules` for a strategy such as ``"fsdp"`` or ``"hsdp+tp"``.

    Args:
        strategy: one data strategy from ``dp, fsdp, hsdp, zero1`` and/or ``tp``, joined by ``+``.
        mesh: when given, the strategy is checked against it (e.g. ``hsdp`` needs ``fsdp > 1``).

    Returns:
        The `Rules` for the strategy.
    """
    parts = [p.strip() for p in strategy.split("+") if p.strip()]
    unknown = [p for p in parts if p not in STRATEGIES]
    if unknown or not parts:
        raise ValueError(
            f"strategy {strategy!r}: unknown strategy {unknown[0] if unknown else ''!r}; "
            f"choose from {', '.join(STRATEGIES)}, combined with '+' (e.g. 'fsdp+tp')"
        )
    data_parts = [p for p in parts if p != "tp"]
    if len(data_parts) > 1:
        raise ValueError(
            f"strategy {strategy!r}: {' and '.join(data_parts)} both decide how parameters use "
            "the data axes; pick one of dp, fsdp, hsdp, zero1 (optionally + tp)"
        )
    data_strategy = data_parts[0] if data_parts else "dp"
    if mesh is not None:
        sizes = mesh_sizes(mesh)
        if "tp" in parts and sizes["tensor"] == 1:
            raise ValueError(
                f"strategy {strategy!r} uses tensor parallelism but the mesh has tensor=1; "
                "add tensor=N to the mesh (e.g. --mesh data=4,tensor=2)"
            )
        if data_strategy == "hsdp" and sizes["fsdp"] == 1:
            raise ValueError(
                f"strategy {strategy!r} shards parameters over the fsdp axis but the mesh has "
                "fsdp=1; add fsdp=N to the mesh (e.g. --mesh data=2,fsdp=4)"
            )

    params: dict[str, MeshAxes] = {name: None for name in LOGICAL_AXES}
    activations: dict[str, MeshAxes] = {name: None for name in LOGICAL_AXES}
    activations["batch"] = BATCH_AXES
    activations["seq"] = "seq"
    for name in _TP_NAMES:  # Megatron rules; a no-op while tensor == 1
        params[name] = "tensor"
        activations[name] = "tensor"
    # Pipeline stages own contiguous slices of the stacked layers; a no-op while pipe == 1.
    params["layers"] = "pipe"
    optimizer = None
    if data_strategy == "fsdp":
        params["embed"] = BATCH_AXES
    elif data_strategy == "hsdp":
        params["embed"] = "fsdp"
    elif data_strategy == "zero1":
        optimizer = dict(params, embed=BATCH_AXES)
    return Rules(params=params, activations=activations, optimizer=optimizer, name=strategy)


def spec_for(
    names: tuple[str | None, ...],
    table: Mapping[str, MeshAxes],
    mesh: Mesh,
    *,
    shape: tuple[int, ...] | None = None,
    where: str = "array",
) -> P:
    """Resolves logical dimension names to a `PartitionSpec` on `mesh`.

    Mesh axes of size 1 are dropped, and a mesh axis already used by an earlier dimension is not
    used again. With `shape`, each dimension is checked for divisibility by its mesh axes.
    """
    sizes = mesh_sizes(mesh)
    if shape is not None and len(names) != len(shape):
        raise ValueError(
            f"{where}: {len(names)} logical names {names} for an array of rank {len(shape)} "
            f"(shape {shape}); give one name (or None) per dimension"
        )
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(names):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(
                f"{where}: unknown logical axis {name!r}; the rules know "
                f"{', '.join(sorted(table))}; add {name!r} to the rules or rename it"
            )
        axes = tuple(a for a in _as_tuple(table[name]) if sizes.get(a, 1) > 1 and a not in used)
        used.update(axes)
        if shape is not None and axes:
            ways = math.prod(sizes[a] for a in axes)
            if shape[dim] % ways:
                split = " × ".join(f"{a}={sizes[a]}" for a in axes)
                raise ValueError(
                    f"{where}: dimension {dim} ({name}={shape[dim]}) is not divisible by mesh "
                    f"{split} = {ways}; change the size to a multiple of {ways} or shard "
                    f"{name!r} over fewer devices"
                )
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*spec)


def _path_str(path) -> str:
    """``('blocks', 'attn', 'q')`` → ``'blocks/attn/q'``."""
    return "/".join(str(getattr(k, "key", k)) for k in path)


def abstract_model(ctor: Callable[[], nnx.Module]) -> tuple[nnx.GraphDef, nnx.State]:
    """Traces `ctor` without allocating anything: the graph and a state of shape structs."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(ctor)
    return nnx.split(abstract)


def state_specs(
    abstract_state: nnx.State, table: Mapping[str, MeshAxes], mesh: Mesh, *, warn: bool = True
) -> dict:
    """Pure-dict tree of `PartitionSpec`s for every variable in `abstract_state`.

    Variables with no logical names are replicated; with ``warn`` one warning names them all.
    """
    specs: dict = {}
    unnamed = []
    for path, var in nnx.to_flat_state(abstract_state):
        shape = tuple(var.get_value().shape)
        names = var.get_metadata().get("out_sharding")
        where = f"parameter {_path_str(path)!r} {shape}"
        if names:
            spec = spec_for(tuple(names), table, mesh, shape=shape, where=where)
        else:
            spec = P()
            if isinstance(var, nnx.Param) and math.prod(shape) > 1:
                unnamed.append(_path_str(path))
        node = specs
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = spec
    if unnamed and warn:
        warnings.warn(
            f"meshtrain: {len(unnamed)} parameter(s) have no logical axis names and will be "
            f"replicated on every device: {', '.join(unnamed)}. Annotate them with "
            "nnx.with_partitioning(init, names) to shard them.",
            stacklevel=3,
        )
    return specs


def named(specs, mesh: Mesh):
    """Maps a tree of `PartitionSpec`s to `NamedSharding`s on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


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


def batch_spec(ndim: int, rules: Rules, mesh: Mesh, *, shape=None) -> P:
    """Layout of a batch array: dimension 0 is ``batch``; the others are not split."""
    names = ("batch", *([None] * (ndim - 1)))
    return spec_for(names, rules.activations, mesh, shape=shape, where="batch")


def _batch_blocks(mesh: Mesh, rules: Rules) -> tuple[int, list[int]]:
    """(blocks the batch splits into, the sorted blocks this process's devices hold)."""
    axes = _as_tuple(batch_spec(1, rules, mesh)[0])
    positions = [mesh.axis_names.index(a) for a in axes]
    shape = [mesh.devices.shape[i] for i in positions]
    me = jax.process_index()
    mine = {
        int(np.ravel_multi_index(tuple(idx[i] for i in positions), shape)) if axes else 0
        for idx, d in np.ndenumerate(mesh.devices)
        if d.process_index == me
    }
    return math.prod(shape), sorted(mine)


def process_rows(mesh: Mesh, rules: Rules, batch_size: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of a global batch that this process's devices hold.

    With the batch axes (data, fsdp) across processes each process holds its own slice; with
    ``pipe`` across processes several processes hold the same rows.

    Args:
        mesh: the device mesh.
        rules: logical-axis rules (``batch`` decides the layout).
        batch_size: the global batch size.

    Returns:
        ``(lo, hi)``: the process-local rows.
    """
    n_blocks, mine = _batch_blocks(mesh, rules)
    if batch_size % n_blocks:
        raise ValueError(
            f"batch_size={batch_size} does not split over the {n_blocks} data-parallel devices "
            f"(data × fsdp); use a multiple of {n_blocks}"
        )
    if mine != list(range(mine[0], mine[-1] + 1)):
        raise ValueError(
            f"mesh: process {jax.process_index()} holds batch blocks {mine}, not a contiguous "
            "run; build the mesh with meshtrain.make_mesh so each process gets adjacent rows"
        )
    rows = batch_size // n_blocks
    return mine[0] * rows, (mine[-1] + 1) * rows


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh, rules: Rules) -> dict[str, jax.Array]:
    """Lays a batch out on the mesh's batch axes.

    Args:
        batch: this process's rows of the global batch (see `process_rows`), as numpy arrays.
        mesh: the device mesh.
        rules: logical-axis rules; ``batch`` (and ``seq``) decide the layout.

    Returns:
        Global `jax.Array`s, split over the batch axes.
    """
    out = {}
    n_blocks, mine = _batch_blocks(mesh, rules)
    for key, local in batch.items():
        local = np.asarray(local)
        # This process holds len(mine) of the n_blocks equal blocks of the global batch.
        global_shape = (local.shape[0] * n_blocks // len(mine), *local.shape[1:])
        try:
            spec = batch_spec(local.ndim, rules, mesh, shape=global_shape)
            if local.shape[0] % len(mine):
                raise ValueError(f"{local.shape[0]} process-local rows")
        except ValueError as e:
            raise ValueError(
                f"batch[{key!r}] with global shape {global_shape}: {e}; the global batch size "
                "must be a multiple of the data-parallel devices (data × fsdp)"
            ) from None
        sharding = NamedSharding(mesh, spec)
        out[key] = jax.make_array_from_process_local_data(sharding, local, global_shape)
    return out


# --- activation constraints --------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "meshtrain_activation_rules", default=None
)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules):
    """While tracing inside this block, `constrain` lays activations out by `rules`."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def override_activations(**names: MeshAxes):
    """Inside an `activation_rules` block, lays the given logical names out differently, e.g.
    ``override_activations(vocab=None)`` keeps logits whole over the tensor axis."""
    active = _ACTIVE.get()
    if active is None:
        yield
        return
    mesh, rules = active
    changed = dataclasses.replace(rules, activations={**rules.activations, **names})
    with activation_rules(mesh, changed):
        yield


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Constrains activation `x` to the layout its logical `names` map to; a no-op outside
    `activation_rules` (so models run unchanged on one device)."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = spec_for(names, rules.activations, mesh)
    # Inside a partial-manual shard_map (a pipeline stage) the constraint must name the mesh
    # as the shard_map sees it, with its manual axes; the rules never name those.
    context = jax.sharding.get_abstract_mesh()
    target = context if context.manual_axes else mesh
    return jax.lax.with_sharding_constraint(x, NamedSharding(target, spec))
