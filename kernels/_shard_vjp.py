"""A call run per shard and differentiated per shard, in the kernels' manual region.

`_common.sharded` runs a call on each device's block; differentiating the region from outside
is what a nested region (a pipeline stage's, the replicas' own step's) cannot do. The Pallas
kernels avoid it with a backward kernel of their own. A call whose backward jax defines (cuDNN's
fused attention) is differentiated per shard instead
(`meshtrain.layout.per_shard.autodiff_per_shard`): nothing is recomputed.
"""

from __future__ import annotations

from meshtrain.kernels import _common
from meshtrain.layout.per_shard import autodiff_per_shard


def sharded_autodiff(fn, args, names, out_names, *, with_axes: bool = False):
    """``fn(*args)`` per shard as `_common.sharded` runs it (same arguments), differentiable
    in every layout, nested regions included: each shard's backward is jax's VJP of `fn`
    (`meshtrain.layout.per_shard.autodiff_per_shard`).

    Integer arguments (segment ids) get no cotangent. `out_names` names one output.
    """
    region = _common.plan_region(args, names, with_axes=with_axes)
    call = region.bind(fn)
    if region.mesh is None:
        return call(*args)  # no region: jax differentiates `fn` itself

    def run(f, xs, in_specs, out_specs):
        return region._replace(in_specs=in_specs).run(f, xs, out_specs)

    return autodiff_per_shard(
        call, tuple(args), in_specs=region.in_specs, out_spec=region.spec(out_names),
        axes=region.axes, run=run,
    )  # fmt: skip
