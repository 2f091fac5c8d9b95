"""The projected data-parallel scaling efficiency of `scaling.py` and notebook 10, from
meshtrain's α-β cost model (`meshtrain.costmodel`). Everything here is PROJECTED, never
measured.

The gradient all-reduce over ``gpus`` data-parallel devices is costed by
`meshtrain.costmodel.collective_time`, which takes the fastest of its algorithms (ring, tree,
recursive doubling, Rabenseifner, and the two-level hierarchical one once the group leaves a
node) on the device profile's links; the profiles (`meshtrain.costmodel.PROFILES`) cite their
datasheet sources, and their latencies α are assumptions.

Compute time per step is ``training FLOPs / (peak × utilisation)`` with the profile's dense
bf16 peak and an ASSUMED utilisation (default 0.4).
"""

from __future__ import annotations

from meshtrain.costmodel import collective_time, profile


def projected_efficiency(
    *,
    gpus: int,
    flops_per_step: float,
    grad_bytes: float,
    utilisation: float = 0.4,
    device: str = "h100",
) -> dict:
    """Weak-scaling efficiency of data parallelism on `gpus` GPUs (same batch per GPU).

    Args:
        gpus: data-parallel GPUs.
        flops_per_step: training FLOPs one GPU does per step (its share of the batch).
        grad_bytes: bytes of the gradients all-reduced each step.
        utilisation: the share of the peak the compute reaches (an assumption).
        device: a `meshtrain.costmodel` profile name.

    Returns:
        compute and all-reduce times (s), the all-reduce algorithm the model picked, and the
        efficiency with no overlap (``compute / (compute + all-reduce)``) and with full
        overlap (``compute / max(compute, all-reduce)``).
    """
    hw = profile(device)
    compute = flops_per_step / (hw.peak_flops * utilisation)
    comm, algorithm = collective_time("all-reduce", ("data",), grad_bytes, {"data": gpus}, hw)
    return {
        "gpus": gpus,
        "compute_s": compute,
        "allreduce_s": comm,
        "algorithm": algorithm,
        "efficiency_no_overlap": compute / (compute + comm),
        "efficiency_full_overlap": compute / max(compute, comm),
    }
