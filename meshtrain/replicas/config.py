"""`SyncConfig`: how the data-parallel replicas synchronise.

What it refuses beside other features (pipelines, MoE, strategies without replicas, ...) is
in `meshtrain.composition.REFUSALS`.
"""

from __future__ import annotations

import dataclasses
import math

from meshtrain import validate
from meshtrain.problem import Problem

COMPRESSIONS = ("none", "bf16", "int8", "topk:FRACTION", "sign")
OUTER_OPTIMIZERS = ("average", "nesterov")


def parse_compression_spec(spec: str) -> tuple[str, float | None]:
    """``"topk:0.01"`` → ``("topk", 0.01)``; ``"int8"`` → ``("int8", None)``.

    Raises:
        ValueError: one line naming ``grad_compression``, the value and the fix.
    """
    name, _, arg = str(spec).partition(":")
    if name == "topk":
        try:
            fraction = float(arg)
        except ValueError:
            fraction = math.nan
        if not 0 < fraction <= 1:
            raise ValueError(
                f"grad_compression={spec!r}: the top-k fraction must be a number in (0, 1], "
                "e.g. --grad-compression topk:0.01"
            )
        return name, fraction
    if name not in COMPRESSIONS or arg:
        raise ValueError(
            f"grad_compression={spec!r}: choose from {', '.join(COMPRESSIONS)} "
            "(e.g. --grad-compression int8)"
        )
    return name, None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """How the data-parallel replicas exchange what they learn (all off by default).

    The replicas are the devices along the replica axes: the batch axes no parameter is split
    over (``data`` and ``fsdp`` under dp and zero1, ``data`` under hsdp).

    Args:
        grad_compression: how the gradient is reduced over the replicas: ``none`` (the
            compiler's all-reduce), ``bf16``, ``int8`` (block-wise scaled), ``topk:FRACTION``
            (the largest entries of each tensor) or ``sign`` (1 bit and a scale per tensor).
        error_feedback: keep what a lossy scheme dropped on each replica (a residual in the
            train state) and add it to the next step's gradient.
        sync_every: local SGD: replicas take this many optimizer steps on their own data, then
            synchronise their parameters; None (the default) synchronises every step through
            the gradient.
        outer_optimizer: at each synchronisation, ``average`` sets the parameters to the
            replicas' mean (periodic model averaging); ``nesterov`` applies the mean change
            through Nesterov momentum SGD (DiLoCo).
        outer_lr: the outer optimizer's learning rate (``nesterov``).
        outer_momentum: the outer optimizer's momentum (``nesterov``).
        staleness: apply the gradient computed this many steps earlier (a deterministic model
            of stale-synchronous and asynchronous training); 0 is synchronous.
    """

    grad_compression: str = "none"
    error_feedback: bool = True
    sync_every: int | None = None
    outer_optimizer: str = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    staleness: int = 0

    def __post_init__(self):
        validate.reject(self)

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        v = validate
        problems = v.check(
            "grad_compression", self.grad_compression, parse_compression_spec, self.grad_compression
        )
        if self.sync_every is not None:
            problems += v.positive(
                "sync_every",
                self.sync_every,
                example=16,
                note="local SGD synchronises every H steps; leave it out for synchronous training",
            )
        problems += v.one_of(
            "outer_optimizer", self.outer_optimizer, OUTER_OPTIMIZERS, example="nesterov"
        )
        problems += v.above("outer_lr", self.outer_lr, 0, example=0.7, note="DiLoCo uses 0.7")
        problems += v.in_range(
            "outer_momentum", self.outer_momentum, 0, 1, closed="[)", example=0.9
        )
        return problems + v.non_negative(
            "staleness", self.staleness, example=4, note="0 is synchronous"
        )

    @property
    def compression(self) -> str:
        """The compression scheme's name (``topk`` without its fraction)."""
        return parse_compression_spec(self.grad_compression)[0]

    @property
    def compresses(self) -> bool:
        """The gradient is reduced by meshtrain's own collectives (any scheme but ``none``)."""
        return self.compression != "none"

    @property
    def local(self) -> bool:
        """Local SGD / DiLoCo is on."""
        return self.sync_every is not None

    @property
    def keeps_residual(self) -> bool:
        """A residual is kept: a lossy scheme (every one but ``none``) with error feedback."""
        return self.compresses and self.error_feedback
