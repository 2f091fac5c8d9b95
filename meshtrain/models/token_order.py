"""The order attention sees a row's tokens in: the balanced (zig-zag) order under context
parallelism, else their own; a packed batch's segment ids and each token's RoPE angles follow
it. Shared by the attention of `meshtrain.models.gpt` and the latent attention of
`meshtrain.models.mla`."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from meshtrain import context_parallel
from meshtrain.models import layers


class TokenOrder(NamedTuple):
    """What `token_order` returns."""

    context: Any  # the active context parallelism (`context_parallel.active_context`), or None
    order: jax.Array | None  # the tokens' positions in their row; None: 0..T−1
    segment_ids_BT: jax.Array | None  # the packed batch's segment ids in that order
    cos: jax.Array | None  # RoPE tables per token ([T, W/2] or [B, T, W/2]); None: no RoPE
    sin: jax.Array | None


def token_order(
    T: int,
    segment_ids_BT: jax.Array | None,
    positions_BT: jax.Array | None,
    rope_width: int | None = None,
    rope_theta: float = 10_000.0,
    llama3: tuple | None = None,
) -> TokenOrder:
    """The order of a row's T tokens, the packed batch's segment ids in it, and the RoPE tables
    (of `rope_width` dims; none when None) at each token's position: `positions_BT` when given
    (a packed batch's, in the row's plain order), else its index in the row."""
    cp = context_parallel.active_context()
    order = None if cp is None else context_parallel.order(T, cp.n)
    if order is not None:  # the packed batch's entries follow the tokens' balanced order
        if segment_ids_BT is not None:
            segment_ids_BT = segment_ids_BT[:, order]
        if positions_BT is not None:
            positions_BT = positions_BT[:, order]
    if rope_width is None:
        return TokenOrder(cp, order, segment_ids_BT, None, None)
    cos, sin = layers.rope_tables(T, rope_width, rope_theta, llama3=llama3)
    if positions_BT is not None:  # a position is never past its row's: T rows suffice
        cos, sin = cos[positions_BT], sin[positions_BT]
    elif order is not None:
        cos, sin = cos[order], sin[order]
    return TokenOrder(cp, order, segment_ids_BT, cos, sin)
