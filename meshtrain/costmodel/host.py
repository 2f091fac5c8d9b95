"""What moving data between a device and its host's memory costs a step.

Offload moves bytes each way over the host link (`DeviceProfile.host`), which carries both
directions at once. Each direction may run beside some of the step's compute, its window: the
remat residuals a policy moves to host are written during the forward and fetched during the
backward, so they cost only what exceeds those passes; the optimizer state is fetched for the
update once the backward has freed its activations and written back after it, with nothing
beside it. What exceeds its window is exposed and adds to the step.
"""

from __future__ import annotations

import dataclasses

from meshtrain.costmodel.profiles import Link

FORWARD_SHARE = 1 / 3  # the forward's share of a step's FLOPs (backward twice the forward)


@dataclasses.dataclass(frozen=True)
class HostTransfer:
    """Bytes one device moves in one direction per step, in `copies` transfers, and the share
    of the step's compute they can run beside (0: none)."""

    what: str
    direction: str  # "to host" or "to device"
    bytes: float
    window: float = 0.0
    copies: int = 1


def transfer_time(t: HostTransfer, link: Link) -> float:
    """Seconds the transfer takes on `link` (α per copy plus bytes over the bandwidth)."""
    if t.bytes <= 0:
        return 0.0
    return t.copies * link.alpha + t.bytes / link.bandwidth


def exposed_time(transfers: list[HostTransfer], link: Link, compute_s: float) -> float:
    """Seconds of host transfer the step waits for: per direction and window, what the
    transfers take beyond their window of `compute_s` (the two directions run at once)."""
    spans: dict[tuple[str, float], float] = {}
    for t in transfers:
        key = (t.direction, t.window)
        spans[key] = spans.get(key, 0.0) + transfer_time(t, link)
    return sum(max(0.0, s - window * compute_s) for (_, window), s in spans.items())
