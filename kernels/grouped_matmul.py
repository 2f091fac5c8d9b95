"""Grouped matmul at active cost: rows grouped by expert, each group times its own weights.

``y[r] = x[r] @ w[g(r)]`` where the rows of `x` come in groups (group l holds ``sizes[l]``
consecutive rows, in order) and rows past the last group give zeros, as
`jax.lax.ragged_dot` defines it. Two implementations:

- ``"tiled"`` (plain JAX, every backend): the Megablox idea without a custom kernel. The rows
  are cut into tiles of R rows; a *visit* is one (tile, group) pair whose rows overlap, so a
  tile that straddles a group boundary is visited once per group it holds. A loop runs only
  the visits the sizes need (a data-dependent trip count: ``⌈rows / R⌉ + groups − 1`` at
  most), each one ``[R, D] @ [D, F]`` with its group's weights, writing only its group's rows.
  The work is the active rows' plus at most one partial tile per group; rows past the last
  group cost nothing. The backward (a custom VJP) runs the same visits: the input gradient
  through the transposed weights, each group's weight gradient from its own rows.
- ``"xla"``: `jax.lax.ragged_dot`. On CPU it lowers to a dense product of every row with
  every group's weights (``groups ×`` the active work); on GPU its cost is measured in the
  MoE guide.

``"auto"`` takes the faster of the two measured on the GPU, ``"xla"`` on a GPU not measured,
and ``"tiled"`` off a GPU (see `auto_impl`).
Shape suffixes: M rows, D input width, F output width, L groups, V visits, R tile rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from meshtrain._compat import varying_axes
from meshtrain.kernels import _args, _common, autotable
from meshtrain.layout import varying
from meshtrain.layout.per_shard import typed_like

IMPLS = ("tiled", "xla", "auto")
CPU_TILE = 16
# On a GPU (H200, bf16, 16384 rows over 8 groups, D 4096, F 14336; forward + backward): tiles of
# 64 / 128 / 256 / 512 / 1024 / 2048 rows ran 405 / 216 / 123 / 87 / 71 / 75 ms, ragged_dot
# 184 ms (benchmarks/results/2026-11-26-h200-grouped_matmul.jsonl). Tall tiles fill the
# matrix units and amortise each visit's loop step; a tile taller than half a mean group
# wastes its rows in padding.
GPU_TILES = (64, 1024)


def tile_rows(rows: int, groups: int, backend: str | None = None) -> int:
    """The tile height of the tiled grouped matmul for `rows` rows in `groups` groups on
    `backend` (default: jax's): 16 on CPU; on a GPU the largest power of two within half a
    mean group, between 64 and 1024."""
    if (backend or jax.default_backend()) == "cpu":
        return CPU_TILE
    half_group = max(1, rows // (2 * groups))
    lo, hi = GPU_TILES
    return min(hi, max(lo, 1 << (half_group.bit_length() - 1)))


def auto_impl(rows: int = 0) -> str:
    """What ``impl="auto"`` runs for `rows` rows: on a GPU the faster of the two measured on
    that device kind (`autotable`; on an H200 the tiled loop ran 2.1× faster than ragged_dot,
    forward + backward at 16384 rows), XLA's ragged_dot where nothing was measured; off a GPU
    the tiled loop (XLA's CPU ragged_dot is a dense product over every group)."""
    if not _common.on_gpu():
        return "tiled"
    found = autotable.fastest("grouped_matmul", {"rows": rows}, ("tiled", "xla"))
    return "xla" if found is None else found.impl


def visits(sizes_L: jax.Array, tile: int) -> jax.Array:
    """How many tile products the tiled grouped matmul runs for these group sizes: each
    group's tiles, counting a tile shared by two groups once per group."""
    return _Visits(sizes_L, 1, tile).count


def grouped_matmul(
    x_MD: jax.Array,
    w_LDF: jax.Array,
    sizes_L: jax.Array,
    *,
    impl: str = "auto",
    tile: int | None = None,
) -> jax.Array:
    """Each group of rows of `x_MD` times its group's weights.

    Args:
        x_MD: rows, grouped: group l is ``sizes_L[l]`` consecutive rows, groups in order;
            rows past ``sum(sizes_L)`` are ignored (their outputs are zero).
        w_LDF: one weight matrix per group.
        sizes_L: integer rows per group, each ≥ 0, summing to at most M. Known sizes (not
            traced) that break this are refused; traced ones (under jit) are cut to fit:
            a negative size counts as 0 and the groups end at row M.
        impl: ``"tiled"``, ``"xla"`` (`jax.lax.ragged_dot`) or ``"auto"``.
        tile: rows per tile of ``"tiled"``, a whole number ≥ 1 (default `tile_rows`).

    Returns:
        [M, F] in the dtype of `x_MD` (float32 accumulation).

    Raises:
        ValueError: one line naming the argument and a fix: an unknown `impl`, a `tile` that
            is not a whole number ≥ 1, shapes that do not chain, sizes that are not integers,
            or known sizes below 0 or claiming more than M rows.
    """
    sizes_L = _checked_sizes(x_MD, w_LDF, sizes_L, impl, tile)
    if impl == "auto":
        impl = auto_impl(x_MD.shape[0])
    if impl == "xla":
        return lax.ragged_dot(x_MD, w_LDF, sizes_L)
    R = tile or tile_rows(x_MD.shape[0], w_LDF.shape[0])
    return _tiled(x_MD, w_LDF, sizes_L, R)


def _checked_sizes(x_MD, w_LDF, sizes_L, impl, tile) -> jax.Array:
    """`sizes_L` as int32 cut to fit M rows, after refusing arguments `grouped_matmul` cannot
    take (see its Raises)."""
    name = "grouped_matmul"
    if impl not in IMPLS:
        raise ValueError(f"{name}: impl={impl!r} is not one of {', '.join(IMPLS)}")
    _args.whole(name, "tile", tile, example=CPU_TILE)
    sizes_L = jnp.asarray(sizes_L)
    if (x_MD.ndim, w_LDF.ndim, sizes_L.ndim) != (2, 3, 1):
        raise ValueError(
            f"{name}: x {x_MD.shape}, w {w_LDF.shape} and sizes {sizes_L.shape} must be "
            "[M, D], [L, D, F] and [L]; flatten the rows of x to two dimensions"
        )
    (M, D), (L, Dw, _) = x_MD.shape, w_LDF.shape
    if D != Dw or sizes_L.shape[0] != L:
        raise ValueError(
            f"{name}: x {x_MD.shape}, w {w_LDF.shape} and sizes {sizes_L.shape} do not chain; "
            f"give w [L, {D}, F] and one size per group of w ([{L}])"
        )
    _args.integers(name, "sizes", sizes_L)
    known = _args.concrete(sizes_L)
    if known is not None and known.min(initial=0) < 0:
        raise ValueError(f"{name}: sizes={known.tolist()} hold a negative size; use 0 or more")
    if known is not None and known.sum() > M:
        raise ValueError(
            f"{name}: sizes={known.tolist()} claim {known.sum()} rows but x has {M}; give sizes "
            f"summing to at most {M} (rows past the sum give zeros)"
        )
    return _fitted(sizes_L.astype(jnp.int32), M)


def _fitted(sizes_L: jax.Array, M: int) -> jax.Array:
    """The group sizes cut to M rows in all: negative sizes count as 0, and a group past
    row M loses its rows beyond it (a no-op for sizes that already fit)."""
    sizes_L = jnp.maximum(sizes_L, 0)
    ends_L = jnp.cumsum(sizes_L)
    return jnp.minimum(ends_L, M) - jnp.minimum(ends_L - sizes_L, M)


class _Visits:
    """The (tile, group) pairs whose rows overlap, group by group; `count` of them are real."""

    def __init__(self, sizes_L: jax.Array, n_tiles: int, R: int):
        L = sizes_L.shape[0]
        self.ends_L = jnp.cumsum(sizes_L)
        self.starts_L = self.ends_L - sizes_L
        first_L = self.starts_L // R
        count_L = jnp.where(sizes_L > 0, (self.ends_L - 1) // R - first_L + 1, 0)
        vend_L = jnp.cumsum(count_L)
        self.count = vend_L[-1]
        v_V = jnp.arange(n_tiles + L - 1)
        # the first group whose visits end past v (a count, as jnp.searchsorted does not
        # take values that vary over manual axes)
        after_V = jnp.sum(vend_L[None, :] <= v_V[:, None], axis=1)
        self.group_V = jnp.minimum(after_V, L - 1)
        self.tile_V = first_L[self.group_V] + v_V - (vend_L - count_L)[self.group_V]

    def rows(self, v, R: int):
        """Visit `v`: its group, its first row, and which of its R rows are the group's."""
        g, start = self.group_V[v], self.tile_V[v] * R
        r_R = start + jnp.arange(R)
        return g, start, (r_R >= self.starts_L[g]) & (r_R < self.ends_L[g])


def _zeros(shape, dtype, *like) -> jax.Array:
    """Zeros varying over every manual axis any of `like` varies over (a loop carry)."""
    axes = frozenset().union(*(varying_axes(a) for a in like))
    return varying(jnp.zeros(shape, dtype), axes) if axes else jnp.zeros(shape, dtype)


def _padded(x_MD: jax.Array, R: int) -> jax.Array:
    """`x_MD` with zero rows appended up to a multiple of R."""
    M = x_MD.shape[0]
    pad = -M % R
    return jnp.pad(x_MD, ((0, pad), (0, 0))) if pad else x_MD


def _forward(x_MD, w_LDF, sizes_L, R, *, contract_w: int):
    """The visits' products ``x_tile · w[g]`` contracting w's axis `contract_w` (1 forward,
    2 for the input gradient through the transposed weights), written group by group."""
    M = x_MD.shape[0]
    xp = _padded(x_MD, R)
    visits = _Visits(sizes_L, xp.shape[0] // R, R)
    out_dim = w_LDF.shape[3 - contract_w]
    dims = (((1,), (contract_w - 1,)), ((), ()))

    def body(v, y):
        g, start, mine_R = visits.rows(v, R)
        x_RD = lax.dynamic_slice_in_dim(xp, start, R)
        y_RF = lax.dot_general(x_RD, w_LDF[g], dims, preferred_element_type=jnp.float32)
        old_RF = lax.dynamic_slice_in_dim(y, start, R)
        new_RF = jnp.where(mine_R[:, None], y_RF.astype(y.dtype), old_RF)
        return lax.dynamic_update_slice_in_dim(y, new_RF, start, 0)

    y = _zeros((xp.shape[0], out_dim), x_MD.dtype, x_MD, w_LDF, sizes_L)
    return lax.fori_loop(0, visits.count, body, y)[:M]


def _weight_grad(x_MD, dy_MF, w_LDF, sizes_L, R):
    """Each group's ``x_gᵀ · dy_g`` from its own rows of the visited tiles, in float32."""
    xp, dyp = _padded(x_MD, R), _padded(dy_MF, R)
    visits = _Visits(sizes_L, xp.shape[0] // R, R)

    def body(v, dw):
        g, start, mine_R = visits.rows(v, R)
        x_RD = jnp.where(mine_R[:, None], lax.dynamic_slice_in_dim(xp, start, R), 0)
        dy_RF = lax.dynamic_slice_in_dim(dyp, start, R)
        part_DF = lax.dot_general(x_RD, dy_RF, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)  # fmt: skip
        return dw.at[g].add(part_DF)

    dw = _zeros(w_LDF.shape, jnp.float32, x_MD, dy_MF, w_LDF, sizes_L)
    return lax.fori_loop(0, visits.count, body, dw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(x_MD, w_LDF, sizes_L, R):
    """The tiled grouped matmul (see the module docstring)."""
    return _forward(x_MD, w_LDF, sizes_L, R, contract_w=1)


def _tiled_fwd(x_MD, w_LDF, sizes_L, R):
    return _tiled(x_MD, w_LDF, sizes_L, R), (x_MD, w_LDF, sizes_L)


def _tiled_bwd(R, res, dy_MF):
    x_MD, w_LDF, sizes_L = res
    dx_MD = _forward(dy_MF.astype(x_MD.dtype), w_LDF, sizes_L, R, contract_w=2)
    dw_LDF = _weight_grad(x_MD, dy_MF.astype(x_MD.dtype), w_LDF, sizes_L, R)
    dx_MD, dw_LDF, _ = typed_like((dx_MD, dw_LDF, None), res)  # dW summed in float32
    return dx_MD, dw_LDF.astype(w_LDF.dtype), None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
