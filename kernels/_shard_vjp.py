"""A call run per shard and differentiated per shard: jax's own VJP of the call, kept inside
the kernels' manual region, under a custom VJP around the region.

`_common.sharded` runs a call on each device's block; differentiating the region from outside
is what a nested region (a pipeline stage's, the replicas' own step's) cannot do. The Pallas
kernels avoid it with a backward kernel of their own. A call whose backward jax defines (cuDNN's
fused attention) gets the same shape here: the forward rule runs ``jax.vjp`` of the call on
each shard and keeps that shard's residuals (stacked along a new leading dimension over the
region's axes); the backward rule runs each shard's pullback on its own residuals, then sums
every cotangent over the axes its argument was not split over but the output was (the
transpose of handing one whole argument to every shard for its part). Nothing is recomputed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshtrain.kernels import _common


def sharded_autodiff(fn, args, names, out_names, *, with_axes: bool = False):
    """``fn(*args)`` per shard as `_common.sharded` runs it (same arguments), differentiable
    in every layout, nested regions included: each shard's backward is jax's VJP of `fn`.

    Integer arguments (segment ids) get no cotangent. `out_names` names one output.
    """
    region = _common.plan_region(args, names, with_axes=with_axes)
    call = region.bind(fn)
    if region.mesh is None:
        return call(*args)  # no region: jax differentiates `fn` itself
    out_spec = region.spec(out_names)
    stacked = P(_common.entry_of(region.axes))  # one residual block per shard
    floats = [jnp.issubdtype(a.dtype, jnp.inexact) for a in args]
    pullback_tree = []

    def forward_shard(*xs):
        out, pullback = jax.vjp(call, *xs)
        leaves, tree = jax.tree.flatten(pullback)
        pullback_tree[:] = [tree]
        return out, [leaf[None] for leaf in leaves]

    def backward_shard(*blocks):
        *residuals, d_out = blocks
        pullback = jax.tree.unflatten(pullback_tree[0], [r[0] for r in residuals])
        grads = pullback(d_out)
        return tuple(
            _sum_unsplit(g, spec, out_spec)
            for g, spec, f in zip(grads, region.in_specs, floats, strict=True)
            if f
        )

    @jax.custom_vjp
    def run(*xs):
        return region.run(call, xs, out_spec)

    def run_fwd(*xs):
        out, residuals = region.run(forward_shard, xs, (out_spec, stacked))
        return out, (xs, residuals)

    def run_bwd(saved, d_out):
        xs, residuals = saved
        specs = tuple(s for s, f in zip(region.in_specs, floats, strict=True) if f)
        backward = region._replace(in_specs=(*(stacked for _ in residuals), out_spec))
        grads = backward.run(backward_shard, (*residuals, d_out), specs)
        float_xs = [x for x, f in zip(xs, floats, strict=True) if f]
        typed = iter(_common.typed_like(tuple(grads), tuple(float_xs)))
        return tuple(next(typed) if f else None for f in floats)

    run.defvjp(run_fwd, run_bwd)
    return run(*args)


def _sum_unsplit(g, spec: P, out_spec: P):
    """A shard's cotangent summed over the axes its argument was whole on and the output
    split over: there each shard used the same argument for its own part of the output (where
    the output is whole too, every shard computed the same thing, and one copy is the
    cotangent)."""
    split = {a for entry in spec for a in _common.axes_of(entry)}
    out = [a for entry in out_spec for a in _common.axes_of(entry)]
    whole = tuple(a for a in out if a not in split)
    return lax.psum(g, whole) if whole else g
