"""`inspect`: what the compiled train step of a layout holds, against what it should.

import meshtrain as mt
mt.simulate_devices(8)
mesh = mt.make_mesh("data=2,fsdp=2,tensor=2")
report = mt.inspect(mt.RunSpec(model=mt.GPTConfig(), data=mt.DataConfig(), mesh=mesh,
                               rules=mt.rules_for("fsdp+tp", mesh)))
report.print()            # a rich table
report.as_dict()          # JSON-ready
"""

from __future__ import annotations

import dataclasses
import json

from flax import nnx

from meshtrain._units import fmt_bytes
from meshtrain.check import check_run
from meshtrain.comm.compile import compile_step
from meshtrain.comm.exchange import exchange_line, replica_exchange
from meshtrain.comm.expect import BUCKETS, Expectation, bucket_of, expected, judge, param_layouts
from meshtrain.comm.hlo import Collective, collectives, entry_host_bytes
from meshtrain.comm.report import Row, axes_label, summarize
from meshtrain.pipeline.slots import count_permutes
from meshtrain.problem import raise_if
from meshtrain.replicas import parse_compression, replica_sets
from meshtrain.run import RunSpec
from meshtrain.state import abstract_model

REMAT_WARNING = "Involuntary full rematerialization"


@dataclasses.dataclass
class Inspection:
    """The compiled step of one layout, per device.

    Attributes:
        mesh: axis sizes.
        strategy: the rules' name.
        memory: device bytes: ``argument``, ``output``, ``temp``, ``alias`` and ``peak``
            (arguments + outputs + temporaries − aliased: what the step holds at once); and
            host bytes (`meshtrain.offload`): ``host_argument``, ``host_output``, ``host_temp``.
        transfers: host↔device bytes per step, ``to_device`` and ``to_host``: the offloaded
            state's fetch and write-back, and the offloaded activations.
        exchange: when the replicas step on their own (local SGD, gossip, federated
            averaging), their exchange per step (`replica_exchange`): ``compiled_bytes`` sent
            per device, read from the program (a branch's collectives at the share of steps
            that take it), ``modelled_bytes`` and ``modelled_s`` (the α-β model on ``device``),
            and for federated averaging ``ideal_bytes``, what only the sampled clients would
            send.
        flops: XLA's FLOP count of the step (per device).
        collectives: every collective instruction that runs.
        rows: the collectives summed by kind and mesh axes.
        expectation: the analytic expectation per bucket.
        measured: the compiled bytes per bucket.
        flags: what does not fit the expectation.
        param_bytes: parameter bytes of the whole model.
        compile_s: compile time.
        batch_axes: the axes the batch is split over.
    """

    mesh: dict[str, int]
    strategy: str
    memory: dict[str, int]
    flops: float
    collectives: list[Collective]
    rows: list[Row]
    expectation: Expectation
    measured: dict[str, float]
    flags: list[str]
    param_bytes: int
    compile_s: float
    batch_axes: tuple[str, ...] = ()
    compressed_axes: tuple[str, ...] = ()  # the replica axes a gradient codec reduces over
    transfers: dict[str, float] = dataclasses.field(default_factory=dict)
    own_axes: tuple[str, ...] = ()  # the replica axes, when the replicas step on their own
    exchange: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def comm_bytes(self) -> int:
        """Bytes of all collectives per device per step (`Collective.buffer_bytes` summed)."""
        return sum(r.bytes for r in self.rows)

    @property
    def wire_bytes(self) -> float:
        """Ring-algorithm bytes each device sends per step."""
        return sum(r.wire_bytes for r in self.rows)

    def bytes_by(self, kind: str, axes: tuple[str, ...] | None = None) -> int:
        """Summed bytes of one kind (over `axes` only, when given)."""
        return sum(
            r.bytes for r in self.rows if r.kind == kind and (axes is None or r.axes == axes)
        )

    def as_dict(self) -> dict:
        """A JSON-ready summary (without the per-instruction list)."""
        return {
            "mesh": self.mesh,
            "strategy": self.strategy,
            "memory_bytes": self.memory,
            "transfer_bytes": {k: round(v) for k, v in self.transfers.items()},
            "flops": self.flops,
            "param_bytes": self.param_bytes,
            "collectives": [r.as_dict() for r in self.rows],
            "comm_bytes": self.comm_bytes,
            "wire_bytes": round(self.wire_bytes),
            "expected_bytes": {k: round(v) for k, v in self.expectation.bytes.items() if v},
            "measured_bytes": {k: round(v) for k, v in self.measured.items() if v},
            "flags": self.flags,
            "compile_s": round(self.compile_s, 2),
            **({"replica_exchange": self.exchange} if self.exchange else {}),
        }

    def to_json(self) -> str:
        """`as_dict` as one JSON line."""
        return json.dumps(self.as_dict())

    def print(self, console=None) -> None:
        """Prints the memory, the collectives per kind and axes, and the flags (rich)."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        mesh = ",".join(f"{a}={s}" for a, s in self.mesh.items() if s > 1) or "1 device"
        m = self.memory
        console.print(
            f"[bold]{mesh} · {self.strategy}[/bold] · per device: arguments "
            f"{fmt_bytes(m['argument'])}, outputs {fmt_bytes(m['output'])}, temporaries "
            f"{fmt_bytes(m['temp'])}, peak {fmt_bytes(m['peak'])} · {self.flops / 1e9:.3g} GFLOP"
        )
        # offloaded residuals live on host from the forward to the backward
        residuals = self.transfers.get("to_host", 0) - m.get("host_output", 0)
        host = m.get("host_argument", 0) + max(m.get("host_temp", 0), residuals)
        if host or any(self.transfers.values()):
            console.print(
                f"host memory {fmt_bytes(host)} per device · per step "
                f"{fmt_bytes(self.transfers.get('to_device', 0))} to the device, "
                f"{fmt_bytes(self.transfers.get('to_host', 0))} to host"
            )
        table = Table("collective", "axes", "per step", "bytes", "sent (ring)", "expected as")
        for r in self.rows:
            bucket = bucket_of(r, self.batch_axes, self.compressed_axes, self.own_axes)
            table.add_row(
                r.kind,
                axes_label(r.axes),
                str(r.count),
                fmt_bytes(r.bytes),
                fmt_bytes(r.wire_bytes),
                bucket or "[red]unexpected[/red]",
            )
        console.print(table)
        exp = Table("bucket", "compiled", "expected", "ratio")
        for b in BUCKETS:
            want, got = self.expectation.bytes[b], self.measured[b]
            if want or got:
                exp.add_row(
                    b, fmt_bytes(got), fmt_bytes(want), f"{got / want:.2f}" if want else "-"
                )
        console.print(exp)
        if self.exchange:
            console.print(exchange_line(self.exchange))
        for f in self.flags:
            console.print(f"[yellow]flag[/yellow]: {f}")
        if not self.flags:
            console.print("no flags: every collective is one the layout needs")


def _largest(
    cs: list[Collective], sizes, batch_axes, compressed_axes=(), own_axes=()
) -> dict[str, str]:
    """Per bucket, the instruction moving the most bytes, described."""
    from meshtrain.comm.axes import axes_of_groups

    best: dict[str, tuple[int, str]] = {}
    for c in cs:
        axes = axes_of_groups(c.groups, sizes, permute=c.kind == "collective-permute")
        row = Row(c.kind, axes, c.count, c.count * c.buffer_bytes, 0.0, c.group_size, 1)
        bucket = bucket_of(row, batch_axes, compressed_axes, own_axes)
        if bucket and row.bytes > best.get(bucket, (0, ""))[0]:
            where = f" inside a loop, {c.count}× per step" if c.count > 1 else ""
            best[bucket] = (
                row.bytes,
                f"{c.name} ({c.kind} of {fmt_bytes(c.buffer_bytes)}{where}; {c.op_name[-80:]})",
            )
    return {k: v[1] for k, v in best.items()}


def inspect_compiled(
    compiled,
    run: RunSpec,
    *,
    param_vars: nnx.State,
    stderr: str = "",
    compile_s: float = 0.0,
    transfers: dict[str, float] | None = None,
) -> Inspection:
    """An `Inspection` of an already compiled step (see `inspect`).

    Args:
        compiled: the compiled step (`compile_step`).
        run: the run it was compiled for (`RunSpec`; its mesh a `Mesh`).
        param_vars: the model's (abstract) parameters.
        stderr: what XLA printed while compiling.
        compile_s: the compile time.
        transfers: the step's activation transfers (`meshtrain.offload.transfer_bytes`).

    Returns:
        An `Inspection`.
    """
    run = run.resolved()
    mesh, rules, sizes, sync = run.mesh, run.rules, run.sizes, run.sync
    codec = parse_compression(sync.grad_compression) if sync.compresses else None
    compressed = rules.replica_axes(sizes) if codec is not None else ()
    memory = compiled_memory(compiled)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    flops = float((cost or {}).get("flops", 0.0))
    cs = collectives(compiled.as_text(), mesh.devices.size)
    if run.pipeline is not None:  # a pipeline's permutes run only in their slots' branches
        cs = count_permutes(cs, sizes, run.pipeline)
    rows = summarize(cs, sizes)
    batch_axes = rules.batch_axes(sizes)
    params = param_layouts(param_vars, rules, sizes)
    exp = expected(params, run)
    own = replica_sets(rules, sizes).axes if sync.local else ()
    largest = _largest(cs, sizes, batch_axes, compressed, own)
    measured, flags = judge(rows, exp, batch_axes, largest, compressed, own)
    if REMAT_WARNING in stderr:
        line = next(x for x in stderr.splitlines() if REMAT_WARNING in x)
        flags.append(f"XLA: {line[line.find(REMAT_WARNING) :][:200]}")
    return Inspection(
        mesh=dict(sizes),
        strategy=rules.name,
        memory=memory,
        flops=flops,
        collectives=cs,
        rows=rows,
        expectation=exp,
        measured=measured,
        flags=flags,
        param_bytes=sum(p.nbytes for p in params),
        compile_s=compile_s,
        batch_axes=batch_axes,
        compressed_axes=compressed,
        transfers={
            "to_device": memory["host_argument"] + (transfers or {}).get("to_device", 0.0),
            "to_host": memory["host_output"] + (transfers or {}).get("to_host", 0.0),
        },
        own_axes=own,
        exchange=replica_exchange(cs, run, params) if own else {},
    )


def compiled_memory(compiled) -> dict[str, int]:
    """A compiled program's bytes per device: device ``argument``, ``output``, ``temp``,
    ``alias`` and ``peak`` (argument + output + temp − alias), and its host bytes
    (``host_argument``, ``host_output``, ``host_temp``)."""
    ma = compiled.memory_analysis()
    memory = {
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "temp": int(ma.temp_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
    }
    memory.update(_host_memory(compiled, ma, memory))
    memory["peak"] = memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
    return memory


def _host_memory(compiled, ma, memory: dict[str, int]) -> dict[str, int]:
    """The step's host bytes per device, taking them out of `memory`'s device figures where
    the backend counts them there (CPU reports no host figures; its compiled program still
    places the parameters and results in host memory, ``S(5)`` in its entry layout)."""
    host = {
        "host_argument": int(ma.host_argument_size_in_bytes),
        "host_output": int(ma.host_output_size_in_bytes),
        "host_temp": int(ma.host_temp_size_in_bytes),
    }
    if not any(host.values()):
        args, results = entry_host_bytes(compiled.as_text())
        host.update(host_argument=args, host_output=results)
        memory["argument"] -= args
        memory["output"] -= results
        memory["alias"] -= min(args, results, memory["alias"])  # donated: host aliases host
    return host


def inspect(run: RunSpec) -> Inspection:
    """Compiles the real train step of a run ahead of time (nothing runs, nothing is
    allocated) and reports memory, FLOPs and every collective against the expectation.

    Args:
        run: the run (`RunSpec`): its model (a config, or a constructor taking an
            ``nnx.Rngs``), data (a `DataConfig`, a `Dataset` or a `DataSpec`), mesh, rules,
            optimizer, pipeline, accumulation, loss and sync (compressed gradients show up as
            the codec's own collectives). Its run directory and checkpoints play no part:
            nothing is written.

    Returns:
        An `Inspection`.

    Raises:
        RunCheckError: the run check's problems, before anything compiles.
    """
    run = run.resolved()
    ctor, _ = run.constructor()
    graphdef, state = abstract_model(ctor)
    quiet = dataclasses.replace(run.train, run_dir="", tensorboard=False)
    writes_nothing = run.replace(train=quiet, checkpoint=None)
    raise_if(check_run(writes_nothing, abstract=(graphdef, state), memory=False))
    _, param_vars, _ = nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)
    compiled, info = compile_step(run)
    return inspect_compiled(
        compiled,
        run,
        param_vars=param_vars,
        stderr=info["stderr"],
        compile_s=info["compile_s"],
        transfers=info["transfers"],
    )
