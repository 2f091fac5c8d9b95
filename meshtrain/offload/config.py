"""`Offload`: which parts of the train state live in host memory between steps."""

from __future__ import annotations

import dataclasses

import jax

from meshtrain import validate
from meshtrain._units import fmt_bytes
from meshtrain.layout.memory import HOST_KINDS
from meshtrain.problem import Problem


@dataclasses.dataclass(frozen=True, kw_only=True)
class Offload(validate.Checked):
    """Which parts of the train state live in host memory between steps.

    Args:
        optimizer: keep the optimizer state (Adam's moments, its step count) in host memory;
            each step fetches every device's own shard before the update and writes it back
            after. Device memory falls by the optimizer state's bytes per device, and each step
            moves them twice over the host link.
        memory_kind: the host memory: ``pinned_host`` (page-locked: transfers run at the
            link's rate) or ``unpinned_host``.
    """

    optimizer: bool = False
    memory_kind: str = "pinned_host"

    def problems(self) -> list[Problem]:
        """A memory kind that is not a host memory."""
        return validate.one_of("offload.memory_kind", self.memory_kind, HOST_KINDS)

    @property
    def active(self) -> bool:
        """Whether anything is offloaded."""
        return self.optimizer

    def describe(self, per_device: float | None = None) -> str:
        """One line saying where the optimizer state lives (the run summary), given the bytes
        per device in host memory (`meshtrain.offload.host_bytes`) where known."""
        if not self.active:
            return "optimizer state in device memory"
        held = f"{fmt_bytes(per_device)} per device" if per_device is not None else "the state"
        return (
            f"offload optimizer · {held} in {self.memory_kind} memory, fetched and written back "
            "each step"
        )

    def backend_problems(self, devices=None) -> list[Problem]:
        """The memory kind missing on the devices' backend, as one `Problem`."""
        if not self.active:
            return []
        kinds = memory_kinds(devices)
        if self.memory_kind in kinds:
            return []
        platform = (devices or jax.devices())[0].platform
        hosts = ", ".join(k for k in kinds if k in HOST_KINDS)
        fix = f"choose --offload-memory-kind from {hosts}" if hosts else "drop --offload"
        message = f"the {platform} backend has no {self.memory_kind} memory; {fix}"
        return [Problem("offload", "optimizer", message)]


def memory_kinds(devices=None) -> tuple[str, ...]:
    """The memory kinds the first of `devices` (default: all of jax's) can address."""
    device = (devices or jax.devices())[0]
    return tuple(m.kind for m in device.addressable_memories())
