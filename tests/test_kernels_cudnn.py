"""cuDNN's fused attention as meshtrain runs it: differentiated per shard (`kernels._shard_vjp`),
so it runs in a region nested in a manual one (a pipeline stage, the replicas' own step), and
over packed documents through cuDNN's packed layout (`kernels._cudnn_attention`).

Without a GPU, `cudnn_stand_in` serves the same calls with jax's XLA attention (the packed one
as cuDNN documents its offsets and lengths): the gradients through meshtrain's per-shard custom
VJP are compared with the jnp reference's. The cuda exports then show the real cuDNN forward
and backward calls in the programs (jax's cuDNN version check is answered for the export:
nothing runs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cudnn import CUDNN_CALLS, cudnn_for_export, cudnn_stand_in
from _helpers import packed_layout
from _kernel_helpers import TOL, assert_close, fresh_key
from flax import nnx
from jax import export
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from meshtrain import GPTConfig, RunSpec, layout
from meshtrain.kernels import attention
from meshtrain.kernels._cudnn_attention import documents
from meshtrain.layout import batch_shardings, rules_for
from meshtrain.lower import init_train_state, jit_train_step
from meshtrain.mesh import make_mesh
from meshtrain.pipeline import PipelineConfig
from meshtrain.replicas import SyncConfig, with_sync
from meshtrain.run import TrainConfig

B, T, H, G, K = 4, 32, 4, 2, 64  # 4 query heads on tensor=4, 2 key/value heads picked


def _inputs(key, packed=False):
    """bfloat16 queries, keys and values (cuDNN's dtype), a float32 cotangent weight and, when
    `packed`, segment ids."""
    keys = jax.random.split(key, 5)
    q = jax.random.normal(keys[0], (B, T, H, K), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (B, T, G, K), jnp.bfloat16) for kk in keys[1:3])
    rng = np.random.default_rng(int(jax.random.randint(keys[4], (), 0, 2**30)))
    seg = jnp.asarray(packed_layout(rng, B, T)[0]) if packed else None
    return q, k, v, jax.random.normal(keys[3], (B, T, H, K)), seg


def _grads(impl, w, seg):
    """The gradients of a weighted sum of `impl`'s attention (the reference in float32)."""

    def loss(q, k, v):
        if impl == "xla":
            q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        o = attention.flash_attention(q, k, v, impl=impl, segment_ids=seg)
        return (o.astype(jnp.float32) * w).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def test_documents_are_each_rows_runs_of_equal_ids():
    seg = packed_layout(np.random.default_rng(fresh_key()[1]), 3, 40)[0]
    lengths, offsets = (np.asarray(a) for a in documents(jnp.asarray(seg)))
    for row, length, offset in zip(seg, lengths, offsets, strict=True):
        starts = [t for t in range(len(row)) if t == 0 or row[t] != row[t - 1]]
        n = len(starts)
        assert list(offset[:n]) == starts and set(offset[n:]) == {-1}
        assert list(length[:n]) == list(np.diff([*starts, len(row)])) and set(length[n:]) <= {-1}


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("nested", [False, True], ids=["layout", "inside-a-manual-region"])
def test_cudnn_gradients_per_shard_equal_the_reference(monkeypatch, nested, packed):
    calls = cudnn_stand_in(monkeypatch)
    key, seed = fresh_key()
    q, k, v, w, seg = _inputs(key, packed)
    mesh = _mesh((2, 1, 4), ("data", "fsdp", "tensor"))
    rules = layout.rules_for("dp+tp")
    segs = () if seg is None else (seg,)
    if not nested:
        want = _grads("xla", w, seg)(q, k, v)

        def fn(q, k, v, *segs):
            with layout.activation_rules(mesh, rules):
                return _grads("cudnn", w, *segs or (None,))(q, k, v)
    else:  # each data shard differentiates its own block, as a pipeline stage does
        halves = [slice(0, B // 2), slice(B // 2, B)]
        per = [_grads("xla", w[s], None if seg is None else seg[s])(q[s], k[s], v[s])
               for s in halves]  # fmt: skip
        want = [jnp.concatenate([p[i] for p in per]) for i in range(3)]

        def fn(q, k, v, *segs):
            def stage(q, k, v, w, *segs):
                return _grads("cudnn", w, *segs or (None,))(q, k, v)

            with layout.activation_rules(mesh, rules):
                region = layout.manual_region(
                    stage, mesh=mesh, axes={"data"}, in_specs=(P("data"),) * (4 + len(segs)),
                    out_specs=(P("data"),) * 3,
                )  # fmt: skip
                return region(q, k, v, w, *segs)

    got = jax.jit(fn)(q, k, v, *segs)
    assert calls and ("cudnn-packed" in calls) == packed  # cuDNN's path, packed when packed
    for g, r, name in zip(got, want, "qkv", strict=True):
        assert_close(g, r, TOL[jnp.bfloat16][1], f"d{name}", seed)


def _export(fn, *shapes):
    spec = lambda s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
    args = [spec(s) if len(s) == 4 else spec(s, jnp.int32) for s in shapes]
    exported = export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(c) for c in CUDNN_CALLS],
    )(*args)
    return exported.mlir_module()


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_cudnn_inside_a_pipeline_stage_exports_for_cuda_with_the_fused_calls(monkeypatch, packed):
    """A stage (a region manual over ``pipe``) differentiating cuDNN's attention, heads over
    ``tensor``: the program for ``cuda`` holds one cuDNN forward and one backward call, which
    jax's own differentiation of the nested region could not produce; packed, the calls carry
    cuDNN's packed layout (a row of up to 128 documents)."""
    cudnn_for_export(monkeypatch)
    mesh = _mesh((2, 2, 2), ("pipe", "data", "tensor"))
    rules = layout.rules_for("dp+tp")

    def stage(q, k, v, *seg):
        def loss(q, k, v):
            o = attention.flash_attention(
                q, k, v, impl="cudnn", segment_ids=seg[0] if seg else None
            )
            return o.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(*layout.varying((q, k, v)))

    def step(q, k, v, *seg):
        with layout.activation_rules(mesh, rules):
            return layout.manual_region(
                stage, mesh=mesh, axes={"pipe"}, in_specs=(P("pipe"),) * (3 + len(seg)),
                out_specs=(P("pipe"),) * 3,
            )(q, k, v, *seg)  # fmt: skip

    n = 128
    shapes = [(2 * B, n, H, K), (2 * B, n, G, K), (2 * B, n, G, K)] + [(2 * B, n)] * packed
    module = _export(step, *shapes)
    assert [module.count(f"@{c}(") for c in CUDNN_CALLS] == [1, 1]
    documents_per_row = n if packed else 1
    assert module.count(f"max_seg_per_batch\\22: {documents_per_row},") == 2


@pytest.mark.parametrize(
    ("mesh_shape", "pipeline", "sync"),
    [("pipe=2,data=4", PipelineConfig(schedule="1f1b", microbatches=4), SyncConfig()),
     ("data=8", PipelineConfig(), SyncConfig(grad_compression="int8")),
     ("data=4,seq=2", PipelineConfig(), SyncConfig())],
    ids=["1f1b-packed", "compression-packed", "ulysses-packed"],
)  # fmt: skip
def test_a_whole_train_step_exports_for_cuda_with_cudnn_inside(monkeypatch, mesh_shape, pipeline,
                                                               sync):  # fmt: skip
    """The jitted train step of a packed GPT with cuDNN attention, pipelined by 1F1B, in the
    replicas' own step (int8 compression) or context-parallel by Ulysses, exported for
    ``cuda``: cuDNN's forward and backward calls are in it, in the packed layout."""
    cudnn_for_export(monkeypatch)
    seq = 64
    cfg = GPTConfig(d_model=128, n_heads=2, n_layers=2, max_seq_len=seq, attention_impl="cudnn",
                    dtype="bfloat16")  # fmt: skip
    mesh = make_mesh(mesh_shape)
    rules = rules_for("dp", mesh, context_parallel="ulysses")  # (used only where seq > 1)
    tx = optax.sgd(0.1)
    graphdef, state, shardings = init_train_state(lambda: cfg.build(rngs=nnx.Rngs(0)), tx, mesh,
                                                  rules)  # fmt: skip
    state, shardings = with_sync(sync, tx, state, shardings, mesh, rules)
    run = RunSpec(mesh=mesh, rules=rules, train=TrainConfig(run_dir=""), pipeline=pipeline,
                  sync=sync)  # fmt: skip
    rows = np.zeros((16, seq), np.int32)
    batch = {"inputs": rows, "targets": rows, "segment_ids": rows + 1,
             "positions": rows + np.arange(seq, dtype=np.int32)}  # fmt: skip
    step = jit_train_step(run, graphdef, tx, shardings, batch_shardings(batch, mesh, rules))
    exported = export.export(
        step.fn,
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(c) for c in CUDNN_CALLS],
    )(state, batch)
    module = exported.mlir_module()
    assert all(module.count(f"@{c}(") >= 1 for c in CUDNN_CALLS)
    assert module.count(f"max_seg_per_batch\\22: {seq},") == module.count("@__cudnn$")


