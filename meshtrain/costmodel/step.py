"""A step-time estimate: roofline compute plus the communication that cannot hide behind it.

Compute is a roofline: the larger of FLOPs / peak and HBM bytes / bandwidth, per op class
(matrix multiplies are taken at the FLOP roof, everything else at the bandwidth roof).

**Overlap assumption.** Parameter gathers and gradient reductions are independent of the
layer computing beside them, so XLA's latency-hiding scheduler can run them during compute:
they cost only what exceeds the compute time (``overlap=1``; ``overlap=0`` exposes them all).
Tensor-parallel activation all-reduces, pipeline sends and a mixture of experts' dispatch
all-to-alls sit on the critical path (the next matmul needs their result: the experts need
their tokens) and are always exposed. A pipeline idles for its bubble fraction
b: compute is divided by (1 − b). Host transfers (offload) cost what exceeds their window of
the compute (`meshtrain.costmodel.host`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from meshtrain.costmodel.collectives import ALGORITHMS, flat_cost, hierarchical_cost
from meshtrain.costmodel.host import HostTransfer, exposed_time, transfer_time
from meshtrain.costmodel.profiles import DeviceProfile

OVERLAPPABLE = ("gradient reduction", "parameter gathers")


def placement(axes: tuple[str, ...], sizes: Mapping[str, int], per_node: int) -> tuple[int, int]:
    """(devices of one group inside a node, nodes the group spans) for a collective over
    `axes` of a mesh whose axes are laid out slowest first, `per_node` devices per node."""
    inner, g = 1, 1
    for axis in reversed(list(sizes)):
        s = sizes[axis]
        room = max(1, per_node // inner)
        here = math.gcd(s, room)
        if axis in axes:
            g *= here
        inner *= s
    p = math.prod(sizes[a] for a in axes)
    return g, max(1, p // g)


def collective_time(
    kind: str,
    axes: tuple[str, ...],
    m: float,
    sizes: Mapping[str, int],
    device: DeviceProfile,
    algorithm: str = "auto",
) -> tuple[float, str]:
    """Seconds for one collective of m bytes over mesh `axes`, and the algorithm used.

    Args:
        kind: collective kind.
        axes: mesh axes it runs over.
        m: bytes (as `flat_cost` counts them).
        sizes: mesh axis sizes (slowest first).
        device: the device profile.
        algorithm: one of `ALGORITHMS`, ``"hierarchical"``, or ``"auto"`` (the fastest).

    Returns:
        ``(seconds, algorithm)``.
    """
    p = math.prod(sizes[a] for a in axes) if axes else 1
    if p <= 1:
        return 0.0, "none"
    g, k = placement(axes, sizes, device.devices_per_node)
    link = device.intra if k == 1 else device.inter
    options = {a: flat_cost(kind, p, m, link, a) for a in ALGORITHMS}
    if k > 1 and g > 1:
        options["hierarchical"] = hierarchical_cost(kind, g, k, m, device.intra, device.inter)
    if algorithm != "auto":
        return options[algorithm], algorithm
    best = min(options, key=options.__getitem__)
    return options[best], best


@dataclasses.dataclass(frozen=True)
class CommItem:
    """One bucket of communication: its kind, axes, bytes per execution and executions per
    step (a fraction for one that runs on some steps only: 1/H for an exchange every H)."""

    bucket: str
    kind: str
    axes: tuple[str, ...]
    bytes: float
    count: float = 1


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """A modelled step.

    Attributes:
        compute_s: roofline compute time (without the bubble).
        bubble: the pipeline bubble fraction.
        comm_s: seconds per communication bucket.
        algorithms: the algorithm chosen per bucket.
        exposed_s: communication not hidden behind compute.
        total_s: the step time.
        host_s: seconds of host transfer per direction and kind (offload).
        host_exposed_s: host transfer not hidden behind compute (part of `total_s`).
    """

    compute_s: float
    bubble: float
    comm_s: dict[str, float]
    algorithms: dict[str, str]
    exposed_s: float
    total_s: float
    host_s: dict[str, float] = dataclasses.field(default_factory=dict)
    host_exposed_s: float = 0.0


def step_time(
    *,
    flops: float,
    hbm_bytes: float,
    comm: list[CommItem],
    sizes: Mapping[str, int],
    device: DeviceProfile,
    bubble: float = 0.0,
    overlap: float = 1.0,
    matmul_share: float = 0.95,
    host: Sequence[HostTransfer] = (),
) -> StepEstimate:
    """The modelled time of one step on one device (see the module docstring).

    Args:
        flops: FLOPs per device per step.
        hbm_bytes: device-memory traffic per device per step.
        comm: the communication per device per step.
        sizes: mesh axis sizes.
        device: the profile.
        bubble: the pipeline bubble fraction.
        overlap: share of the compute time that gathers and reductions can hide behind.
        matmul_share: share of the FLOPs in matrix multiplies (the rest, with all of
            `hbm_bytes`, runs at the bandwidth roof).
        host: the transfers to and from host memory per device per step (offload).

    Returns:
        A `StepEstimate`.

    Raises:
        ValueError: host transfers on a profile without a host link.
    """
    matmul = matmul_share * flops / device.peak_flops
    other = max((1 - matmul_share) * flops / device.peak_flops, hbm_bytes / device.hbm_bandwidth)
    compute = matmul + other
    comm_s: dict[str, float] = {}
    algos: dict[str, str] = {}
    for item in comm:
        t, algo = collective_time(item.kind, item.axes, item.bytes, sizes, device)
        comm_s[item.bucket] = comm_s.get(item.bucket, 0.0) + item.count * t
        algos[item.bucket] = algo
    busy = compute / (1 - bubble) if bubble < 1 else math.inf
    hidden = sum(t for b, t in comm_s.items() if b in OVERLAPPABLE)
    exposed = sum(t for b, t in comm_s.items() if b not in OVERLAPPABLE)
    exposed += max(0.0, hidden - overlap * compute)
    host_s: dict[str, float] = {}
    host_exposed = 0.0
    if host:
        if device.host is None:
            raise ValueError(
                f"device={device.name!r}: no host-link figure; offload is not modelled"
            )
        for t in host:
            key = f"{t.what} {t.direction}"
            host_s[key] = host_s.get(key, 0.0) + transfer_time(t, device.host)
        host_exposed = exposed_time(list(host), device.host, compute)
    total = busy + exposed + host_exposed
    return StepEstimate(compute, bubble, comm_s, algos, exposed, total, host_s, host_exposed)
