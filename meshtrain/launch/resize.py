"""Re-deriving a `meshtrain train` job for fewer processes: the batch axes shrink (data
first, then fsdp) and gradient accumulation grows by the same factor, so the global batch,
each microbatch's rows per device and the model's own axes (pipe, expert, seq, tensor) stay
as they were."""

from __future__ import annotations

import math
from fractions import Fraction

from meshtrain.mesh import AXES, DATA, FSDP, MeshConfig


class CannotResize(ValueError):
    """The job has no layout on fewer processes that keeps its global batch."""


def _per_replica_state(sync) -> str:
    """What the replicas' own state holds under `sync` ("" when nothing)."""
    if sync.local:
        scheme = "gossip" if sync.gossips else "federated" if sync.federates else "local SGD"
        return f"each replica's parameters and inner optimizer state ({scheme})"
    if sync.keeps_residual:
        return "error-feedback residuals (gradient compression)"
    if sync.staleness:
        return "the gradients still in flight (staleness)"
    return ""


def shrink(sizes: dict[str, int], factor: int) -> dict[str, int] | None:
    """`sizes` with data × fsdp divided by `factor`, data first; None when it cannot be."""
    take_data = math.gcd(sizes[DATA], factor)
    rest = factor // take_data
    if sizes[FSDP] % rest:
        return None
    return {**sizes, DATA: sizes[DATA] // take_data, FSDP: sizes[FSDP] // rest}


def resized(job, nproc: int, to: int, devices: int) -> tuple[str, int]:
    """The mesh and accumulation steps of `job` on `to` processes instead of `nproc`.

    Args:
        job: the `meshtrain.cli.train.TrainJob` the processes run.
        nproc: the processes it was laid out for.
        to: the processes left.
        devices: devices per process.

    Returns:
        (mesh, accum_steps): e.g. ("data=1,fsdp=2,tensor=2", 2).

    Raises:
        CannotResize: the devices lost are not a whole factor of data × fsdp, the global
            batch does not split into the larger number of microbatches, or the run keeps
            state per replica (local SGD, error feedback, staleness).
    """
    ratio = Fraction(nproc, to)
    if ratio.denominator != 1:
        raise CannotResize(f"{nproc} → {to} processes is not a whole factor")
    kept = _per_replica_state(job.sync)
    if kept:
        raise CannotResize(
            f"the run keeps {kept}, one slice per data-parallel replica, and fewer devices "
            "mean fewer replicas: no rule says how their slices merge (resume it on the same "
            "mesh, or start it without that setting)"
        )
    before = MeshConfig.parse(job.mesh).sizes(nproc * devices)
    factor = ratio.numerator
    after = shrink(before, factor)
    if after is None:
        raise CannotResize(
            f"mesh {job.mesh}: data × fsdp = {before[DATA]} × {before[FSDP]} cannot shrink by "
            f"{factor} (only the batch axes shrink)"
        )
    accum = job.train.accum_steps * factor
    rows = job.data.batch_size
    split = after[DATA] * after[FSDP] * accum
    if rows % split:
        raise CannotResize(
            f"global batch {rows} does not split into {accum} microbatches over "
            f"data × fsdp = {after[DATA] * after[FSDP]}"
        )
    mesh = ",".join(f"{a}={after[a]}" for a in AXES if after[a] != 1) or "data=1"
    return mesh, accum
