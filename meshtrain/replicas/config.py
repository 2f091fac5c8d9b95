"""`SyncConfig`: how the data-parallel replicas synchronise.

What it refuses beside other features (pipelines, MoE, strategies without replicas, ...) is
in `meshtrain.composition.REFUSALS`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from meshtrain import validate
from meshtrain.problem import Problem

COMPRESSIONS = ("none", "bf16", "int8", "topk:FRACTION", "sign")
OUTER_OPTIMIZERS = ("average", "nesterov", "adam")
TOPOLOGIES = ("ring", "torus", "exponential", "complete")  # gossip's graphs (`gossip`)


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
class SyncConfig(validate.Checked):
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
            replicas' mean (periodic model averaging; federated averaging's server SGD with
            rate 1); ``nesterov`` applies the mean change through Nesterov momentum SGD
            (DiLoCo); ``adam`` through Adam (FedAdam, Reddi et al., 2021).
        outer_lr: the outer optimizer's learning rate (``nesterov``, ``adam``).
        outer_momentum: the outer optimizer's momentum (``nesterov``; Adam's first moment).
        staleness: apply the gradient computed this many steps earlier (a deterministic model
            of stale-synchronous and asynchronous training); 0 is synchronous.
        gossip: decentralized training: after every local step each replica mixes its
            parameters with its neighbours' on this graph (`TOPOLOGIES`; collective permutes
            only), and every `sync_every` steps the replicas' mean is formed as the model
            (``state.params``) without resetting them (`meshtrain.replicas.gossip`).
        client_fraction: federated averaging: the replicas are clients; each round of
            `sync_every` local steps this share of them is sampled, and the server applies the
            mean change of the sampled clients only, through `outer_optimizer`
            (`meshtrain.replicas.federated`).
        client_seed: the seed the rounds draw their clients from (with the round alone: every
            process draws the same clients, and a resumed run the ones it would have).
    """

    grad_compression: str = "none"
    error_feedback: bool = True
    sync_every: int | None = None
    outer_optimizer: str = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    staleness: int = 0
    gossip: str | None = None
    client_fraction: float | None = None
    client_seed: int = 0

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
        problems += self._decentralized_problems()
        return problems + v.non_negative(
            "staleness", self.staleness, example=4, note="0 is synchronous"
        )

    def _decentralized_problems(self) -> list[Problem]:
        """Gossip's topology and federated averaging's fraction (their pairs with the other
        settings are rows of `meshtrain.composition.REFUSALS`)."""
        v = validate
        found: list[Problem] = []
        if self.gossip is not None:
            found += v.one_of("gossip", self.gossip, TOPOLOGIES, example="ring")
        if self.client_fraction is not None:
            found += v.in_range(
                "client_fraction", self.client_fraction, 0, 1, closed="(]", example=0.25,
                note="the share of clients each round trains",
            )  # fmt: skip
        found += v.in_range(
            "client_seed", self.client_seed, 0, 2**32, closed="[)", integer=True, example=0
        )
        return found

    def describe(self, rules, sizes: Mapping[str, int]) -> str:
        """The run summary's replicas line: what each scheme averages over, then what these
        settings do (`summary`). Beside an MoE's expert split (`replica_sets`) the dense
        weights average over the data and expert devices and the experts' over data alone,
        and a federated client is a data replica with its expert devices, e.g. "replicas: 4
        clients over data (each with its expert devices) · federated averaging: ..."."""
        from meshtrain.replicas.sets import replica_sets

        sets = replica_sets(rules, sizes)
        own = tuple(a for a in sets.axes if a not in sets.split)  # what every leaf averages over
        if self.federates:
            with_experts = " (each with its expert devices)" if sets.split else ""
            where = f"{_count(own, sizes)} clients over {_over(own)}{with_experts}"
        elif sets.split:
            where = (
                f"dense weights over {_count(sets.axes, sizes)} ({_over(sets.axes)}), expert "
                f"weights over {_count(own, sizes)} ({_over(own)})"
            )
        else:
            where = f"{_count(sets.axes, sizes)} over {_over(sets.axes)}"
        return " · ".join([f"replicas: {where}", *self.summary()])

    def summary(self) -> list[str]:
        """What these settings do, a short phrase each (the CLI's run summary)."""
        parts = []
        if self.compresses:
            feedback = "with" if self.error_feedback else "without"
            parts.append(f"gradients {self.grad_compression} {feedback} error feedback")
        outer = {
            "nesterov": f"Nesterov, lr {self.outer_lr}, momentum {self.outer_momentum}",
            "adam": f"Adam, lr {self.outer_lr}, β₁ {self.outer_momentum}",
        }.get(self.outer_optimizer)
        every = f"every {self.sync_every} steps" if self.sync_every else "(no --sync-every)"
        if self.gossips:
            mean = f"the replicas' mean {every}"
            parts.append(f"gossip over the {self.gossip} graph every step, {mean}")
        elif self.federates:
            server = f"server {outer}" if outer else "server averaging"
            parts.append(
                f"federated averaging: {self.client_fraction:g} of the clients per round of "
                f"{self.sync_every} local steps, {server}"
            )
        elif self.local:
            then = f"DiLoCo ({outer})" if outer else "averaging"
            parts.append(f"local SGD: {self.sync_every} local steps, then {then}")
        if self.staleness:
            old = f"staleness {self.staleness} (updates apply gradients that many steps old)"
            parts.append(old)
        return parts

    @property
    def gossips(self) -> bool:
        """Gossip (decentralized) averaging is on."""
        return self.gossip is not None

    @property
    def federates(self) -> bool:
        """Federated averaging is on."""
        return self.client_fraction is not None

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
        """The replicas step on their own (local SGD, DiLoCo, gossip, federated averaging)."""
        return self.sync_every is not None or self.gossips or self.federates

    @property
    def keeps_residual(self) -> bool:
        """A residual is kept: a lossy scheme (every one but ``none``) with error feedback."""
        return self.compresses and self.error_feedback


def _count(axes: tuple[str, ...], sizes: Mapping[str, int]) -> int:
    """The devices along `axes`."""
    return math.prod(sizes[a] for a in axes)


def _over(axes: tuple[str, ...]) -> str:
    """``data × expert``, or ``no axis``."""
    return " × ".join(axes) or "no axis"
