"""Reading collectives out of compiled HLO text.

`collectives(hlo_text)` returns one `Collective` per collective instruction of the module, with
how many times it runs per step: the product of the known trip counts of the while loops
around it (XLA writes ``known_trip_count`` into each loop's backend config). Replica groups
come in three spellings, all turned into explicit lists of device ids here:

- explicit: ``replica_groups={{0,1},{2,3}}``;
- iota: ``replica_groups=[2,4]<=[4,2]T(1,0)``: ``arange(8).reshape(4, 2).transpose(1, 0)``
  reshaped to 2 groups of 4;
- mesh (Shardy): ``replica_groups=mesh['data'=2,'tensor'=4] {'tensor'}``: devices
  ``arange(8).reshape(2, 4)``, one group per index of the axes not listed.

The ids are positions in the compiled program's device assignment, which for a jitted step on
a `jax.sharding.Mesh` is ``mesh.devices.flat``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

_HEAD = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) (" + "|".join(KINDS) + r")(-start)?\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:to_apply|calls|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"(?:true_computation|false_computation)=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled module.

    Attributes:
        name: the instruction's name in the HLO.
        kind: one of `KINDS`.
        count: executions per step (static occurrences × enclosing loop trip counts).
        result_bytes: bytes of the result on one device (all tuple elements).
        groups: the replica groups, as tuples of device ids (positions in the device
            assignment); for a collective-permute, the (source, target) pairs.
        dtypes: the element types of the result.
        op_name: the jax operation it came from (the HLO metadata), or "".
        conditional: it sits in a conditional's branch (reached only through one), so it runs
            on the calls that take that branch, not on every one (local SGD's
            synchronisation); `count` is per call that takes it.
    """

    name: str
    kind: str
    count: int
    result_bytes: int
    groups: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    op_name: str = ""
    conditional: bool = False

    @property
    def group_size(self) -> int:
        """Devices in one replica group (2 for a permute pair)."""
        return max((len(g) for g in self.groups), default=1)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the whole buffer the collective works on, per device, per execution:
        the reduced buffer (all-reduce), the gathered result (all-gather), the input before
        scattering (reduce-scatter), the exchanged buffer (all-to-all, permute)."""
        if self.kind == "reduce-scatter":
            return self.result_bytes * self.group_size
        return self.result_bytes

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends per execution with a bandwidth-optimal (ring) algorithm:
        2(n−1)/n·S for all-reduce, (n−1)/n·S for all-gather, reduce-scatter and all-to-all,
        S for a permute, where S is `buffer_bytes` and n the group size."""
        n, s = self.group_size, self.buffer_bytes
        if self.kind == "collective-permute":
            return float(s)
        if n <= 1:
            return 0.0
        factor = 2 * (n - 1) / n if self.kind == "all-reduce" else (n - 1) / n
        return factor * s


def shape_bytes(text: str) -> tuple[int, tuple[str, ...]]:
    """Bytes and element types of an HLO shape such as ``f32[2,64]{1,0}`` or a tuple of them."""
    total, dtypes = 0, []
    for dtype, dims in _SHAPE.findall(text):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
            dtypes.append(dtype)
    return total, tuple(dtypes)


def _start_result(kind: str, shape: str) -> str:
    """The part of an async ``*-start`` result tuple that is the collective's output."""
    inner = shape.strip()
    if not inner.startswith("(") or kind == "all-reduce":
        return inner
    parts = _split_top(inner[1:-1])
    return parts[1] if len(parts) > 1 else parts[0]


