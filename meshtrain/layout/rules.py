"""Logical axis names, the `Rules` that map them to mesh axes, and the strategy presets.

Models name the dimensions of their parameters and activations with *logical* names
(``("embed", "mlp")``) and never mention a mesh. A `Rules` table maps each logical name to
mesh axes. Three tables make up a strategy:

- ``params``: how parameters (and so gradients) are laid out;
- ``optimizer``: how optimizer state is laid out (differs from ``params`` only for ZeRO-1);
- ``activations``: the constraints placed on activations inside the model.

A table entry is one of:

- ``None``: the dimension is not split;
- a mesh axis, ``"tensor"``, or a tuple of axes split together, ``("data", "fsdp")``;
- a **list of alternatives**, ``["tensor", None]``: the first whose axes divide the dimension
  is used (see `meshtrain.layout.resolve`).

Presets (combine one data strategy with ``tp`` using ``+``, e.g. ``"fsdp+tp"``)::

    dp     parameters replicated; the batch split over data × fsdp
    fsdp   ZeRO-3: parameters, gradients and optimizer state sharded over data × fsdp (the
           model width, and latent attention's latent width where it divides)
    hsdp   parameters sharded over fsdp, replicated over data (hybrid sharded DP)
    zero1  parameters replicated; only optimizer state sharded over data × fsdp
    tp     Megatron: attention heads, MLP hidden and vocab split over tensor; key/value
           heads too when tensor divides them, else replicated over tensor

The stacked ``layers`` dimension is always split over ``pipe``, so on a mesh with ``pipe > 1``
each pipeline stage holds its own contiguous slice of the blocks; with ``pipe = 1`` the rule
does nothing. The tensor-parallel rules apply whenever the mesh has ``tensor > 1``, so
``--strategy fsdp`` on a mesh ``data=4,tensor=2`` means FSDP over data and Megatron over tensor.

Uneven dimensions under tensor parallelism: ``kv_heads`` is ``["tensor", None]``, so a model
with fewer key/value heads than ``tensor`` (or a count it does not divide) keeps them whole on
every tensor shard, each shard using the ones its query heads need, as Megatron does. The
vocabulary has no such fallback (a whole vocabulary would cost a full copy of the embedding,
the head and the logits per shard); models pad it instead (`GPTConfig.vocab_multiple`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from meshtrain import validate
from meshtrain.mesh import AXES, DATA, EXPERT, FSDP, PIPE, SEQ, TENSOR, mesh_sizes
from meshtrain.problem import Problem, raise_if

MeshAxes = str | tuple[str, ...] | None
Entry = MeshAxes | list[MeshAxes]  # one layout, or alternatives tried in order

# Logical dimension names used by meshtrain's models.
LOGICAL_AXES: dict[str, str] = {
    "batch": "examples in a batch (activations)",
    "seq": "token positions (activations)",
    "embed": "model width",
    "mlp": "feed-forward hidden width",
    "heads": "query attention heads",
    "kv_heads": "key/value attention heads (GQA groups)",
    "kv": "width of one attention head",
    "latent": "low-rank latent of latent attention (split like embed where it divides)",
    "vocab": "vocabulary / output classes",
    "pos": "rows of a learned position table",
    "features": "input features of a classifier",
    "layers": "stacked layers",
    "expert": "experts of a mixture-of-experts block",
}

STRATEGIES = ("dp", "fsdp", "hsdp", "zero1", "tp")
BATCH_AXES: tuple[str, ...] = (DATA, FSDP)  # the presets' batch axes
# Megatron rules: split over tensor; key/value heads replicated where tensor does not divide them.
_TP_RULES: dict[str, Entry] = {
    "mlp": TENSOR,
    "heads": TENSOR,
    "kv_heads": [TENSOR, None],
    "vocab": TENSOR,
}


def axes_of(entry: MeshAxes) -> tuple[str, ...]:
    """``None`` → ``()``, ``"x"`` → ``("x",)``, tuples unchanged."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def entry_of(axes: tuple[str, ...]) -> MeshAxes:
    """The spec entry that splits over `axes`, as `axes_of` reads it back: ``()`` → ``None``,
    ``("x",)`` → ``"x"``, longer tuples unchanged."""
    return axes[0] if len(axes) == 1 else (tuple(axes) or None)


