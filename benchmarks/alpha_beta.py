"""A small α-β estimate of data-parallel scaling on H100s, for `scaling.py` and notebook 10.

This is a stand-in: meshtrain's own cost model (``meshtrain.costmodel``, with the inspector's
compiled collective bytes) is being written separately; when it lands, `projected_efficiency`
is the one function to route through it. Everything here is PROJECTED, never measured.

A ring all-reduce of ``n`` bytes over ``p`` devices takes ``2(p − 1)`` steps, each sending
``n / p`` bytes: ``t = 2(p − 1)·α + 2(p − 1)/p · n / β`` (α: per-step latency, β: per-device
link bandwidth in one direction). A flat ring that leaves a node runs at the slowest link's β.

Link figures (per GPU, one direction):

- NVLink 4 within an HGX/DGX H100 node: 900 GB/s total bidirectional per GPU (NVIDIA H100
  datasheet), so 450 GB/s each way.
- Between nodes: one 400 Gb/s NDR InfiniBand ConnectX-7 port per GPU (DGX H100 system
  datasheet: 8 × 400 Gb/s), so 50 GB/s each way.
- α: not a datasheet figure; 5 µs within a node and 10 µs between nodes are ASSUMED, of the
  order NCCL's small-message latencies show.

Compute time per step is ``training FLOPs / (peak × utilisation)`` with the H100 SXM dense
bf16 peak of 989 TFLOP/s (datasheet) and an ASSUMED utilisation (default 0.4).
"""

from __future__ import annotations

H100 = {
    "peak_flops": 989e12,  # dense bf16, H100 SXM datasheet
    "gpus_per_node": 8,
    "intra": {"alpha_s": 5e-6, "beta_bytes_per_s": 450e9},  # NVLink 4 (α assumed)
    "inter": {"alpha_s": 10e-6, "beta_bytes_per_s": 50e9},  # NDR InfiniBand (α assumed)
}


def ring_allreduce_seconds(n_bytes: float, p: int, *, alpha_s: float, beta_bytes_per_s: float):
    """Time of a ring all-reduce of `n_bytes` over `p` devices (0 for one device)."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * alpha_s + 2 * (p - 1) / p * n_bytes / beta_bytes_per_s


def projected_efficiency(
    *,
    gpus: int,
    flops_per_step: float,
    grad_bytes: float,
    utilisation: float = 0.4,
    profile: dict = H100,
) -> dict:
    """Weak-scaling efficiency of data parallelism on `gpus` GPUs (same batch per GPU).

    Args:
        gpus: data-parallel GPUs.
        flops_per_step: training FLOPs one GPU does per step (its share of the batch).
        grad_bytes: bytes of the gradients all-reduced each step.
        utilisation: the share of the peak the compute reaches (an assumption).
        profile: the hardware figures (`H100`).

    Returns:
        compute and all-reduce times (s), and the efficiency with no overlap
        (``compute / (compute + all-reduce)``) and with full overlap
        (``compute / max(compute, all-reduce)``).
    """
    link = profile["intra"] if gpus <= profile["gpus_per_node"] else profile["inter"]
    compute = flops_per_step / (profile["peak_flops"] * utilisation)
    comm = ring_allreduce_seconds(grad_bytes, gpus, **link)
    return {
        "gpus": gpus,
        "compute_s": compute,
        "allreduce_s": comm,
        "efficiency_no_overlap": compute / (compute + comm),
        "efficiency_full_overlap": compute / max(compute, comm),
    }
