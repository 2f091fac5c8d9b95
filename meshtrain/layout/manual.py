"""Regions manual over some mesh axes: the one way meshtrain writes per-device code.

Inside such a region (a partial-manual `jax.shard_map`) the named axes are manual: the code
sees its own block and communicates with collectives over those axes, while every other
axis stays with the compiler. Pipelines are manual over ``pipe``; kernels over whichever
axes their inputs are split on; expert and context parallelism will be manual over
``expert`` and ``seq``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from meshtrain._compat import varies_over, varying_axes
from meshtrain._switch import Switch


def manual_axes() -> frozenset[str]:
    """The mesh axes that are manual where this is traced (empty outside any region)."""
    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


_APART = Switch()


def rows_apart() -> contextlib.AbstractContextManager[None]:
    """Inside it, each device's rows belong to a model copy of its own (local SGD's replicas
    between synchronisations): statistics over the rows (an MoE's router losses) stay per
    device instead of being reduced over the manual batch axes."""
    return _APART.on()


def rows_are_apart() -> bool:
    """Whether this is traced inside `rows_apart`."""
    return _APART.is_on


def varying(tree, axes: Iterable[str] | None = None):
    """`tree` marked as varying over `axes` (default: every manual axis where this is traced).

    Inside a region, a value that starts the same on every device (a zero, a parameter passed
    in whole) must be marked before it meets per-device values in a loop carry, and a
    gradient taken with respect to a marked value stays per device instead of being summed
    there. Outside any region this changes nothing.
    """
    names = tuple(jax.sharding.get_abstract_mesh().manual_axes) if axes is None else tuple(axes)

    def mark(x):
        missing = tuple(a for a in names if not varies_over(x, a))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(mark, tree)


def manual_region(
    fn: Callable,
    *,
    mesh: Mesh,
    axes: Iterable[str] | None,
    in_specs,
    out_specs,
    check_vma: bool = True,
) -> Callable:
    """`fn` as a region manual over `axes` of `mesh`.

    Nesting works: inside an enclosing region (say, a kernel inside a pipeline stage) the new
    region is built on the mesh as the enclosing one sees it and covers only the axes that
    are not manual yet; the specs must then name only those.

    Args:
        fn: per-device code; receives blocks laid out by `in_specs`.
        mesh: the device mesh.
        axes: the mesh axes to make manual; None means every axis not already manual.
        in_specs: one `PartitionSpec` per argument (over manual axes only).
        out_specs: the outputs' `PartitionSpec`s.
        check_vma: let jax check which values vary over the manual axes.

    Returns:
        A function of the same arguments as `fn`.
    """
    outer = manual_axes()
    context = jax.sharding.get_abstract_mesh() if outer else mesh
    names = set(mesh.axis_names if axes is None else axes) - outer
    return jax.shard_map(
        fn,
        mesh=context,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=names,
        check_vma=check_vma,
    )


def nested_unchecked(fn: Callable, args, *, axes: Iterable[str] | None, in_specs, out_specs):
    """``fn(*args)`` per shard in a region over `axes` (None: every axis not manual yet) nested
    in the enclosing manual region, without jax's check of varying axes.

    The arguments enter it unmarked and the outputs leave it marked as varying over every
    enclosing manual axis an argument varies over. Two things need it: per-device code whose
    values carry no such types (Pallas outputs, the interpreter's loops), and jax's own
    splitting of a region it differentiates, which, checking, would name the enclosing axes
    in the specs of the residuals it passes between the halves. Marking is a type, not a
    computation; it is sound only where nothing differentiates the region from outside
    (`meshtrain.layout.per_shard.autodiff_per_shard` differentiates it per shard).
    """
    vary = tuple(sorted(frozenset().union(*(varying_axes(a) for a in args))))

    def unmarked(*blocks):
        # Any op in an unchecked region drops its operand's mark; multiplying by one is folded.
        return fn(*(b * jnp.ones((), b.dtype) for b in blocks))

    mesh = jax.sharding.get_abstract_mesh()
    names = set(mesh.axis_names if axes is None else axes) - manual_axes()
    region = jax.shard_map(
        unmarked, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=names,
        check_vma=False,
    )  # fmt: skip
    return jax.tree.map(lambda o: lax.pcast(o, vary, to="varying") if vary else o, region(*args))


def axis_size(axis: str) -> int:
    """The size of mesh axis `axis` in the active layout (1 outside `activation_rules`)."""
    from meshtrain.layout.context import active

    layout = active()
    return 1 if layout is None else int(layout.mesh.shape.get(axis, 1))


def manual_batch_axes() -> tuple[str, ...]:
    """The batch axes this is traced manual over, in the rules' order (a pipeline stage, the
    replicas' own step); none outside a manual region or outside `activation_rules`."""
    from meshtrain.layout.context import active

    layout, manual = active(), manual_axes()
    if layout is None or not manual:
        return ()
    return layout.rules.batch_axes({a: axis_size(a) for a in manual})


def manual_in_layout(fn: Callable, *, axes: Iterable[str], in_specs, out_specs) -> Callable:
    """`manual_region` over `axes` of the active layout's mesh: for model code, which names no
    mesh. Specs are tuples of mesh-axis entries, one per dimension (``(("data", "expert"),)``
    splits dimension 0), or None for a replicated argument; `in_specs` mirrors the arguments'
    tree, its tuples of entries marked by wrapping them in `Spec`.

    Args:
        fn: per-shard code.
        axes: the mesh axes to make manual.
        in_specs: a tree of `Spec` matching the arguments.
        out_specs: a `Spec` (or tree of them) for the outputs.

    Returns:
        A function of the same arguments as `fn`.
    """
    from meshtrain.layout.context import active

    layout = active()
    if layout is None:
        raise ValueError("manual_in_layout: trace it under meshtrain.layout.activation_rules")

    def to_p(tree):
        return jax.tree.map(lambda s: PartitionSpec(*s.entries), tree, is_leaf=_is_spec)

    return manual_region(
        fn, mesh=layout.mesh, axes=axes, in_specs=to_p(in_specs), out_specs=to_p(out_specs)
    )


class Spec:
    """The layout of one argument of `manual_in_layout`: one mesh-axis entry per dimension."""

    def __init__(self, *entries):
        self.entries = entries


def _is_spec(x) -> bool:
    """A `Spec` leaf."""
    return isinstance(x, Spec)
