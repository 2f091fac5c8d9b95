"""The tiled grouped matmul (kernels/grouped_matmul.py) and dropless dispatch at active cost.

- The grouped matmul equals a loop over its groups, in value and both gradients, with empty
  groups, one group taking every row, groups that do not fill whole tiles and rows past the
  last group; float32 and bfloat16.
- It runs only the tile products the sizes need: the visit count against its bound, and the
  work a dropless layer runs on a real routing against the active work at expert = 1, 2, 4, 8
  (at most 1.25× the active work); compiled, the dropless layer holds no product over every
  expert (XLA's ragged_dot does on CPU: the same check fails for it).
- Dropless dispatch with the tiled matmul equals it with ragged_dot (today's implementation)
  under expert parallelism, also with tensor parallelism inside the experts.
- The ragged exchange (`jax.lax.ragged_all_to_all`, GPU only) equals the padded exchange on
  CPU through a reference of the op built from all-gathers, and lowers for H100s.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_helpers import export_for_cuda, h100
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from meshtrain.kernels import grouped_matmul as gmm
from meshtrain.layout import activation_rules, named, rules_for, state_specs
from meshtrain.mesh import make_mesh
from meshtrain.models import MoEConfig, moe_dispatch
from meshtrain.models.moe import Experts
from meshtrain.state import abstract_model, abstract_target

# One worker runs the module: the layer runs are shared between tests (`_layer`).
pytestmark = pytest.mark.xdist_group("grouped_matmul")

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
SIZES = {
    "empty groups": [7, 0, 20, 3, 0],
    "one group takes all": [0, 0, 37, 0, 0],
    "ragged, rows past the groups": [5, 9, 1, 13, 2],
}


def _per_row(x_MD, w_LDF, sizes_L):
    """Each row times its own group's weights, in float32 (rows past the groups: 0)."""
    group_M = jnp.searchsorted(jnp.cumsum(sizes_L), jnp.arange(x_MD.shape[0]), side="right")
    w_MDF = w_LDF.astype(jnp.float32)[jnp.minimum(group_M, w_LDF.shape[0] - 1)]
    y_MF = jnp.einsum("md,mdf->mf", x_MD.astype(jnp.float32), w_MDF)
    return jnp.where((group_M < w_LDF.shape[0])[:, None], y_MF, 0.0)


@functools.cache
def _value_and_grads(impl, tile):
    """jit(x, w, dy, sizes) → the output and (dx, dw) of ``sum(f(x, w) · dy)``, for `impl`
    (None: the per-row reference). The sizes are an input, so the cases of one shape and dtype
    share one program."""

    def run(x, w, dy, sizes_L):
        if impl is None:
            fn = functools.partial(_per_row, sizes_L=sizes_L)
        else:
            fn = functools.partial(gmm.grouped_matmul, sizes_L=sizes_L, impl=impl, tile=tile)
        loss = lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) * dy)  # noqa: E731
        return fn(x, w), jax.grad(loss, (0, 1))(x, w)

    return jax.jit(run)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(SIZES))
@pytest.mark.parametrize("impl, tile", [("tiled", 4), ("tiled", 16), ("xla", None)])
def test_grouped_matmul_equals_a_loop_over_groups(case, dtype, impl, tile):
    sizes = SIZES[case]
    M, D, F, L = 37, 8, 12, len(sizes)
    kx, kw, kd = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 3)
    x = jax.random.normal(kx, (M, D), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (L, D, F), jnp.float32).astype(dtype)
    dy = jax.random.normal(kd, (M, F), jnp.float32)
    sizes_L = jnp.asarray(sizes, jnp.int32)
    # the reference on the same (possibly bf16-rounded) inputs in float32: one program
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    y, grads = _value_and_grads(impl, tile)(x, w, dy, sizes_L)
    want, refs = _value_and_grads(None, None)(f32(x), f32(w), dy, sizes_L)
    x64, w64, start = np.asarray(f32(x), np.float64), np.asarray(f32(w), np.float64), 0
    for g, n in enumerate(sizes):  # the reference is each group's rows times its weights
        rows = slice(start, start + n)
        np.testing.assert_allclose(want[rows], x64[rows] @ w64[g], rtol=1e-5, atol=1e-5)
        start += n
    assert y.dtype == dtype
    np.testing.assert_allclose(f32(y), want, rtol=TOL[dtype], atol=TOL[dtype] * 4)
    for name, g, r in zip(("x", "w"), grads, refs, strict=True):
        assert g.dtype == dtype, name
        scale = float(jnp.max(jnp.abs(r)))
        err = float(jnp.max(jnp.abs(f32(g) - r))) / scale
        assert err < TOL[dtype] * 4, (name, err)
    if sum(sizes) < M:  # rows past the last group: zero output and zero input gradient
        assert not np.any(np.asarray(y)[sum(sizes) :]) and not np.any(want[sum(sizes) :])
        assert not np.any(np.asarray(grads[0], np.float32)[sum(sizes) :])


