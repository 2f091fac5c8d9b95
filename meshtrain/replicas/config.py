"""`SyncConfig`: how the data-parallel replicas synchronise, and what keeps it from running."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from meshtrain.mesh import EXPERT, PIPE, SEQ
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
        parse_compression_spec(self.grad_compression)
        if self.sync_every is not None and (
            not isinstance(self.sync_every, int) or self.sync_every < 1
        ):
            raise ValueError(
                f"sync_every={self.sync_every!r}: local SGD synchronises every H ≥ 1 steps "
                "(e.g. --sync-every 16); leave it out for synchronous training"
            )
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(
                f"outer_optimizer={self.outer_optimizer!r}: choose from "
                f"{', '.join(OUTER_OPTIMIZERS)} (e.g. --outer-optimizer nesterov)"
            )
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr={self.outer_lr!r}: must be > 0 (DiLoCo uses 0.7)")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(
                f"outer_momentum={self.outer_momentum!r}: must be in [0, 1) (DiLoCo uses 0.9)"
            )
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(
                f"staleness={self.staleness!r}: must be a whole number of steps ≥ 0 "
                "(0 is synchronous; e.g. --staleness 4)"
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


def sync_problems(
    sync: SyncConfig, sizes: Mapping[str, int], replica_axes: tuple[str, ...], rules_name: str
) -> list[Problem]:
    """What keeps `sync` from running on a mesh of `sizes`, before anything compiles.

    Args:
        sync: the settings.
        sizes: the mesh's axis sizes.
        replica_axes: the rules' replica axes on that mesh (`Rules.replica_axes`).
        rules_name: the rules' name, for messages.

    Returns:
        One `Problem` per thing wrong.
    """
    problems = []
    if sync.local and sync.compresses:
        problems.append(
            Problem(
                "grad_compression",
                sync.grad_compression,
                "local SGD (--sync-every) exchanges parameters, not gradients; drop one of "
                "--grad-compression and --sync-every",
            )
        )
    if sync.local and sync.staleness:
        problems.append(
            Problem(
                "staleness",
                sync.staleness,
                "bounded staleness models a parameter server with synchronous replicas; drop "
                "one of --staleness and --sync-every",
            )
        )
    if not sync.local and sync.outer_optimizer != "average":
        problems.append(
            Problem(
                "outer_optimizer",
                sync.outer_optimizer,
                "the outer optimizer runs at local SGD's synchronisations; add --sync-every H",
            )
        )
    if not (sync.compresses or sync.local):
        return problems
    what = "--grad-compression" if sync.compresses else "--sync-every"
    field, value = (
        ("grad_compression", sync.grad_compression)
        if sync.compresses
        else ("sync_every", sync.sync_every)
    )
    if not replica_axes:
        mesh = ",".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "one device"
        problems.append(
            Problem(
                field,
                value,
                f"{what} works across replicas (batch axes no parameter is split over), and "
                f"rules {rules_name!r} on {mesh} have none: every batch axis splits the "
                "parameters. Use --strategy dp, zero1 or hsdp (hsdp: replicas over data)",
            )
        )
    for axis, why in ((PIPE, "pipelines"), (SEQ, "context parallelism"), (EXPERT, "MoE")):
        if sizes.get(axis, 1) > 1:
            problems.append(
                Problem(
                    field,
                    value,
                    f"{what} does not run with {why} yet (mesh {axis}={sizes[axis]}); set {axis}=1",
                )
            )
    return problems
