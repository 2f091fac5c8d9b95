"""Ring attention over one manual mesh axis, with a custom VJP.

Each device keeps its queries and passes its key/value block (with the blocks' global positions)
around the ring with ``ppermute``; after n steps every query has met every key, and the
partial results merge by their log-sum-exp (`blocks.merge`). The backward runs the ring again:
the key/value blocks travel with their gradient accumulators, each device adds the
contribution of its queries, and after n hops the accumulators are home.

Why a custom VJP rather than autodiff of the ring: autodiff keeps every step's probabilities
(n blocks of [T/n, T/n] scores per layer, the same [T/n, T] as gathering all keys), while the
custom backward keeps only q, k, v, the output and the log-sum-exp, and recomputes each
step's scores. The README's "Context parallelism" section gives the compiled memory of both.

Shape suffixes as in `blocks`.
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from meshtrain.context_parallel import blocks


def _shift(x, axis: str, n: int):
    """Sends each device's block to the next device on the ring."""
    return lax.ppermute(x, axis, [(j, (j + 1) % n) for j in range(n)])


def _forward(q, k, v, q_pos, k_pos, axis, causal, window, impl):
    """(out float32, lse) of the ring: the own block, then n − 1 hops of k, v and their
    positions, one step at a time (a scan, so one step's scores are live at once)."""
    n = lax.axis_size(axis)
    block = functools.partial(blocks.attend, causal=causal, window=window, impl=impl)
    o, lse = block(q, k, v, q_pos, k_pos)

    def hop(carry, _):
        k, v, k_pos, o, lse = carry
        k, v, k_pos = (_shift(x, axis, n) for x in (k, v, k_pos))
        o_s, lse_s = block(q, k, v, q_pos, k_pos)
        o, lse = blocks.merge(o, lse, o_s, lse_s)
        return (k, v, k_pos, o, lse), None

    (_, _, _, o, lse), _ = lax.scan(hop, (k, v, k_pos, o, lse), length=n - 1)
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def ring(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, axis, causal, window, impl="xla"):
    """Attention of this device's queries against the keys of every device on `axis`.

    Call inside a region manual over `axis`; each device passes its own blocks.

    Args:
        q_BTHK: this device's queries.
        k_BSGK, v_BSGK: this device's keys and values.
        q_pos_T, k_pos_S: the global positions of those queries and keys (int32).
        axis: the manual mesh axis the sequence is split over.
        causal: mask keys after each query's position.
        window: with `causal`, only keys (t − window, t] are seen; None: all.
        impl: how each block is computed (`blocks.IMPLS`).

    Returns:
        [B, T, H, K] in the dtype of `v_BSGK`.
    """
    o, _ = _forward(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, axis, causal, window, impl)
    return o.astype(v_BSGK.dtype)


def _ring_fwd(q, k, v, q_pos, k_pos, axis, causal, window, impl):
    o, lse = _forward(q, k, v, q_pos, k_pos, axis, causal, window, impl)
    o = o.astype(v.dtype)
    return o, (q, k, v, q_pos, k_pos, o, lse)


def _ring_bwd(axis, causal, window, impl, res, do_BTHK):
    q, k, v, q_pos, k_pos, o, lse_BGRT = res
    n = lax.axis_size(axis)
    delta_BGRT = blocks.delta(o, do_BTHK, k.shape[2])

    def grads(k, v, k_pos):
        """This device's queries' contributions (dq, dk, dv) against one k/v block."""
        return blocks.grads(
            q, k, v, q_pos, k_pos, do_BTHK, lse_BGRT, delta_BGRT,
            causal=causal, window=window, impl=impl,
        )  # fmt: skip

    dq, dk, dv = grads(k, v, k_pos)

    def hop(carry, _):
        # The k/v block moves on with its gradient accumulators.
        k, v, k_pos, dq, dk, dv = carry
        k, v, k_pos, dk, dv = (_shift(x, axis, n) for x in (k, v, k_pos, dk, dv))
        dq_s, dk_s, dv_s = grads(k, v, k_pos)
        return (k, v, k_pos, dq + dq_s, dk + dk_s, dv + dv_s), None

    (_, _, _, dq, dk, dv), _ = lax.scan(hop, (k, v, k_pos, dq, dk, dv), length=n - 1)
    dk, dv = _shift(dk, axis, n), _shift(dv, axis, n)  # the n-th hop brings them home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


ring.defvjp(_ring_fwd, _ring_bwd)


def ring_autodiff(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, axis, causal, window, impl="xla"):
    """`ring` differentiated by autodiff (kept to compare compiled memory with the custom
    VJP; see the module docstring)."""
    o, _ = _forward(q_BTHK, k_BSGK, v_BSGK, q_pos_T, k_pos_S, axis, causal, window, impl)
    return o.astype(v_BSGK.dtype)