def alternatives(entry: Entry) -> list[MeshAxes]:
    """A table entry as its list of alternatives (a single layout is a list of one)."""
    return list(entry) if isinstance(entry, list) else [entry]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rules(validate.Checked):
    """Logical-name → mesh-axes tables for parameters, optimizer state and activations.

    Args:
        params: layout of parameters and gradients.
        activations: constraints on activations inside the model; ``batch`` also decides how
            batches are split over devices.
        optimizer: layout of optimizer state; None means the same as ``params``.
        name: a label shown in logs.
        context_parallel: how attention runs when ``seq > 1``: ``ring``, ``allgather`` or
            ``ulysses`` (see `meshtrain.context_parallel`); checked by the run check.
    """

    params: Mapping[str, Entry]
    activations: Mapping[str, Entry]
    optimizer: Mapping[str, Entry] | None = None
    name: str = "custom"
    context_parallel: str = "ring"

    def problems(self) -> list[Problem]:
        """Entries that name an unknown mesh axis; an empty list when none."""
        return [
            problem
            for table_name in ("params", "activations", "optimizer")
            for logical, entry in (getattr(self, table_name) or {}).items()
            for option in alternatives(entry)
            for axis in axes_of(option)
            for problem in validate.require(
                axis in AXES,
                f"rules.{table_name}[{logical!r}]",
                entry,
                f"unknown mesh axis {axis!r}; mesh axes are {', '.join(AXES)}",
            )
        ]

    @property
    def optimizer_table(self) -> Mapping[str, Entry]:
        """The optimizer-state table (falls back to ``params``)."""
        return self.params if self.optimizer is None else self.optimizer

    def batch_axes(self, sizes: Mapping[str, int]) -> tuple[str, ...]:
        """The mesh axes (of size > 1) a batch is split over: the first layout of ``batch``."""
        entry = alternatives(self.activations.get("batch"))[0]
        return tuple(a for a in axes_of(entry) if sizes.get(a, 1) > 1)

    def replica_axes(self, sizes: Mapping[str, int]) -> tuple[str, ...]:
        """The batch axes no parameter is split over: each device there holds whole replicas
        of the parameters it holds (data for hsdp; data and fsdp for dp and zero1; none for
        fsdp)."""
        named = {a for e in self.params.values() for o in alternatives(e) for a in axes_of(o)}
        return tuple(a for a in self.batch_axes(sizes) if a not in named)

    def describe(self, sizes: Mapping[str, int]) -> str:
        """The run summary's part: the strategy and, where ``seq > 1``, the context-parallel
        algorithm, e.g. ``strategy hsdp+tp · context parallel ring over seq=2``."""
        seq = sizes.get(SEQ, 1)
        context = f" · context parallel {self.context_parallel} over seq={seq}" if seq > 1 else ""
        return f"strategy {self.name}{context}"

    def batch_ways(self, sizes: Mapping[str, int]) -> int:
        """How many ways a batch is split (e.g. data × fsdp for the presets)."""
        ways = 1
        for a in self.batch_axes(sizes):
            ways *= sizes[a]
        return ways


def auto_strategy(mesh) -> str:
    """The strategy ``"auto"`` stands for on `mesh` (a `Mesh` or a dict of axis sizes):
    ``hsdp`` when both ``data`` and ``fsdp`` are split, ``fsdp`` when only ``fsdp`` is, else
    ``dp``; with ``+tp`` when ``tensor > 1``."""
    sizes = mesh if isinstance(mesh, Mapping) else mesh_sizes(mesh)
    fsdp, data = sizes.get(FSDP, 1) > 1, sizes.get(DATA, 1) > 1
    strategy = "hsdp" if fsdp and data else "fsdp" if fsdp else "dp"
    return strategy + ("+tp" if sizes.get(TENSOR, 1) > 1 else "")


