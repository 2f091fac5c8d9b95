"""What a stage can do in one slot of the hand-scheduled executor, one `lax.switch` branch each.

A slot runs a forward, a backward (zb-h1: its input pass), zb-h1's weight pass, or nothing;
every branch returns a `PassOut` typed alike, so the switch's branches agree. The loss head
runs after the model's last chunk's forward, on the last stage only, under a `lax.cond`: the
branch is taken by some stages and not others, so it must hold no collective across stages.
The head's weights and logits are partitioned only over the axes the compiler keeps (tensor,
fsdp), whose groups lie within one stage, and the logits are kept whole over tensor (see
`meshtrain.pipeline.run.pipeline_loss_and_grads`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshtrain.layout import varying
from meshtrain.pipeline.buffers import fill
from meshtrain.pipeline.chunk import Chunk


class PassOut(NamedTuple):
    """What a slot's pass makes: the forward's output and statistics, the input's cotangent,
    the residuals to keep, zb-h1's handover and the chunk's gradient (zeros where the pass
    makes none, NaN in an idle slot while poisoning)."""

    y: jax.Array
    stats: dict
    dx: jax.Array
    kept: list
    hand: list
    g_chunk: dict


class Kit(NamedTuple):
    """What the passes and the loss head share, fixed before the slot loop.

    Attributes:
        run: runs a chunk forward and backward.
        x0: one microbatch's activation, as typed in a slot.
        stats_zero: zeros shaped like the stage statistics.
        chunk_zero: zeros shaped like one chunk's parameters.
        head_zero: zeros shaped like the head's parameters.
        d_stats: the statistics' cotangent of one microbatch.
        residuals: the residual rings as they start (their spare entries stay zero).
        res_axes: the manual axes each residual varies over.
        hosted: whether each residual's ring is in host memory.
        handovers: zb-h1's handover rings as they start (none otherwise).
        hand_axes: the manual axes each handover entry varies over.
        poison: fill idle outputs with NaN (testing).
    """

    run: Chunk
    x0: jax.Array
    stats_zero: dict
    chunk_zero: dict
    head_zero: dict
    d_stats: dict
    residuals: list
    res_axes: list[frozenset[str]]
    hosted: list[bool]
    handovers: list
    hand_axes: list[frozenset[str]]
    poison: bool


def _idle(kit: Kit, c, x_in, side, cot, stored, hand) -> PassOut:
    """Nothing to do: zeros (NaN while poisoning), the host rings' spare entries."""
    nan_like = lambda a: fill(a, kit.poison)  # noqa: E731
    return PassOut(
        nan_like(kit.x0),
        kit.stats_zero,
        nan_like(kit.x0),
        [r[-1] if h else nan_like(r[0]) for r, h in zip(kit.residuals, kit.hosted, strict=True)],
        [nan_like(h[0]) for h in kit.handovers],
        jax.tree.map(nan_like, kit.chunk_zero),
    )


def _unused(kit: Kit) -> list:
    """Stand-ins for the residuals a slot keeps none of: zeros, or a host ring's spare
    slot (written back to itself)."""
    return [
        b[-1] if h else jnp.zeros_like(b[0]) for b, h in zip(kit.residuals, kit.hosted, strict=True)
    ]


def _forward(kit: Kit, c, x_in, side, cot, stored, hand) -> PassOut:
    """The chunk's forward, its residuals kept."""
    y, stats, kept = kit.run.forward(c, x_in, side)
    zeros = [jnp.zeros_like(h[0]) for h in kit.handovers]
    return PassOut(y, stats, jnp.zeros_like(kit.x0), kept, zeros, kit.chunk_zero)


def _backward(kit: Kit, c, x_in, side, cot, stored, hand) -> PassOut:
    """The chunk's backward from its residuals; split (zb-h1): its input pass alone."""
    zeros = _unused(kit)
    x0, stats_zero = kit.x0, kit.stats_zero
    if kit.run.split:
        g_x, handover = kit.run.input_pass(c, stored, cot, side, kit.d_stats)
        return PassOut(jnp.zeros_like(x0), stats_zero, g_x, zeros, handover, kit.chunk_zero)
    g_chunk, g_x = kit.run.backward(c, stored, cot, side, kit.d_stats)
    return PassOut(jnp.zeros_like(x0), stats_zero, g_x, zeros, [], g_chunk)


def _weight(kit: Kit, c, x_in, side, cot, stored, hand) -> PassOut:
    """zb-h1's weight pass: the chunk's gradient from its residuals and the handover."""
    g_chunk = kit.run.weight_pass(c, stored, hand, cot, side, kit.d_stats)
    zeros = _unused(kit)
    hand_zeros = [jnp.zeros_like(h[0]) for h in kit.handovers]
    x0 = kit.x0
    return PassOut(
        jnp.zeros_like(x0), kit.stats_zero, jnp.zeros_like(x0), zeros, hand_zeros, g_chunk
    )


def _typed(kit: Kit, out: PassOut) -> PassOut:
    """A branch's outputs, typed alike in every branch: varying over every manual axis,
    except the residuals and handover, which keep their own axes."""
    y, stats, dx, kept, hand, g_chunk = out
    kept = [varying(k, a) for k, a in zip(kept, kit.res_axes, strict=True)]
    hand = [varying(h, a) for h, a in zip(hand, kit.hand_axes, strict=True)]
    return PassOut(*varying((y, stats, dx)), kept, hand, varying(g_chunk))


def slot_branches(kit: Kit) -> list[Callable[..., PassOut]]:
    """The `lax.switch` branches of a slot, indexed by phase (idle, forward, backward,
    weight), each ``(c, x_in, side, cot, stored, hand) -> PassOut``."""
    # Every branch's outputs differ between stages, so mark them so: the types must agree.
    passes = (_idle, _forward, _backward, _weight if kit.run.split else _idle)
    return [lambda *a, f=f: _typed(kit, f(kit, *a)) for f in passes]


HeadFn = Callable[[dict, jax.Array, dict], jax.Array]


def head_branches(head_fn: HeadFn, head_zero: dict):
    """The loss head's `lax.cond` branches ``(head, y, labels) -> (loss, g_head, dy)``: run
    after the model's last chunk's forward, or nothing."""

    def head_step(head, y, labels):
        loss, head_vjp = jax.vjp(lambda h, y: head_fn(h, y, labels), head, y)
        g_head, dy = head_vjp(jnp.ones_like(loss))
        return varying((loss.astype(jnp.float32), g_head, dy.astype(y.dtype)))

    def no_head(head, y, labels):
        return varying((jnp.zeros((), jnp.float32), head_zero, jnp.zeros_like(y)))

    return head_step, no_head
