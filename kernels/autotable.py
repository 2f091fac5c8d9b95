"""What ``impl="auto"`` runs on a GPU: the implementation measured fastest there.

The measurements live in ``auto_table.json`` beside this module, one row per device kind, op
and shape, each with the forward+backward milliseconds of every implementation timed (a
training step runs both). The GPU check writes it from `benchmarks/kernels.py`'s records
(``python scripts/auto_table.py RESULTS...``); nobody edits it by hand.

A row serves a call when the device kind is the row's, the exact dimensions agree (an
attention's head width and causality) and the one size that varies (sequence length, feature
width, vocabulary) is within a factor of four of the row's; the nearest such row wins. Where
no row serves, ``auto`` takes the safe default, never an unmeasured kernel: cuDNN's attention
where it applies, XLA's ops otherwise. Off a GPU ``auto`` is always XLA's (the Pallas kernels
are interpreted there).
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
from collections.abc import Iterable, Mapping
from typing import NamedTuple

TABLE = pathlib.Path(__file__).with_name("auto_table.json")

# The table's op for each kernel name `_common.resolve_impl` is called with.
OPS = {
    "flash_attention": "attention",
    "rms_norm": "rms_norm",
    "layer_norm": "layer_norm",
    "token_cross_entropy": "cross_entropy",
    "matmul": "matmul",
    "grouped_matmul": "grouped_matmul",
}
# Per op: the dimensions a row must match exactly, and the size matched within `SPAN`.
EXACT = {
    "attention": ("head_dim", "causal"),
    "flash_config": ("head_dim", "causal"),
    "matmul": ("activation",),
}
SIZE = {
    "attention": "seq",
    "rms_norm": "features",
    "layer_norm": "features",
    "cross_entropy": "vocab",
    "matmul": "n",
    "grouped_matmul": "rows",  # tokens × top_k: the rows the experts multiply
    "flash_config": "seq",
}
SPAN = 2.0  # octaves: a row serves sizes within a factor of 2**SPAN of its own
PASS = "fwd+bwd"


class Choice(NamedTuple):
    """What ``auto`` resolved to, and why (for the run summary)."""

    impl: str
    why: str


@functools.cache
def rows() -> tuple[dict, ...]:
    """The table's rows (none when the file is missing)."""
    if not TABLE.exists():
        return ()
    return tuple(json.loads(TABLE.read_text())["rows"])


@functools.cache
def device_kind() -> str:
    """The default device's kind, e.g. ``"NVIDIA H200"``."""
    import jax

    return jax.devices()[0].device_kind


def measured(kernel: str, shape: Mapping, kind: str) -> dict | None:
    """The row serving a `kernel` call of `shape` on a device of `kind` (see the module's
    docstring), or None."""
    op = OPS.get(kernel)
    return None if op is None else _nearest(op, shape, kind)


def _nearest(op: str, shape: Mapping, kind: str) -> dict | None:
    """The `op` row of a device of `kind` whose exact dimensions are `shape`'s and whose size
    is nearest `shape`'s, within `SPAN` octaves; None when none is."""
    if not shape.get(SIZE[op], 0) > 0:
        return None
    best, distance = None, SPAN
    for row in rows():
        if row["device_kind"] != kind or row["op"] != op:
            continue
        if any(row["shape"].get(d) != shape.get(d) for d in EXACT.get(op, ())):
            continue
        gap = abs(math.log2(shape[SIZE[op]] / row["shape"][SIZE[op]]))
        if gap <= distance:
            best, distance = row, gap
    return best


def fastest(kernel: str, shape: Mapping, candidates: Iterable[str]) -> Choice | None:
    """The fastest of `candidates` measured for this call on this GPU; None without a row."""
    row = measured(kernel, shape, device_kind())
    if row is None:
        return None
    timed = sorted((ms, impl) for impl, ms in row["ms"].items() if impl in set(candidates))
    if not timed:
        return None
    ms, impl = timed[0]
    size = SIZE[row["op"]]
    return Choice(impl, f"fastest measured at {size} {row['shape'][size]} ({row['date']})")


def flash_config(shape: Mapping, kind: str) -> dict | None:
    """The flash kernel's configuration tuned for a call of `shape` (``seq``, ``head_dim``,
    ``causal``) on a device of `kind`: ``{"block_q", "block_k", "warps", "stages"}`` from the
    row nearest in sequence length (as `measured` serves), or None."""
    row = _nearest("flash_config", shape, kind)
    return None if row is None else dict(row["config"])


def table_from(records: Iterable[Mapping], *, date: str = "") -> list[dict]:
    """The table's rows from `benchmarks/kernels.py` and `benchmarks/grouped_matmul.py`
    records: per device kind, op and shape, the forward+backward milliseconds of each
    implementation timed (its best tile, for the grouped matmul).

    Args:
        records: the benchmarks' JSON objects (``{"benchmark": "kernels", "rows": [...]}``);
            other records are skipped.
        date: the measurement date, for records that carry none (``YYYY-MM-DD``).

    Returns:
        The rows, sorted by device kind, op and shape.
    """
    table: dict[tuple, dict] = {}
    for rec in records:
        measured_here = rec.get("benchmark") in ("kernels", "grouped_matmul", "flash_sweep")
        if not measured_here or rec.get("platform") != "gpu":
            continue
        when = str(rec.get("date", date))[:10]
        if not when:
            raise ValueError(f"a kernels record from {rec['device_kind']} has no date; pass one")
        for op, shape, impl, ms, config in _timings(rec):
            key = (rec["device_kind"], op, json.dumps(shape, sort_keys=True))
            row = table.setdefault(
                key,
                {
                    "platform": "gpu",
                    "device_kind": rec["device_kind"],
                    "op": op,
                    "shape": shape,
                    "ms": {},
                    "jax": rec.get("jax_version", ""),
                    "date": when,
                },
            )
            if ms < row["ms"].get(impl, math.inf):  # the best tile's, the best configuration's
                row["ms"][impl] = ms
                if config is not None:
                    row["config"] = config
    return [table[k] for k in sorted(table)]


def _timings(rec: Mapping) -> Iterable[tuple[str, dict, str, float, dict | None]]:
    """``(op, shape, impl, forward+backward ms, configuration)`` of a benchmark record:
    `benchmarks/kernels.py` rows; `benchmarks/grouped_matmul.py`'s one shape with a row per
    impl and tile; `benchmarks/flash_sweep.py`'s configurations of the Pallas attention per
    shape (each also an attention timing, so ``auto`` weighs the tuned kernel)."""
    if rec["benchmark"] == "grouped_matmul":
        shape = {**rec["shape"], "rows": rec["shape"]["tokens"] * rec["shape"]["top_k"]}
        for r in rec["rows"]:
            yield "grouped_matmul", shape, r["impl"], r[f"{PASS}_ms"], None
        return
    for r in rec["rows"]:
        if r.get("pass") != PASS or "ms" not in r:  # an error row (out of memory) is no timing
            continue
        if rec["benchmark"] == "flash_sweep":
            config = r.get("config")
            yield "attention", r["shape"], r["impl"], r["ms"], None
            if config is not None:
                yield "flash_config", r["shape"], r["impl"], r["ms"], config
        elif r["kernel"] in SIZE:
            yield r["kernel"], r["shape"], r["impl"], r["ms"], None
