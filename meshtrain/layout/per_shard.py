"""A region differentiated per shard: jax's own VJP of the per-device code, kept inside the
region, under a custom VJP around it.

jax differentiates a manual region from outside by splitting it into a forward and a backward
region and passing the residuals between them with specs over every manual axis of the mesh;
inside an enclosing region (a pipeline stage, the replicas' own step) those specs name axes
the enclosing region already holds, which the partitioner rejects. Here the forward rule runs
``jax.vjp`` of the per-device code on each shard and returns that shard's residuals stacked
along a new leading dimension over the region's own axes only; the backward rule runs each
shard's pullback on its own residuals, then sums every cotangent over the axes its argument
was not split over but the output was (the transpose of handing one whole argument to every
shard for its part). Nothing is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshtrain._compat import varying_axes
from meshtrain.layout.rules import axes_of, entry_of

__all__ = ["autodiff_per_shard", "typed_like"]

# run(fn, args, in_specs, out_specs): fn(*args) per shard, in a region over the axes
Runner = Callable[[Callable, tuple, tuple, object], object]


def autodiff_per_shard(
    fn: Callable, args: tuple, *, in_specs: tuple, out_spec: P, axes: Iterable[str], run: Runner
):
    """``fn(*args)`` per shard, run by `run`, differentiable inside any enclosing region.

    `fn` returns one array laid out by `out_spec`; integer arguments (positions, segment ids)
    get no cotangent. `axes` are the region's own mesh axes, the ones the residuals stack over.
    """
    stacked = P(entry_of(tuple(axes)))  # one residual block per shard
    floats = [jnp.issubdtype(a.dtype, jnp.inexact) for a in args]
    pullback_tree = []

    def forward_shard(*xs):
        out, pullback = jax.vjp(fn, *xs)
        leaves, tree = jax.tree.flatten(pullback)
        pullback_tree[:] = [tree]
        return out, [leaf[None] for leaf in leaves]

    def backward_shard(*blocks):
        *residuals, d_out = blocks
        pullback = jax.tree.unflatten(pullback_tree[0], [r[0] for r in residuals])
        grads = pullback(d_out)
        return tuple(
            _sum_unsplit(g, spec, out_spec)
            for g, spec, f in zip(grads, in_specs, floats, strict=True)
            if f
        )

    @jax.custom_vjp
    def region(*xs):
        return run(fn, xs, in_specs, out_spec)

    def region_fwd(*xs):
        out, residuals = run(forward_shard, xs, in_specs, (out_spec, stacked))
        return out, (xs, residuals)

    def region_bwd(saved, d_out):
        xs, residuals = saved
        specs = tuple(s for s, f in zip(in_specs, floats, strict=True) if f)
        ins = (*(stacked for _ in residuals), out_spec)
        grads = run(backward_shard, (*residuals, d_out), ins, specs)
        float_xs = [x for x, f in zip(xs, floats, strict=True) if f]
        typed = iter(typed_like(tuple(grads), tuple(float_xs)))
        return tuple(next(typed) if f else None for f in floats)

    region.defvjp(region_fwd, region_bwd)
    return region(*args)


def _sum_unsplit(g, spec: P, out_spec: P):
    """A shard's cotangent summed over the axes its argument was whole on and the output
    split over: there each shard used the same argument for its own part of the output (where
    the output is whole too, every shard computed the same thing, and one copy is the
    cotangent)."""
    split = {a for entry in spec for a in axes_of(entry)}
    out = [a for entry in out_spec for a in axes_of(entry)]
    whole = tuple(a for a in out if a not in split)
    return lax.psum(g, whole) if whole else g


def typed_like(grads, primals):
    """A custom VJP's cotangents given the types of their primals.

    Inside a region manual over some axes (a pipeline stage), a backward rule must return
    each cotangent varying over exactly the manual axes its primal varies over. A cotangent
    that varies over fewer is marked; one that varies over more (its primal was the same on
    every device of an axis, its uses were not) is summed over the extra axes, the transpose
    of that implicit broadcast. None entries (integer primals) stay None.
    """

    def fit(g, x):
        if g is None:
            return None
        want, have = varying_axes(x), varying_axes(g)
        extra = tuple(sorted(have - want))
        if extra:
            g = lax.psum(g, extra)
        missing = tuple(sorted(want - varying_axes(g)))
        return lax.pcast(g, missing, to="varying") if missing else g

    return tuple(fit(g, x) for g, x in zip(grads, primals, strict=True))
