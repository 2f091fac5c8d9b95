"""What one MoE layer's dispatch costs on one device per training step: the experts' FLOPs,
the all-to-all bytes across ``expert`` shards, and the buffers kept for the backward.

Notation: N tokens on the device's batch rows, k = top_k, E experts, S = ``expert`` shards,
L = E/S local experts, D = d_model, F = an expert's hidden width, b = bytes per exchanged
element, cf = capacity_factor, A = N·k choices, R = the grouped matmul's rows per tile.

- **Active expert FLOPs**: three matmuls of 2·D·F per choice forward, 6·D·F·A, and twice
  that backward: 18·D·F·A per step.
- **capacity** computes every slot, used or not: cf × active. Its buffers carry cf·A rows:
  4·cf·A·D·b·(S−1)/S bytes leave the device (dispatch and combine, forward and backward).
- **dropless** with the tiled grouped matmul: each local expert's rows are padded to whole
  tiles, at most L·(R−1) padding rows beside the A_here rows its experts receive (A when the
  routing is balanced): FLOPs ≤ active × (1 + L·(R−1)/A). With XLA's ``ragged_dot`` (impl
  ``xla``), the CPU compiler multiplies every row by every local expert: rows·L·18·D·F,
  rows = A at S = 1 and S·A under the padded exchange (E × active either way); elsewhere it
  is taken at the active cost.
- **dropless exchange** over S > 1: on GPUs the ragged exchange sends each destination
  exactly its rows, 4·A·D·b·(S−1)/S; elsewhere the padded exchange sizes each destination's
  buffer for all A choices, S × that.

On CPU the experts run in float32 whatever the compute dtype (XLA's CPU compiler cannot
differentiate the bfloat16 dispatch), so b is 4 there.
"""

from __future__ import annotations

import dataclasses

from meshtrain.costmodel.profiles import DeviceProfile
from meshtrain.kernels import grouped_matmul as gmm
from meshtrain.problem import Problem, RunCheckError

ROUTER_BYTES = 8  # float32 router logits and probabilities, per expert and token


def tile_rows(device: DeviceProfile, rows: float, groups: int) -> int:
    """The grouped matmul's rows per tile on `device` for `rows` rows over `groups` local
    experts (`meshtrain.kernels.grouped_matmul.tile_rows`)."""
    return gmm.tile_rows(int(rows), groups, backend="gpu" if device.is_gpu else "cpu")


@dataclasses.dataclass(frozen=True)
class DispatchCost:
    """One MoE layer's dispatch on one device for one training step (forward and backward).

    Attributes:
        dispatch: ``"capacity"`` or ``"dropless"``.
        exchange: ``"none"`` (one shard), ``"capacity"`` (the capacity buffers), ``"padded"``
            or ``"ragged"``.
        impl: the grouped matmul (``"tiled"`` or ``"xla"``; ``"-"`` for capacity).
        tile_rows: rows per tile of the tiled grouped matmul.
        active_flops: the chosen experts' FLOPs, 18·D·F·A.
        flops: what the dispatch computes.
        buffer_bytes: one all-to-all's buffer on this device.
        all_to_all_bytes: bytes that leave the device: 4 exchanges × buffer × (S−1)/S.
        activation_bytes: the dispatch's buffers kept for the backward, but for the experts'
            hidden activations.
        hidden_bytes: the experts' hidden activations kept for the backward (split over
            ``tensor`` with the experts' hidden width).
    """

    dispatch: str
    exchange: str
    impl: str
    tile_rows: int
    active_flops: float
    flops: float
    buffer_bytes: float
    all_to_all_bytes: float
    activation_bytes: float
    hidden_bytes: float

    @property
    def factor(self) -> float:
        """Computed expert FLOPs over the active ones."""
        return self.flops / self.active_flops if self.active_flops else 1.0

    @property
    def sent_bytes(self) -> float:
        """Bytes one exchange sends off the device."""
        return self.all_to_all_bytes / 4


def exchanged_itemsize(cfg, device: DeviceProfile) -> int:
    """Bytes per element the experts compute and exchange in (float32 on CPU)."""
    if device.platform == "cpu" or cfg.dtype not in ("bfloat16", "float16"):
        return 4
    return 2