def test_a_bad_impl_is_one_line():
    with pytest.raises(ValueError, match=r"grouped_matmul: impl='dense' is not one of tiled, "):
        gmm.grouped_matmul(jnp.ones((4, 2)), jnp.ones((1, 2, 2)), jnp.array([4]), impl="dense")


def test_a_bad_tile_is_one_line():
    with pytest.raises(ValueError, match=r"grouped_matmul: tile=-4 must be ≥ 1 and a whole number"):
        gmm.grouped_matmul(jnp.ones((4, 2)), jnp.ones((1, 2, 2)), jnp.array([4]), tile=-4)


# one program per group count and tile height (the tile is static, the sizes an input)
_visits = jax.jit(gmm.visits, static_argnums=1)


def test_visits_cover_each_group_with_at_most_one_partial_tile_more():
    rng = np.random.default_rng()
    for _ in range(50):
        # one group, a few, many: each (L, R) pair is one program
        L, R = int(rng.choice([1, 3, 11])), int(rng.choice([4, 16, 64]))
        sizes = rng.multinomial(int(rng.integers(0, 400)), rng.dirichlet(np.ones(L) * 0.3))
        n = int(_visits(jnp.asarray(sizes, jnp.int32), R))
        # every group's rows in whole tiles of its own, at most one partial tile per group
        assert sum(-(-s // R) for s in sizes) <= n, sizes
        assert n <= -(-sizes.sum() // R) + np.count_nonzero(sizes) - 1 + (sizes.sum() == 0)
        assert n * R < sizes.sum() + L * R, sizes


def test_tile_rows_per_backend():
    assert gmm.tile_rows(4096, 8, "cpu") == gmm.CPU_TILE
    assert gmm.tile_rows(16384, 8, "gpu") == 1024  # a mean group of 2048 rows
    assert gmm.tile_rows(2048, 8, "gpu") == 128
    assert gmm.tile_rows(100, 8, "gpu") == 64  # never below the smallest GPU tile


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_dropless_work_is_within_a_quarter_of_the_active_work(shards):
    """benchmarks/moe.py's shape (E = 8, k = 2, 256 tokens per device): the tile products a
    dropless layer runs over the active rows, on a router's real choices."""
    cfg = MoEConfig(d_model=256, n_heads=4, n_experts=8, top_k=2, d_expert=512)
    rng = np.random.default_rng()
    x = rng.standard_normal((16, 128, cfg.d_model), np.float32)
    router = rng.standard_normal((cfg.d_model, cfg.n_experts), np.float32) * 0.02
    expert_BTK = np.argsort(-(x @ router), axis=-1)[..., : cfg.top_k]  # the router's top k
    R, run, active = gmm.CPU_TILE, 0, 0
    for sizes in moe_dispatch.shard_sizes(expert_BTK, cfg.n_experts, shards, row_blocks=8):
        run += int(_visits(jnp.asarray(sizes, jnp.int32), R)) * R
        active += int(sizes.sum())
    assert active == 16 * 128 * cfg.top_k
    assert run / active <= 1.25, run / active


@pytest.mark.parametrize("impl, dense", [("tiled", False), ("xla", True)])
def test_compiled_dropless_layer_has_no_product_over_every_expert(impl, dense):
    """XLA counts a loop body once: the tiled layer's compiled FLOPs stay below the active
    work (each visit is one tile), ragged_dot's dense product is 8/k × over it."""
    cfg = MoEConfig(d_model=64, n_heads=4, n_experts=8, top_k=2, d_expert=128,
                    dispatch="dropless", grouped_impl=impl)  # fmt: skip
    graphdef, state = nnx.split(Experts(cfg, rngs=nnx.Rngs(0)))
    x = jnp.ones((4, 32, cfg.d_model))

    def loss(p, x):
        return jnp.sum(nnx.merge(graphdef, p)(x)[0] ** 2)

    cost = jax.jit(jax.grad(loss, (0, 1))).lower(nnx.to_pure_dict(state), x).compile()
    cost = cost.cost_analysis()
    flops = float((cost[0] if isinstance(cost, list) else cost)["flops"])
    active = 3 * 6 * 4 * 32 * cfg.top_k * cfg.d_model * cfg.expert_dim
    assert (flops > active) == dense, (flops, active)


def _experts_grads(cfg, spec: str, strategy: str, x, r):
    """(loss, grads wrt params and x) of one MoE layer on `spec`, its parameters laid out."""
    n = int(np.prod([int(p.split("=")[1]) for p in spec.split(",")]))
    mesh = make_mesh(spec, devices=jax.devices()[:n])
    rules = rules_for(strategy, mesh)
    graphdef, state = nnx.split(Experts(cfg, rngs=nnx.Rngs(0)))
    params = jax.device_put(
        nnx.to_pure_dict(state), named(state_specs(state, rules.params, mesh, warn=False), mesh)
    )

    def loss(p, x):
        with activation_rules(mesh, rules):
            y, stats = nnx.merge(graphdef, p)(x)
        return jnp.sum(y * r) + stats["aux_loss"]

    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss, (0, 1)))(params, x)


SMALL = MoEConfig(d_model=32, n_heads=2, n_experts=8, top_k=2, d_expert=16, dispatch="dropless")
_GRADS: dict = {}


def _layer(spec: str, strategy: str, impl: str, exchange: str, monkeypatch=None):
    """`_experts_grads` of SMALL with the grouped matmul `impl` and the `exchange`, on one
    input drawn fresh per module run; each run once (the padded tiled runs are the reference
    of both the ragged_dot and the ragged exchange comparisons)."""
    key = (spec, strategy, impl, exchange)
    if key not in _GRADS:
        if "inputs" not in _GRADS:
            kx, kr = jax.random.split(jax.random.key(np.random.randint(1 << 30)))
            _GRADS["inputs"] = jax.random.normal(kx, (8, 8, 32)), jax.random.normal(kr, (8, 8, 32))
        if exchange == "ragged":
            monkeypatch.setattr(moe_dispatch, "exchange_impl", lambda: "ragged")
            monkeypatch.setattr(moe_dispatch, "_ragged_all_to_all", _reference_ragged_all_to_all)
        cfg = dataclasses.replace(SMALL, grouped_impl=impl)
        _GRADS[key] = _experts_grads(cfg, spec, strategy, *_GRADS["inputs"])
    return _GRADS[key]


# Expert parallelism with data (the smallest expert split), and tensor parallelism inside the
# experts; tests/test_moe.py runs the (tiled) dropless layer on expert=8 and fsdp=2,expert=4.
@pytest.mark.parametrize(
    "spec, strategy", [("data=4,expert=2", "dp"), ("data=2,expert=2,tensor=2", "dp+tp")]
)
def test_dropless_tiled_equals_ragged_dot_under_expert_parallelism(spec, strategy):
    got = _layer(spec, strategy, "tiled", "padded")
    want = _layer(spec, strategy, "xla", "padded")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        assert float(jnp.max(jnp.abs(w))) > 0
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def _reference_ragged_all_to_all(x, out, in_offsets, send_sizes, out_offsets, recv_sizes, *, axis):
    """`jax.lax.ragged_all_to_all`'s documented semantics from all-gathers (its CPU stand-in):
    source j's rows ``[in_offsets_j[me], + send_sizes_j[me])`` land at ``out_offsets_j[me]``."""
    del recv_sizes  # implied by the senders' sizes
    me = jax.lax.axis_index(axis)
    xs, offs, sizes, lands = (
        jax.lax.all_gather(a, axis) for a in (x, in_offsets, send_sizes, out_offsets)
    )
    r = jnp.arange(out.shape[0])
    for j in range(xs.shape[0]):
        at = r - lands[j, me]
        ok = (at >= 0) & (at < sizes[j, me])
        rows = xs[j][jnp.clip(offs[j, me] + at, 0, x.shape[0] - 1)]
        out = jnp.where(ok[:, None], rows, out)
    return out


# The smallest expert split and the whole mesh as one expert axis.
@pytest.mark.parametrize("spec", ["data=4,expert=2", "expert=8"])
def test_ragged_exchange_equals_the_padded_exchange(monkeypatch, spec):
    want = _layer(spec, "dp", "tiled", "padded")
    got = _layer(spec, "dp", "tiled", "ragged", monkeypatch)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_ragged_exchange_lowers_for_h100s(monkeypatch):
    """The dropless layer's forward and backward over ``expert=4`` exported for CUDA on
    abstract H100s: two ragged all-to-alls forward (there and back), two backward."""
    monkeypatch.setattr(moe_dispatch, "exchange_impl", lambda: "ragged")
    mesh = AbstractMesh((2, 4), ("data", "expert"), (AxisType.Auto,) * 2,
                        abstract_device=h100())  # fmt: skip
    rules = rules_for("dp", {"data": 2, "expert": 4})
    graphdef, state = abstract_model(lambda: Experts(SMALL, rngs=nnx.Rngs(0)))
    specs = named(state_specs(state, rules.params, mesh, warn=False), mesh)
    params = abstract_target(nnx.to_pure_dict(state), specs)
    x = jax.ShapeDtypeStruct((8, 8, 32), jnp.float32)

    def loss(p, x):
        with activation_rules(mesh, rules):
            return jnp.sum(nnx.merge(graphdef, p)(x)[0] ** 2)

    exported = export_for_cuda(
        jax.grad(loss, (0, 1)), (params, x), mesh, custom_call="ragged_all_to_all"
    )
    assert exported.mlir_module().count("custom_call @ragged_all_to_all") == 4
