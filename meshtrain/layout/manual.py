"""Regions manual over some mesh axes: the one way meshtrain writes per-device code.

Inside such a region (a partial-manual `jax.shard_map`) the named axes are manual: the code
sees its own block and communicates with collectives over those axes, while every other
axis stays with the compiler. Pipelines are manual over ``pipe``; kernels over whichever
axes their inputs are split on; expert and context parallelism will be manual over
``expert`` and ``seq``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
from jax.sharding import Mesh


def manual_axes() -> frozenset[str]:
    """The mesh axes that are manual where this is traced (empty outside any region)."""
    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


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