def rules_for(strategy: str, mesh=None, *, context_parallel: str = "ring") -> Rules:
    """The preset `Rules` for a strategy such as ``"fsdp"`` or ``"hsdp+tp"``.

    Args:
        strategy: one data strategy from ``dp, fsdp, hsdp, zero1`` and/or ``tp``, joined by
            ``+``; or ``"auto"`` (needs `mesh`), the strategy `auto_strategy` picks for it.
        mesh: when given (a `Mesh` or a dict of axis sizes), the strategy is checked against it
            (e.g. ``hsdp`` needs ``fsdp > 1``).
        context_parallel: the attention algorithm over ``seq`` (`Rules.context_parallel`).

    Returns:
        The `Rules` for the strategy (named by the preset ``"auto"`` chose).
    """
    raise_if(strategy_problems(strategy, mesh))
    if strategy == "auto":
        strategy = auto_strategy(mesh)
    parts = [p.strip() for p in strategy.split("+") if p.strip()]
    data_strategy = next((p for p in parts if p != "tp"), "dp")
    params: dict[str, Entry] = {name: None for name in LOGICAL_AXES}
    activations: dict[str, Entry] = {name: None for name in LOGICAL_AXES}
    activations["batch"] = BATCH_AXES
    activations["seq"] = SEQ
    for name, entry in _TP_RULES.items():  # a no-op while tensor == 1
        params[name] = alternatives(entry) if isinstance(entry, list) else entry
        activations[name] = alternatives(entry) if isinstance(entry, list) else entry
    # Pipeline stages own contiguous slices of the stacked layers; a no-op while pipe == 1.
    params["layers"] = PIPE
    # Experts live on their own shards; the expert axis also splits the batch (as in GShard),
    # so every device routes its own tokens. Both are no-ops while expert == 1.
    params["expert"] = activations["expert"] = EXPERT
    activations["batch"] = BATCH_AXES + (EXPERT,)
    optimizer: dict[str, Entry] | None = None
    # A latent dim (latent attention's q_b, kv_b) is split as embed is, where that divides it
    # and no other dim of the weight (embed itself, in q_a and kv_a) took those axes first.
    if data_strategy == "fsdp":
        params["embed"] = BATCH_AXES
        params["latent"] = [BATCH_AXES, None]
    elif data_strategy == "hsdp":
        params["embed"] = FSDP
        params["latent"] = [FSDP, None]
    elif data_strategy == "zero1":
        optimizer = params | {"embed": BATCH_AXES, "latent": [BATCH_AXES, None]}
    return Rules(
        params=params,
        activations=activations,
        optimizer=optimizer,
        name=strategy,
        context_parallel=context_parallel,
    )


def strategy_problems(strategy: str, mesh=None) -> list[Problem]:
    """Why `strategy` is not a valid preset (on `mesh`, when given); empty when it is."""
    if not isinstance(strategy, str):
        return [Problem("strategy", strategy, "must be a string such as 'fsdp+tp'")]
    if strategy == "auto":
        return (
            []
            if mesh is not None
            else [Problem("strategy", "auto", "picks from the mesh: pass mesh=")]
        )
    parts = [p.strip() for p in strategy.split("+") if p.strip()]
    unknown = [p for p in parts if p not in STRATEGIES]
    if unknown or not parts:
        return [
            Problem(
                "strategy",
                strategy,
                f"unknown strategy {unknown[0] if unknown else ''!r}; choose from "
                f"{', '.join(STRATEGIES)}, combined with '+' (e.g. --strategy fsdp+tp)",
            )
        ]
    data_parts = [p for p in parts if p != "tp"]
    if len(data_parts) > 1:
        return [
            Problem(
                "strategy",
                strategy,
                f"{' and '.join(data_parts)} both decide how parameters use the data axes; "
                "pick one of dp, fsdp, hsdp, zero1 (optionally + tp)",
            )
        ]
    if mesh is None:
        return []
    sizes = mesh if isinstance(mesh, Mapping) else mesh_sizes(mesh)
    if "tp" in parts and sizes.get(TENSOR, 1) == 1:
        return [
            Problem(
                "strategy",
                strategy,
                "uses tensor parallelism but the mesh has tensor=1; add tensor=N to the mesh "
                "(e.g. --mesh data=4,tensor=2)",
            )
        ]
    if data_parts == ["hsdp"] and sizes.get(FSDP, 1) == 1:
        return [
            Problem(
                "strategy",
                strategy,
                "shards parameters over the fsdp axis but the mesh has fsdp=1; add fsdp=N to "
                "the mesh (e.g. --mesh data=2,fsdp=4)",
            )
        ]
    return []
