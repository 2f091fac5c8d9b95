"""How a stage runs one chunk of layers forward and backward in the hand-scheduled executor.

The forward is a `jax.vjp` of the chunk whose residuals the executor keeps in a ring buffer;
the backward rebuilds the vjp from them. When the backward is split (zb-h1) the chunk runs
layer by layer, so that each layer's backward can be cut into its input pass and its weight
pass (`meshtrain.pipeline.split`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain._compat import varying_axes
from meshtrain.layout import varying
from meshtrain.pipeline.split import split_backward

# (chunk params [Lc, ...], x [b, T, D], side {name: [b, T]}) -> (y [b, T, D], stats {name: []})
StageFn = Callable[[dict, jax.Array, dict], tuple[jax.Array, dict]]


class Chunk:
    """How a stage runs one chunk forward and backward: whole (one vjp of the chunk) or, when
    the backward is split (zb-h1), layer by layer, so that each layer's backward can be cut
    into its input pass and its weight pass (`meshtrain.pipeline.split`)."""

    def __init__(self, stage_fn: StageFn, split: bool):
        self.stage_fn, self.split = stage_fn, split
        self.structure: list = []  # (treedef, where) of the vjp, learnt while tracing

    def _vjp(self, c, x, side):
        """The chunk's (or layer's) output and statistics, its kept residuals, and how to
        rebuild its vjp. Residuals that are the parameters themselves are not kept (they
        don't change between forward and backward); the backward puts them back."""
        (y, stats), vjp = jax.vjp(lambda c, x: self.stage_fn(c, x, side), c, x)
        leaves, treedef = jax.tree.flatten(vjp)
        params = jax.tree.leaves(c)
        where = [next((j for j, w in enumerate(params) if leaf is w), None) for leaf in leaves]
        kept = [leaf for leaf, j in zip(leaves, where, strict=True) if j is None]
        self.structure[:] = [(treedef, where, jax.tree.map(varying_axes, stats))]
        return y, stats, kept

    def forward(self, c, x, side):
        """``(y, stats, kept)``; split: the layers' residuals stacked [Lc, ...]."""
        if not self.split:
            return self._vjp(c, x, side)

        def layer(x, c_l):
            y, stats, kept = self._vjp(_one(c_l), x, side)
            return y, (kept, stats)

        y, (kept, stats) = lax.scan(layer, x, c)
        return y, jax.tree.map(lambda a: a.sum(0), stats), kept

    def _backward_fn(self, c, n_kept: int, d_stats):
        """The flat backward of one vjp: ``(*params, *kept, ct) -> [g_x, *g_params]``."""
        treedef, where, stats_axes = self.structure[0]
        n_p = len(jax.tree.leaves(c))
        # The statistics' cotangent typed as they are (they vary over pipe inside a slot).
        d_stats = jax.tree.map(lambda d, axes: varying(d, axes), d_stats, stats_axes)

        def bwd(*a):
            params, kept, ct = a[:n_p], iter(a[n_p : n_p + n_kept]), a[n_p + n_kept]
            leaves = [params[j] if j is not None else next(kept) for j in where]
            g_c, g_x = jax.tree.unflatten(treedef, leaves)((ct, d_stats))
            return [g_x, *jax.tree.leaves(g_c)]

        return bwd

    def backward(self, c, kept, ct, side, d_stats):
        """The whole backward: ``(g_chunk, g_x)``."""
        self._vjp(c, jnp.zeros_like(ct), side)  # the structure only; its math is unused
        bwd = self._backward_fn(c, len(kept), d_stats)
        g_x, *g_c = bwd(*jax.tree.leaves(c), *kept, ct)
        return jax.tree.unflatten(jax.tree.structure(c), g_c), g_x

    def _split(self, c_l, kept_l, ct, side, d_stats):
        """One layer's backward cut in two, traced on these arguments' types."""
        c1 = _one(c_l)
        self._vjp(c1, jnp.zeros_like(ct), side)
        bwd = self._backward_fn(c1, len(kept_l), d_stats)
        params = jax.tree.leaves(c1)
        args = [*params, *kept_l, ct]
        return split_backward(bwd, args, 1, len(params) + len(kept_l)), params

    def input_pass(self, c, kept, ct, side, d_stats):
        """zb-h1's B: ``(g_x, handover)``, the handover stacked over the layers."""

        def layer(ct, xs):
            c_l, kept_l = xs
            cut, params = self._split(c_l, kept_l, ct, side, d_stats)
            (g_x,), handover = cut.input_pass(*params, *kept_l, ct)
            return g_x, handover

        return lax.scan(layer, ct, (c, kept), reverse=True)

    def weight_pass(self, c, kept, handover, ct_like, side, d_stats):
        """zb-h1's W: the chunk's gradient [Lc, ...] from the residuals and the handover."""

        def layer(_, xs):
            c_l, kept_l, hand_l = xs
            cut, params = self._split(c_l, kept_l, ct_like, side, d_stats)
            g_c = cut.weight_pass([*params, *kept_l], hand_l)
            g_c = jax.tree.unflatten(jax.tree.structure(c_l), [g[0] for g in g_c])
            return None, g_c

        return lax.scan(layer, None, (c, kept, handover))[1]


def _one(c_l):
    """One layer's parameters as a chunk of one layer (a leading dimension of 1)."""
    return jax.tree.map(lambda a: a[None], c_l)
