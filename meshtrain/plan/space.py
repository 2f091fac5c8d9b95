"""The candidate layouts a planner searches: mesh factorisations, strategies, remat policies
and pipeline microbatches."""

from __future__ import annotations

import dataclasses
import itertools

from meshtrain.mesh import AXES, DATA, FSDP, PIPE, TENSOR

REMATS = ("none", "save-dots", "full")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout to model: axis sizes, a strategy preset, a remat policy, microbatches."""

    pipe: int
    data: int
    fsdp: int
    tensor: int
    strategy: str
    remat: str = "none"
    microbatches: int = 0  # 0: no pipeline
    schedule: str = "1f1b"

    @property
    def sizes(self) -> dict[str, int]:
        """Axis sizes in mesh order (every axis, size 1 where unused)."""
        named = {PIPE: self.pipe, DATA: self.data, FSDP: self.fsdp, TENSOR: self.tensor}
        return {a: named.get(a, 1) for a in AXES}

    @property
    def mesh(self) -> str:
        """``data=4,tensor=2`` (axes of size 1 left out; ``data=1`` for one device)."""
        parts = [f"{a}={s}" for a, s in self.sizes.items() if s > 1]
        return ",".join(parts) or "data=1"

    def describe(self) -> str:
        """``mesh · strategy · remat`` (and the schedule)."""
        extra = f" · {self.schedule} m={self.microbatches}" if self.pipe > 1 else ""
        return f"{self.mesh} · {self.strategy} · remat {self.remat}{extra}"


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    n: int,
    *,
    max_pipe: int | None = None,
    max_tensor: int | None = None,
    remats: tuple[str, ...] = REMATS,
    microbatch_factors: tuple[int, ...] = (2, 4),
) -> list[Candidate]:
    """Every layout of n devices over pipe × data × fsdp × tensor.

    Strategies are not repeated where they coincide: dp and zero1 keep fsdp = 1, fsdp keeps
    data = 1 (it shards over both batch axes anyway), hsdp needs both; "+tp" is added
    whenever tensor > 1. A pipeline runs 1F1B with `microbatch_factors` × pipe microbatches.

    Args:
        n: devices.
        max_pipe, max_tensor: largest pipe and tensor sizes to try (None: n).
        remats: remat policies to try.
        microbatch_factors: microbatches per stage to try when pipe > 1.

    Returns:
        The candidates.
    """
    out = []
    for pipe in divisors(n):
        if max_pipe and pipe > max_pipe:
            continue
        for tensor in divisors(n // pipe):
            if max_tensor and tensor > max_tensor:
                continue
            rest = n // (pipe * tensor)
            splits = [("dp", rest, 1), ("zero1", rest, 1), ("fsdp", 1, rest)]
            splits += [("hsdp", d, rest // d) for d in divisors(rest) if 1 < d < rest]
            if rest == 1:
                splits = [("dp", 1, 1)]
            tp = "+tp" if tensor > 1 else ""
            micro = [f * pipe for f in microbatch_factors] if pipe > 1 else [0]
            for (strategy, data, fsdp), remat, m in itertools.product(splits, remats, micro):
                out.append(Candidate(pipe, data, fsdp, tensor, strategy + tp, remat, m))
    return out
