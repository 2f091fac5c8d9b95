"""What crosses between the stages: each tick's (slot's) permutes and the sums over ``pipe``.

A tick's permutes are a branch chosen by the tick, the same on every stage, naming only the
stage pairs it moves something between (`meshtrain.pipeline.slots`): every stage takes the
same branch and meets the same collectives.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain._compat import varying_axes
from meshtrain.layout import varying
from meshtrain.mesh import PIPE

AXIS = PIPE


def from_stage(x: jax.Array, stage: int) -> jax.Array:
    """Stage `stage`'s value of `x` on every stage: a psum with the others contributing zeros.

    The sum runs in float32: XLA's CPU backend aborts on a bfloat16 all-reduce here
    ("Invalid binary instruction opcode copy", jax 0.12).
    """
    mine = jnp.where(lax.axis_index(AXIS) == stage, x, jnp.zeros_like(x))
    return lax.psum(mine.astype(jnp.float32), AXIS).astype(x.dtype)


def stage_totals(stats: dict, rows: tuple[str, ...]) -> dict:
    """Per-stage sums of `stats` → their sum over the stages, the same on every device. A
    statistic that differs between the shards of `rows` counts as its mean over them (an MoE's
    router statistics are already reduced over the rows inside the stage, so it is none)."""

    def total(a):
        a = lax.psum(a, AXIS)
        axes = tuple(x for x in rows if x in varying_axes(a))
        return lax.pmean(a, axes) if axes else a

    return jax.tree.map(total, stats)


def size(axes) -> int:
    """The number of devices along manual `axes`."""
    return math.prod(lax.axis_size(a) for a in axes)


def pass_on(patterns, pattern, y: jax.Array) -> jax.Array:
    """The forward loop's permute of one tick: only from the stages whose output the next
    chunk uses (the others' receivers get zeros)."""

    def branch(pairs):
        return lambda y: varying(lax.ppermute(y, AXIS, list(pairs)) if pairs else jnp.zeros_like(y))

    if len(patterns) == 1:
        return branch(patterns[0])(y)
    return lax.switch(pattern, [branch(pairs) for pairs in patterns], y)


def send(patterns, pattern, y, dx):
    """The slot's permutes: only the pairs the table moves something between (the others
    receive zeros)."""

    def branch(fwd, bwd):
        def permute(y, dx):
            y_recv = lax.ppermute(y, AXIS, list(fwd)) if fwd else jnp.zeros_like(y)
            dx_recv = lax.ppermute(dx, AXIS, list(bwd)) if bwd else jnp.zeros_like(dx)
            return varying((y_recv, dx_recv))

        return permute

    branches = [branch(f, b) for f, b in patterns]
    if len(branches) == 1:
        return branches[0](y, dx)
    return lax.switch(pattern, branches, y, dx)