def dispatch_costs(
    cfg, *, tokens: float, shards: int, device: DeviceProfile, tile: int | None = None
) -> DispatchCost:
    """The FLOPs, all-to-all bytes and buffers of one MoE layer's dispatch (see the module
    docstring for the formulas).

    Args:
        cfg: the `MoEConfig` (its ``dispatch``, ``capacity_factor``, widths and experts; a
            ``grouped_impl`` of ``"xla"`` selects XLA's ``ragged_dot``).
        tokens: N, the tokens on the device's batch rows.
        shards: S, the ``expert`` axis size (must divide ``n_experts``).
        device: the profile; GPUs exchange ragged, the others padded.
        tile: rows per tile (default `tile_rows` of the device).

    Returns:
        A `DispatchCost`.

    Raises:
        RunCheckError: an ``expert`` size that does not divide ``n_experts``.
    """
    E, k, D, F = cfg.n_experts, cfg.top_k, cfg.d_model, cfg.expert_dim
    if shards < 1 or E % shards:
        raise RunCheckError(
            [
                Problem(
                    "mesh.expert",
                    shards,
                    f"does not divide n_experts={E}; use an expert axis that divides {E}",
                )
            ]
        )
    S, L, A = shards, E // shards, tokens * k
    b = exchanged_itemsize(cfg, device)
    R = tile or tile_rows(device, tokens * k, E // max(shards, 1))
    active = 18 * D * F * A
    leaves = (S - 1) / S
    if cfg.dispatch == "capacity":
        rows, sent, exchange, impl = cfg.capacity_factor * A, cfg.capacity_factor * A, "", "-"
        flops = cfg.capacity_factor * active
    else:
        ragged_exchange = device.is_gpu
        rows = A if S == 1 or ragged_exchange else S * A  # at the experts
        sent = rows
        exchange = "ragged" if ragged_exchange else "padded"
        impl = getattr(cfg, "grouped_impl", "tiled")
        if impl == "xla" and device.platform == "cpu":
            flops = rows * L * 18 * D * F  # every row times every local expert
        elif impl == "xla":
            flops = active
        else:
            impl = "tiled"
            flops = active * (1 + L * (R - 1) / A) if A else 0.0
    if S == 1:
        exchange, sent = "none", 0.0
    elif cfg.dispatch == "capacity":
        exchange = "capacity"
    buffer = sent * D * b
    # Kept for the backward: the rows at the experts (D), their gate, up and gated products
    # (3F), the outputs per choice (D), the block's input (D), the router's float32 values.
    kept = (rows + A + tokens) * D * b + tokens * E * ROUTER_BYTES
    return DispatchCost(
        dispatch=cfg.dispatch,
        exchange=exchange,
        impl=impl,
        tile_rows=R,
        active_flops=active,
        flops=flops,
        buffer_bytes=buffer,
        all_to_all_bytes=4 * buffer * leaves,
        activation_bytes=kept,
        hidden_bytes=rows * 3 * F * b,
    )


@dataclasses.dataclass(frozen=True)
class MoEStep:
    """The dispatch over one step on one device: the per-layer cost, the MoE layers this
    device runs, the exchanges per layer (4; 6 when remat re-runs the forward's), and the
    seconds the all-to-alls take (all exposed: the experts wait for their tokens)."""

    cost: DispatchCost
    layers: float
    exchanges: int
    seconds: float = 0.0

    @property
    def all_to_all_bytes(self) -> float:
        """Bytes this device sends in the step's dispatch all-to-alls."""
        return self.cost.sent_bytes * self.exchanges * self.layers

    def describe(self, shards: int) -> str:
        """``moe: dropless (tiled, 128-row tiles) · expert FLOPs 1.01× active · ragged exchange
        over expert=8: all-to-all 22.5 GB/step (6 per MoE layer), 54.14 ms exposed``."""
        c = self.cost
        how = "capacity" if c.dispatch == "capacity" else f"dropless ({c.impl}"
        if c.impl == "tiled":
            how += f", {c.tile_rows}-row tiles)"
        elif c.dispatch != "capacity":
            how += ")"
        head = f"moe: {how} · expert FLOPs {c.factor:.2f}× active · "
        if c.exchange == "none":
            return head + "no all-to-all (expert=1)"
        sent = self.all_to_all_bytes
        size = f"{sent / 1e9:.3g} GB" if sent >= 1e8 else f"{sent / 1e6:.3g} MB"
        return head + (
            f"{c.exchange} exchange over expert={shards}: all-to-all {size}/step "
            f"({self.exchanges} per MoE layer), {self.seconds * 1e3:.2f} ms exposed"
        )
