"""Context-parallel attention inside an enclosing manual region: a pipeline stage, the
replicas' own step.

There jax cannot differentiate the attention's region from outside (its split of the region
would name the enclosing axes in the residuals' specs), so each shard is differentiated
inside it (`meshtrain.layout.per_shard.autodiff_per_shard`). The region is manual over every
axis the enclosing one leaves, as the kernels' regions are, so that only the per-device code
runs inside: each argument is split as the layout splits it (batch over the batch axes, heads
over tensor, the sequence over ``seq``). With fewer
key/value heads than tensor shards each shard picks the ones its query heads use, as the
flash kernel does (`meshtrain.kernels._flash_shards.local_kv_heads`); their gradients are
summed back over tensor on the way out.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from meshtrain.kernels._common import plan_region
from meshtrain.kernels._flash_shards import KV_NAMES, Q_NAMES, SEG_NAMES, local_kv_heads
from meshtrain.layout.manual import nested_unchecked
from meshtrain.layout.per_shard import autodiff_per_shard
from meshtrain.mesh import SEQ


def nested_attention(per_device: Callable, args: tuple) -> jax.Array:
    """``per_device(q, k, v, positions, *segments)`` per shard, differentiable inside an
    enclosing manual region; `args` are the attention's arrays as `context_attention` has
    them (the sequence split over ``seq``)."""
    names = (Q_NAMES, KV_NAMES, KV_NAMES, (None,), SEG_NAMES)[: len(args)]
    region = plan_region(args, names, with_axes=True)
    axes = {name: split for name, split in region.resolved.items() if split}
    specs = tuple(_over_seq(spec, name) for spec, name in zip(region.in_specs, names, strict=True))
    heads = args[0].shape[2]

    def shard(q, k, v, *rest):
        k, v = local_kv_heads(q, k, v, heads=heads, axes=axes)
        return per_device(q, k, v, *rest)

    def run(fn, xs, in_specs, out_specs):
        return nested_unchecked(fn, xs, axes=region.axes, in_specs=in_specs, out_specs=out_specs)

    return autodiff_per_shard(
        shard, args, in_specs=specs, out_spec=specs[0], axes=region.axes, run=run
    )


def _over_seq(spec: P, names: tuple) -> P:
    """`spec` with the sequence dimension (the one after batch; the only one of positions)
    split over ``seq``."""
    entries = list(spec)
    entries[1 if len(names) > 1 else 0] = SEQ
    return P(*entries)