def _split_top(text: str) -> list[str]:
    """Splits a comma-separated list at depth 0 of (), [], {}."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur).strip())
    return out


def parse_replica_groups(line: str, n_devices: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The replica groups of an HLO instruction line, in any of the three spellings.

    Args:
        line: the instruction's text.
        n_devices: devices in the program; needed only for empty groups ``{}`` (all devices).

    Returns:
        Tuples of device ids; for a collective-permute its (source, target) pairs.
    """
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if pairs:
        return tuple(
            tuple(int(x) for x in p.split(","))
            for p in re.findall(r"\{(\d+,\d+)", pairs.group(1) + "}")
        )
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:
        axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
        names = [a for a, _ in axes]
        ids = np.arange(math.prod(int(s) for _, s in axes)).reshape([int(s) for _, s in axes])
        chosen = [names.index(a) for a in re.findall(r"'([^']+)'", mesh.group(2))]
        rest = [i for i in range(len(names)) if i not in chosen]
        ids = ids.transpose(rest + chosen).reshape(-1, math.prod(ids.shape[i] for i in chosen))
        return tuple(tuple(int(x) for x in g) for g in ids)
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        shape = [int(x) for x in iota.group(1).split(",")]
        dims = [int(x) for x in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        ids = ids.reshape(shape[0], -1) if len(shape) > 1 else ids.reshape(1, -1)
        return tuple(tuple(int(x) for x in g) for g in ids)
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if explicit:
        groups = tuple(
            tuple(int(x) for x in g.split(",") if x)
            for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))
        )
        if groups:
            return groups
    return (tuple(range(n_devices)),) if n_devices else ()


def computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """The module's computations (name -> body lines) and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    name = entry = None
    for line in hlo.splitlines():
        head = _HEAD.match(line)
        if head:
            name = head.group(2)
            comps[name] = []
            entry = name if head.group(1) else entry
        elif name is not None:
            comps[name].append(line)
    return comps, entry


def executions(comps: dict[str, list[str]], entry: str | None) -> tuple[dict[str, int], set[str]]:
    """How many times each computation runs per call of `entry`: while bodies count their
    known trip count (1 where XLA recorded none), conditional branches count once each.

    Returns:
        ``(times, branched)``: the counts, and the computations reached only through a
        conditional's branches.
    """
    times: dict[str, int] = defaultdict(int)
    unconditional: set[str] = set()

    def visit(comp: str, mult: int, branch: bool, depth: int = 0):
        if depth > 64:
            return
        times[comp] += mult
        if not branch:
            unconditional.add(comp)
        for line in comps.get(comp, []):
            body = re.search(r"body=%?([\w.\-]+)", line)
            if body:
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                visit(body.group(1), mult * (int(trip.group(1)) if trip else 1), branch, depth + 1)
            for ref in _CALLS.findall(line):
                visit(ref, mult, branch, depth + 1)
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            refs = _BRANCHES.findall(line)
            if branches:
                refs += [r.strip().lstrip("%") for r in branches.group(1).split(",")]
            for ref in refs:
                visit(ref, mult, True, depth + 1)

    if entry is not None:
        visit(entry, 1, False)
    return times, set(times) - unconditional


def collectives(hlo: str, n_devices: int | None = None) -> list[Collective]:
    """Every collective in a compiled HLO module, with its executions per step.

    Args:
        hlo: ``compiled.as_text()``.
        n_devices: devices of the program (for replica groups written as ``{}``).

    Returns:
        The collectives that run (count > 0), in the order of the text.
    """
    comps, entry = computations(hlo)
    times, branched = executions(comps, entry)
    out = []
    for comp, lines in comps.items():
        if not times.get(comp):
            continue
        for line in lines:
            m = _OP.match(line)
            if not m:
                continue
            name, shape, kind, start = m.group(1), m.group(2), m.group(3), m.group(4)
            if start:
                shape = _start_result(kind, shape)
            size, dtypes = shape_bytes(shape)
            op = re.search(r'op_name="([^"]*)"', line)
            out.append(
                Collective(
                    name=name,
                    kind=kind,
                    count=times[comp],
                    result_bytes=size,
                    groups=parse_replica_groups(line, n_devices),
                    dtypes=dtypes,
                    op_name=op.group(1) if op else "",
                    conditional=comp in branched,
                )
            )
    return out


_HOST_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([\d,]*)\]\{[^}]*S\(5\)[^}]*\}")


def entry_host_bytes(hlo: str) -> tuple[int, int]:
    """Per-device bytes of the entry's parameters and results that live in host memory
    (memory space 5, ``S(5)`` in the compiled program's ``entry_computation_layout``)."""
    head = hlo.split("\n", 1)[0]
    start = head.find("entry_computation_layout={")
    if start < 0:
        return 0, 0
    params, _, results = head[start:].partition(")->")
    return tuple(  # type: ignore[return-value]
        sum(shape_bytes(f"{dtype}[{dims}]")[0] for dtype, dims in _HOST_SHAPE.findall(part))
        for part in (params, results)
    )