def test_ulysses_with_cudnn_equals_the_reference_over_packed_documents(monkeypatch):
    """Ulysses with cuDNN on each device's heads: the tokens in the balanced order of seq=2,
    packed documents, against the reference over the plain order (forward and gradients)."""
    from meshtrain import context_parallel as cp
    from meshtrain.kernels import reference

    calls = cudnn_stand_in(monkeypatch)
    key, seed = fresh_key()
    q, k, v, w, documents_in_order = _inputs(key, packed=True)
    pos = cp.order(T, 2)  # entry i of the layout holds token pos[i]
    seg = documents_in_order[:, pos]  # each document contiguous in the plain order
    mesh = _mesh((4, 2), ("data", "seq"))

    def loss(q, k, v, impl):
        if impl == "xla":  # the reference over the plain order, read back in the layout's
            plain = np.argsort(pos)
            f32 = (x[:, plain].astype(jnp.float32) for x in (q, k, v))
            o = reference.attention(*f32, segment_ids=seg[:, plain])[:, pos]
        else:
            o = cp.context_attention(q, k, v, pos, mesh=mesh, algorithm="ulysses", impl=impl,
                                     segment_ids=seg)  # fmt: skip
        return (o.astype(jnp.float32) * w).sum(), o

    def both(q, k, v):
        return [jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, impl)
                for impl in ("cudnn", "xla")]  # fmt: skip

    ((_, got), got_grads), ((_, want), want_grads) = jax.jit(both)(q, k, v)
    assert "cudnn-packed" in calls
    assert_close(got, want, TOL[jnp.bfloat16][0], "output", seed)
    for g, r, name in zip(got_grads, want_grads, "qkv", strict=True):
        assert_close(g, r, TOL[jnp.bfloat16][1], f"d{name}", seed)
