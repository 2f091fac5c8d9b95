"""Device meshes: `MeshConfig` names the axis sizes, `make_mesh` builds the `jax.sharding.Mesh`.

Axes run from the slowest link (across hosts) to the fastest:

    pipe   pipeline stages
    data   data parallel; parameters replicated (or sharded, under fsdp/zero1 strategies)
    fsdp   data parallel whose parameters are sharded (ZeRO-3)
    expert mixture-of-experts parallel
    seq    sequence / context parallel
    tensor Megatron tensor parallel

Every mesh built here carries all six axes; unused ones have size 1. Keeping them makes
one rules table valid on every mesh.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from meshtrain import validate
from meshtrain._compat import jax_backends_started
from meshtrain.problem import Problem, raise_if

# The mesh axes' names, one constant each; code names an axis through these, never a literal.
PIPE = "pipe"
DATA = "data"
FSDP = "fsdp"
EXPERT = "expert"
SEQ = "seq"
TENSOR = "tensor"
AXES: tuple[str, ...] = (PIPE, DATA, FSDP, EXPERT, SEQ, TENSOR)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig(validate.Checked):
    """Sizes of the six mesh axes. One axis may be -1: it takes whatever devices are left.

    Args:
        pipe: pipeline stages.
        data: data-parallel replicas.
        fsdp: data-parallel shards of the parameters.
        expert: expert-parallel groups.
        seq: sequence-parallel shards.
        tensor: tensor-parallel shards.
    """

    pipe: int = 1
    data: int = -1
    fsdp: int = 1
    expert: int = 1
    seq: int = 1
    tensor: int = 1

    def problems(self) -> list[Problem]:
        """What is wrong with these sizes; an empty list when nothing."""
        problems: list[Problem] = []
        for name in AXES:
            size = getattr(self, name)
            if size != -1 or not validate.is_int(size):
                problems += validate.positive(
                    f"mesh.{name}",
                    size,
                    flag="--mesh",
                    example=f"{name}=2",
                    note="or -1 to fill the remaining devices",
                )
        fills = [name for name in AXES if getattr(self, name) == -1]
        return problems + validate.require(
            len(fills) < 2,
            "mesh",
            ",".join(f"{n}=-1" for n in fills),
            "only one axis may be -1 (fill); give the others explicit sizes",
        )

    @classmethod
    def parse(cls, text: str) -> MeshConfig:
        """Parses ``"data=4,tensor=2"``; axes not named get size 1.

        A string with no ``-1`` and a product short of the devices is an error later, in
        `sizes`, never silently padded.
        """
        sizes: dict[str, int] = {}
        text = text.strip()
        if text == "auto":
            raise ValueError(
                "mesh 'auto': not a mesh; 'data=-1' puts every device on data (auto is kept "
                "for an automatic planner)"
            )
        if text == "":
            return cls()
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"mesh {part!r}: expected axis=size, e.g. 'data=4,tensor=2'")
            if key not in AXES:
                raise ValueError(
                    f"mesh: unknown mesh axis {key!r}; mesh axes are {', '.join(AXES)}"
                )
            try:
                sizes[key] = int(value)
            except ValueError:
                raise ValueError(f"mesh {key}={value!r}: size must be an integer") from None
        fields = {name: sizes.get(name, 1) for name in AXES}
        return cls(**fields)

    def __str__(self) -> str:
        named = [f"{n}={getattr(self, n)}" for n in AXES if getattr(self, n) != 1]
        return ",".join(named) or "data=1"

    def sizes(self, n_devices: int) -> dict[str, int]:
        """Resolves -1 and checks that the axes multiply to `n_devices`."""
        fixed = {n: getattr(self, n) for n in AXES}
        known = math.prod(v for v in fixed.values() if v != -1)
        fill = [n for n, v in fixed.items() if v == -1]
        if fill:
            if n_devices % known:
                raise ValueError(
                    f"mesh {self}: the fixed axes multiply to {known}, which does not divide "
                    f"{n_devices} devices, so {fill[0]}=-1 cannot fill the rest"
                )
            fixed[fill[0]] = n_devices // known
        elif known != n_devices:
            product = " × ".join(f"{n}={v}" for n, v in fixed.items() if v != 1) or "1"
            raise ValueError(
                f"mesh {product} = {known} ≠ {n_devices} devices; "
                f"make the sizes multiply to {n_devices}, or set one axis to -1 to fill"
            )
        return fixed


def make_mesh(config: MeshConfig | str | None = None, devices=None) -> Mesh:
    """Builds a mesh with all six axes, every one `AxisType.Auto`.

    Args:
        config: a `MeshConfig`, a string such as ``"data=4,tensor=2"``, or None (all data).
        devices: devices to use; defaults to `jax.devices()`.

    Returns:
        A `jax.sharding.Mesh` with axes `AXES`.
    """
    if config is None:
        config = MeshConfig()
    elif isinstance(config, str):
        config = MeshConfig.parse(config)
    devices = list(jax.devices() if devices is None else devices)
    sizes = config.sizes(len(devices))
    shape = tuple(sizes[n] for n in AXES)
    axis_types = (AxisType.Auto,) * len(AXES)
    if len({d.process_index for d in devices}) > 1:
        return Mesh(hybrid_device_array(devices, sizes), AXES, axis_types=axis_types)
    if len(devices) == jax.device_count():
        return jax.make_mesh(shape, AXES, axis_types=axis_types, devices=devices)
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=axis_types)


def host_layout(
    sizes: dict[str, int], num_processes: int, local_devices: int
) -> tuple[dict[str, int], dict[str, int]]:
    """Splits mesh axis sizes into the part across processes and the part within one.

    The outer axes (pipe, then data) take the processes; every other axis lives
    inside a process. ``across[a] * within[a] == sizes[a]`` for every axis.

    Args:
        sizes: resolved axis sizes (see `MeshConfig.sizes`).
        num_processes: processes (hosts) in the job.
        local_devices: devices per process.

    Returns:
        ``(across, within)``: axis sizes over processes, and over one process's devices.
    """
    desc = " × ".join(f"{n}={v}" for n, v in sizes.items() if v != 1) or "1 device"
    where = f"{num_processes} processes × {local_devices} devices"
    if math.prod(sizes.values()) != num_processes * local_devices:
        raise ValueError(f"mesh {desc} has {math.prod(sizes.values())} devices, not {where}")
    across = dict.fromkeys(AXES, 1)
    across[PIPE] = math.gcd(sizes[PIPE], num_processes)
    across[DATA] = num_processes // across[PIPE]
    if sizes[DATA] % across[DATA]:
        outer = sizes[PIPE] * sizes[DATA]
        inner = local_devices * num_processes // outer
        raise ValueError(
            f"mesh {desc} cannot be laid out on {where}: the axes across processes are pipe "
            f"and data (pipe × data = {outer}), and they must split evenly over the "
            f"{num_processes} processes, while fsdp, expert, seq and tensor (here {inner}) stay "
            f"within one process's {local_devices} devices; e.g. make pipe × data a multiple of "
            f"{num_processes} (data={num_processes}) and the inner axes multiply to "
            f"{local_devices} or fewer"
        )
    within = {a: sizes[a] // across[a] for a in AXES}
    return across, within


def hybrid_device_array(devices, sizes: dict[str, int]) -> np.ndarray:
    """Devices arranged for a multi-process mesh: outer axes over processes, inner within.

    Processes are ordered by `process_index` and each process's devices by id. The result
    plays the role of `jax.experimental.mesh_utils.create_hybrid_device_mesh` with one
    granule per process, on any platform.

    Args:
        devices: every device of the job.
        sizes: resolved axis sizes, in `AXES` order.

    Returns:
        An object array of devices shaped like the mesh.
    """
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    counts = {p: len(ds) for p, ds in sorted(by_process.items())}
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"mesh: processes have different device counts ({counts}); a mesh across "
            "processes needs the same number of devices on each"
        )
    n_proc, n_local = len(counts), next(iter(counts.values()))
    across, within = host_layout(sizes, n_proc, n_local)
    grid = np.empty((n_proc, n_local), dtype=object)
    for row, p in enumerate(sorted(by_process)):
        grid[row, :] = sorted(by_process[p], key=lambda d: d.id)
    k = len(AXES)
    grid = grid.reshape(tuple(across[a] for a in AXES) + tuple(within[a] for a in AXES))
    # (across_0..across_5, within_0..within_5) -> (across_0, within_0, across_1, ...)
    order = [i for pair in zip(range(k), range(k, 2 * k), strict=True) for i in pair]
    return grid.transpose(order).reshape(tuple(sizes[a] for a in AXES))


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """Axis sizes of `mesh` as a dict."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))  # also an AbstractMesh


