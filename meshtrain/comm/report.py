"""What one compiled step holds: memory, FLOPs and collectives per mesh axis, as JSON or a table."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping

from meshtrain.comm.axes import axes_of_groups
from meshtrain.comm.hlo import Collective


def axes_label(axes: tuple[str, ...] | None) -> str:
    """``data+fsdp``; ``-`` for a collective within one device; ``?`` for an irregular one."""
    if axes is None:
        return "?"
    return "+".join(axes) if axes else "-"


@dataclasses.dataclass(frozen=True)
class Row:
    """The collectives of one kind over one set of mesh axes, summed over a step.

    Attributes:
        kind: the collective kind.
        axes: the mesh axes (None: groups that match no set of axes).
        count: executions per step.
        bytes: summed `Collective.buffer_bytes` × executions, per device.
        wire_bytes: summed ring-algorithm bytes sent per device.
        group_size: devices per group.
        instructions: distinct HLO instructions.
    """

    kind: str
    axes: tuple[str, ...] | None
    count: int
    bytes: int
    wire_bytes: float
    group_size: int
    instructions: int

    def as_dict(self) -> dict:
        """The row as JSON-ready values."""
        return {
            "kind": self.kind,
            "axes": axes_label(self.axes),
            "count": self.count,
            "bytes": self.bytes,
            "wire_bytes": round(self.wire_bytes),
            "group_size": self.group_size,
            "instructions": self.instructions,
        }


def summarize(collectives: list[Collective], sizes: Mapping[str, int]) -> list[Row]:
    """The collectives grouped by (kind, mesh axes), largest bytes first."""
    acc: dict = defaultdict(lambda: [0, 0, 0.0, 1, 0])
    for c in collectives:
        axes = axes_of_groups(c.groups, sizes, permute=c.kind == "collective-permute")
        if axes == () and c.kind != "collective-permute":
            continue  # groups of one device: no communication
        a = acc[(c.kind, axes)]
        a[0] += c.count
        a[1] += c.count * c.buffer_bytes
        a[2] += c.count * c.wire_bytes
        a[3] = max(a[3], c.group_size)
        a[4] += 1
    rows = [Row(k, ax, *v) for (k, ax), v in acc.items()]
    return sorted(rows, key=lambda r: -r.bytes)
