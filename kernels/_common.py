"""Shared plumbing: the ``impl=`` switch, backend detection, padding and the shard_map wrapper."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshtrain.kernels import autotable
from meshtrain.layout import active, axes_of, entry_of, manual_axes, manual_region, resolve
from meshtrain.layout.manual import nested_unchecked

IMPLS = ("pallas", "xla", "auto")
ATTENTION_IMPLS = ("pallas", "xla", "cudnn", "auto")


def on_gpu() -> bool:
    """True when the default backend is a GPU."""
    return jax.default_backend() == "gpu"


def hopper_or_later() -> bool:
    """True on an NVIDIA GPU of compute capability 9.0 or later (cuDNN's packed layout)."""
    if not on_gpu():
        return False
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    return tuple(int(x) for x in str(capability).split(".")[:2]) >= (9, 0)


def resolve_impl(
    impl: str,
    *,
    kernel: str,
    allowed: tuple[str, ...] = IMPLS,
    shape: dict | None = None,
    exclude: tuple[str, ...] = (),
) -> str:
    """Checks `impl` and resolves ``"auto"`` (`auto_choice`)."""
    if impl not in allowed:
        raise ValueError(f"{kernel}: impl={impl!r} is not one of {', '.join(allowed)}")
    if impl == "auto":
        return auto_choice(kernel, allowed, shape, exclude).impl
    if impl == "cudnn" and not on_gpu():
        raise ValueError(
            f"{kernel}: impl='cudnn' needs a CUDA GPU, but the backend is "
            f"{jax.default_backend()!r}; use impl='pallas' (interpreted on CPU), 'xla' or 'auto'"
        )
    return impl


def auto_choice(
    kernel: str, allowed: tuple[str, ...], shape: dict | None, exclude: tuple[str, ...] = ()
) -> autotable.Choice:
    """What ``"auto"`` runs for a `kernel` call of `shape` (its sizes by name, as the table's
    rows name them): off a GPU XLA's ops; on one the fastest of `allowed` (less `exclude`,
    what this call cannot take) measured on this device kind (`autotable`), else the safe
    default, cuDNN's attention where allowed and XLA's ops otherwise."""
    if not on_gpu():
        return autotable.Choice("xla", "off a GPU")
    candidates = tuple(i for i in allowed if i != "auto" and i not in exclude)
    found = autotable.fastest(kernel, shape or {}, candidates)
    if found is not None:
        return found
    safe = "cudnn" if "cudnn" in candidates else "xla"
    return autotable.Choice(safe, "not measured on this GPU: the safe default")


def interpret_mode() -> bool:
    """Pallas kernels are interpreted (run as ordinary JAX ops) off the GPU."""
    return not on_gpu()


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ n (Triton block shapes must be powers of two)."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def pad_to(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pads dimension `axis` of `x` up to `size`."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def triton_params(num_warps: int, num_stages: int):
    """Compiler parameters for the Triton lowering (ignored by the interpreter)."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def sharded(fn, args, names, out_names, *, with_axes=False):
    """Runs ``fn(*args)`` per shard, in a region manual over the mesh, when a layout is active.

    Args:
        fn: the kernel call; must act independently on every split dimension.
        args: the array arguments.
        names: one tuple of logical names per argument (None: never split).
        out_names: one tuple of logical names per output (a single tuple: one output).

    Returns:
        ``fn(*args)``; under `meshtrain.layout.activation_rules` each device runs `fn` on its
        own block (batch over data × fsdp, heads over tensor), with no gathering. Each argument
        is split as `meshtrain.layout.constrain` would split an array with its names (the
        layout's one divisibility policy, `meshtrain.layout.resolve`), with each name's size
        taken as the gcd over the arguments that carry it; a name must come out split the same
        way in every argument. With `with_axes`, `fn` also gets ``axes=`` (logical name → the
        mesh axes it is split over), e.g. to find which key/value heads a shard's query heads
        use when the two are split differently.

    Inside a region already manual over some axes (a pipeline stage, a context-parallel
    ring), the arguments are that region's blocks and are split only over the axes still
    with the compiler; the outputs vary over every manual axis an argument varies over. There
    the call must not be differentiated: a kernel puts its custom VJP around `sharded`, whose
    forward and backward rules each call it (see `kernels.norms` for the pattern).
    """
    region = plan_region(args, names, with_axes=with_axes)
    call = region.bind(fn)
    if region.mesh is None:
        return call(*args)
    single = out_names and not isinstance(out_names[0], tuple)
    out_specs = region.spec(out_names) if single else tuple(region.spec(n) for n in out_names)
    return region.run(call, args, out_specs)


class Region(NamedTuple):
    """Where `sharded` runs a call: the mesh (None: no region, call it directly), the axes
    already manual around it, and each logical name's mesh axes."""

    mesh: Any
    outer: frozenset
    resolved: dict
    in_specs: tuple
    with_axes: bool

    def spec(self, arg_names) -> P:
        """The spec of an array with these logical names (None: never split)."""
        return P(*(entry_of(self.resolved.get(n, ()) if n else ()) for n in arg_names))

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes the region is manual over (those not manual around it)."""
        return tuple(a for a in self.mesh.axis_names if a not in self.outer)

    def bind(self, fn):
        """`fn`, given ``axes=`` (logical name → its mesh axes) when asked for."""
        if not self.with_axes:
            return fn
        return functools.partial(fn, axes={k: v for k, v in self.resolved.items() if v})

    def run(self, fn, args, out_specs):
        """``fn(*args)`` per shard: a new region, or one nested in the enclosing one."""
        if not self.outer:
            return manual_region(
                fn, mesh=self.mesh, axes=None, in_specs=self.in_specs, out_specs=out_specs,
                check_vma=False,
            )(*args)  # fmt: skip
        return nested_unchecked(fn, args, axes=None, in_specs=self.in_specs, out_specs=out_specs)


def plan_region(args, names, *, with_axes: bool = False) -> Region:
    """How `sharded` splits `args` (see there): the region's mesh and specs."""
    layout = active()
    outer = frozenset(manual_axes())
    if layout is None:
        if not outer:
            return Region(None, outer, {}, (), with_axes)
        # Inside a manual region but outside any layout: every argument whole.
        whole = tuple(P(*([None] * len(n))) for n in names)
        return Region(jax.sharding.get_abstract_mesh(), outer, {}, whole, with_axes)
    # The gcd of each name's sizes: a split divides the gcd exactly when it divides every
    # argument that carries the name.
    sizes: dict[str, int] = {}
    for arg, arg_names in zip(args, names, strict=True):
        for dim, name in enumerate(arg_names):
            if name is not None:
                sizes[name] = math.gcd(sizes.get(name, 0), arg.shape[dim])
    where = f"kernel inputs {tuple(tuple(a.shape) for a in args)}"
    mesh_sizes = {a: 1 if a in outer else n for a, n in layout.mesh.shape.items()}
    resolved: dict[str, tuple[str, ...]] = {}
    for arg_names in names:
        present = tuple(n for n in arg_names if n is not None)
        spec = resolve(
            present,
            layout.rules.activations,
            mesh_sizes,
            shape=tuple(sizes[n] for n in present),
            where=where,
        )
        for name, part in zip(present, spec, strict=True):
            if resolved.setdefault(name, axes_of(part)) != axes_of(part):
                raise ValueError(
                    f"{where}: logical axis {name!r} is split over {resolved[name]} in one "
                    f"argument and {axes_of(part)} in another; give the kernel's arguments "
                    "their logical names in one order"
                )
    region = Region(layout.mesh, outer, resolved, (), with_axes)
    in_specs = tuple(region.spec(n) for n in names)
    if not outer and all(s == P(*([None] * len(s))) for s in in_specs):
        return Region(None, outer, resolved, in_specs, with_axes)  # nothing split: no region
    return region._replace(in_specs=in_specs)


_POISON: contextvars.ContextVar[bool] = contextvars.ContextVar("kernels_poison", default=False)


@contextlib.contextmanager
def poison_outputs():
    """While tracing inside this block, every kernel's output buffers start out NaN-filled
    (the minimum value for integers), so an element the kernel never writes stays visible."""
    token = _POISON.set(True)
    try:
        yield
    finally:
        _POISON.reset(token)


def _poison_value(dtype):
    """NaN for floats, the smallest value for integers."""
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.nan
    return jnp.iinfo(dtype).min


def pallas_call(kernel, *, out_shape, in_specs, out_specs, **kwargs):
    """`pl.pallas_call` that, under `poison_outputs`, aliases each output onto a poisoned input.

    Takes and returns what `pl.pallas_call` does (``out_shape`` / ``out_specs`` as lists).
    """
    from jax.experimental import pallas as pl

    if not _POISON.get():
        return pl.pallas_call(
            kernel, out_shape=out_shape, in_specs=in_specs, out_specs=out_specs, **kwargs
        )
    single = not isinstance(out_shape, list | tuple)
    shapes = [out_shape] if single else list(out_shape)
    specs = [out_specs] if single else list(out_specs)
    n_in = len(in_specs)

    def wrapped(*refs):
        kernel(*refs[:n_in], *refs[n_in + len(shapes) :])

    call = pl.pallas_call(
        wrapped,
        out_shape=shapes,
        in_specs=[*in_specs, *specs],
        out_specs=specs,
        input_output_aliases={n_in + i: i for i in range(len(shapes))},
        **kwargs,
    )

    def run(*args):
        poison = [jnp.full(s.shape, _poison_value(s.dtype), s.dtype) for s in shapes]
        outs = call(*args, *poison)
        return outs[0] if single else outs

    return run


def row_names(ndim: int) -> tuple[str | None, ...]:
    """Logical names of the leading (row) dimensions of an activation: ``batch``, then ``seq``
    for a [batch, seq, ...] array; rows are independent, so both may be split."""
    names: list[str | None] = ["batch", "seq"][: min(ndim, 2)]
    return tuple(names + [None] * (ndim - len(names)))
