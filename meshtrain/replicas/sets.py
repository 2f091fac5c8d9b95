"""Per-leaf replica sets: which axes each parameter is synchronised over.

The step that synchronises the replicas itself runs in a region manual over the *sync axes*:
the replica axes (`Rules.replica_axes`: batch axes no parameter is split over) and, for a
mixture of experts, ``expert`` too, which splits the batch and the expert weights at once.
Inside that region every device has its own rows, so every gradient is per device until
meshtrain reduces it. A leaf is reduced over the sync axes it is not split over: the dense
weights of an MoE over data and expert, its expert weights (split over expert) over data only.

The model runs per shard over the split axes (the MoE's dispatch sends tokens to the experts'
shards by an all-to-all over ``expert``), so a leaf split over one of them reaches the region
as its own block.

Under pipelines (``pipe > 1``) the region is manual over ``pipe`` too, the *stage* axis: each
stage holds its own layers, and the pipeline's loop runs inside the region (its own region
would be manual over pipe and the replica axes, the same axes). The embedding and the head run
on every stage; their gradients come out of the loop already summed over the stages, so no
leaf is reduced over ``pipe``: the reduction (and its compression) is the one after the loop.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshtrain.layout import Rules, axes_of, entry_of
from meshtrain.mesh import EXPERT, PIPE


@dataclasses.dataclass(frozen=True)
class ReplicaSets:
    """The sync axes of a layout and the replica set of each leaf.

    Args:
        sizes: the mesh's axis sizes.
        axes: the sync axes, in the order the batch is split over them (its rows enter the
            region split over them, each device its own).
        split: those of `axes` that split some parameters (``expert``), whose leaves come
            into the region as blocks.
        stages: ``("pipe",)`` under pipelines: manual too, but never reduced over.
        mesh: the device mesh of `sizes`, where the steps that synchronise the replicas
            (`meshtrain.replicas.local_step`, `meshtrain.replicas.reduced_grads`) run their
            regions; None where only the replica sets are asked for.
    """

    sizes: Mapping[str, int]
    axes: tuple[str, ...]
    split: tuple[str, ...] = ()
    stages: tuple[str, ...] = ()
    mesh: Mesh | None = None

    def __post_init__(self):
        for name in ("axes", "split", "stages"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def mesh_for(self, caller: str) -> Mesh:
        """`mesh`, refused with one line naming `caller` where it is None."""
        if self.mesh is None:
            raise ValueError(
                f"{caller}: sets has no mesh; build it with replica_sets(rules, sizes, mesh=mesh) "
                "or ReplicaSets(..., mesh=mesh)"
            )
        return self.mesh

    @property
    def manual(self) -> tuple[str, ...]:
        """The region's manual axes: the stage axis and the sync axes."""
        return (*self.stages, *self.axes)

    @property
    def devices(self) -> int:
        """N: the devices across the sync axes (each holds its own rows)."""
        return math.prod(self.sizes[a] for a in self.axes)

    def leaf_axes(self, spec) -> tuple[str, ...]:
        """The axes a leaf laid out by `spec` (None: replicated) is reduced over."""
        named = {a for e in (spec or ()) for a in axes_of(e)}
        return tuple(a for a in self.axes if a not in self.split or a not in named)

    def count(self, spec) -> int:
        """R: how many replicas a leaf laid out by `spec` has."""
        return math.prod(self.sizes[a] for a in self.leaf_axes(spec))

    def block_spec(self, spec) -> P:
        """`spec` with only the region's axes kept: how the leaf enters the region."""
        return P(*(_only(e, self.manual) for e in (spec or ())))

    def stacked_spec(self, spec) -> P:
        """How a per-replica stack ``(R, *shape)`` of a leaf laid out by `spec` enters the
        region: dim 0 over the leaf's replica axes, the rest as `block_spec`."""
        return P(_only(self.leaf_axes(spec), self.axes), *self.block_spec(spec))

    def specs(self, tree, param_specs):
        """`param_specs`, or for `tree` every leaf replicated where it is None (refused
        when a sync axis splits some leaves: which ones is not known then)."""
        if param_specs is None:
            if self.split:
                raise ValueError(
                    f"a step synchronised over {', '.join(self.axes)} needs the parameters' "
                    "specs (param_specs=); jit_train_step passes them"
                )
            return jax.tree.map(lambda _: None, tree)
        return param_specs


def replica_sets(rules: Rules, sizes: Mapping[str, int], mesh: Mesh | None = None) -> ReplicaSets:
    """The sync axes of `rules` on a mesh of `sizes`: the replica axes, and ``expert`` where it
    splits the batch (a mixture of experts), in the order the batch is split over them; with
    ``pipe > 1``, ``pipe`` as the stage axis. `mesh` (that mesh itself) is kept as
    `ReplicaSets.mesh`, for the steps that synchronise the replicas."""
    replicas = rules.replica_axes(sizes)
    batch = rules.batch_axes(sizes)
    if not replicas:
        return ReplicaSets(dict(sizes), (), mesh=mesh)
    split = (EXPERT,) if EXPERT in batch and EXPERT not in replicas else ()
    axes = tuple(a for a in batch if a in replicas or a in split)  # the batch's own order
    stages = (PIPE,) if sizes.get(PIPE, 1) > 1 else ()
    return ReplicaSets(dict(sizes), axes, split, stages, mesh)


def _only(entry, keep: tuple[str, ...]):
    """A spec entry with only the axes of `keep`, or None."""
    return entry_of(tuple(a for a in axes_of(entry) if a in keep))