def describe(mesh: Mesh) -> str:
    """One line such as ``data=2 × fsdp=2 × tensor=2 (8 cpu devices)``."""
    platform = mesh.devices.flat[0].platform
    return f"{describe_sizes(mesh_sizes(mesh))} ({mesh.devices.size} {platform} devices)"


def describe_sizes(sizes) -> str:
    """The axes larger than 1, such as ``data=4 × seq=2`` (``1 device`` when there are none)."""
    return " × ".join(f"{n}={s}" for n, s in sizes.items() if s > 1) or "1 device"


def with_device_count(xla_flags: str, n: int) -> str:
    """`xla_flags` with its simulated CPU device count set to `n` (any earlier one replaced)."""
    flags = [f for f in xla_flags.split() if "xla_force_host_platform_device_count" not in f]
    return " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])


def simulate_devices(n: int) -> None:
    """Makes jax use `n` simulated CPU devices, for laptops and notebooks.

    Call it before any jax computation. It selects the CPU platform, even where a GPU is
    present. If jax already started with `n` or more devices it does nothing; with fewer, it
    raises, because the count can no longer change.

    Args:
        n: the number of CPU devices to simulate.
    """
    raise_if(validate.positive("n", n, note="CPU devices to simulate"))
    if jax_backends_started():
        have = jax.device_count()
        if have >= n:
            return
        raise ValueError(
            f"simulate_devices({n}): jax has already started with {have} device(s) and the "
            "count cannot change in this process; call simulate_devices first thing (in a "
            "notebook: restart the kernel and run it in the first cell), or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting Python"
        )
    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), n)
    jax.config.update("jax_num_cpu_devices", n)
    jax.config.update("jax_platforms", "cpu")  # simulated devices are CPU ones, even beside a GPU
