"""Gradient compression (meshtrain.replicas.codecs, .manual) on 8 simulated CPU devices.

- codec none through `reduced_grads` equals the automatic data-parallel gradient (fp32
  reduction-order tolerance) under dp and under dp+tp, where the tensor axis stays automatic;
- each lossy codec's mean of known per-replica tensors against a numpy reference (top-k, sign)
  or its quantisation bound computed here from the inputs (bf16, int8); the residual is what was
  dropped and is carried into the next call;
- the bytes the compiled collectives move, read with the inspector's HLO parser;
- bad ``grad_compression`` values.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshtrain as mt
from meshtrain.comm.hlo import collectives
from meshtrain.comm.report import summarize
from meshtrain.layout import activation_rules, batch_shardings, rules_for
from meshtrain.loss import cross_entropy, loss_and_metrics, loss_mask
from meshtrain.mesh import mesh_sizes
from meshtrain.models.base import call_model
from meshtrain.replicas import (
    Codec,
    ReplicaSets,
    parse_compression,
    reduced_grads,
    residual_init,
)
from meshtrain.state import create_sharded_model

CFG = mt.GPTConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16, vocab_size=64)
B, T = 16, 16
LAYOUTS = {"dp": ("data=4,fsdp=2", "dp"), "dp+tp": ("data=4,tensor=2", "dp+tp")}
# fp32 gradients summed in another order: per leaf, |manual − automatic| ≤ 1e-5 · max|g|
# (measured ≤ 5e-7 relative); a missing replica's share or a wrong 1/R is ≥ 1e-1 of max|g|.
GRAD_RTOL = 1e-5


def _batch(seed=0):
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, T + 1), np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


class _Model:
    """The tiny GPT's graph and parameters on one mesh, and its per-replica `compute`."""

    def __init__(self, mesh_str, strategy):
        self.mesh = mt.make_mesh(mesh_str)
        self.rules = rules_for(strategy, self.mesh)
        self.axes = self.rules.replica_axes(mesh_sizes(self.mesh))
        self.r = math.prod(mesh_sizes(self.mesh)[a] for a in self.axes)
        model = create_sharded_model(lambda: CFG.build(rngs=nnx.Rngs(0)), self.mesh, self.rules)
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.params, self.rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
        sh = batch_shardings(_batch(), self.mesh, self.rules)
        self.batch = {k: jax.device_put(v, sh[k]) for k, v in _batch().items()}

    def loss_of(self, params, rest, batch):
        model = nnx.merge(self.graphdef, params, rest)
        loss, extra = loss_and_metrics(
            cross_entropy, call_model(model, batch), batch["targets"], loss_mask(batch)
        )
        return loss, (nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))), extra)

    def compute(self, params, rest, batch):
        return jax.value_and_grad(self.loss_of, has_aux=True)(params, rest, batch)

    def automatic(self):
        """The automatic data-parallel loss and gradient (XLA places the reduction); computed
        once."""

        def f(params, rest, batch):
            with activation_rules(self.mesh, self.rules):
                (loss, _), grads = self.compute(params, rest, batch)
            return loss, grads

        if not hasattr(self, "_automatic"):
            self._automatic = jax.jit(f)(self.params, self.rest, self.batch)
        return self._automatic

    def manual(self, codec: Codec, error_feedback=True):
        """`reduced_grads` jitted, given the parameters' specs; ``(fn, args)``."""
        specs = jax.tree.map(lambda p: p.sharding.spec, self.params)
        residual = None
        if codec.lossy and error_feedback:
            sharding = NamedSharding(self.mesh, P(self.axes))
            residual = jax.device_put(residual_init(self.params, self.r), sharding)

        def f(params, rest, batch, residual):
            with activation_rules(self.mesh, self.rules):
                return reduced_grads(
                    self.compute,
                    params,
                    rest,
                    batch,
                    residual,
                    sets=ReplicaSets(mesh_sizes(self.mesh), self.axes, mesh=self.mesh),
                    codec=codec,
                    error_feedback=error_feedback,
                    param_specs=specs,
                )

        return jax.jit(f), (self.params, self.rest, self.batch, residual)


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _Model(*LAYOUTS[name])
        return cache[name]

    return get


@pytest.fixture(scope="module")
def compiled(models):
    """The compiled `reduced_grads` of the dp layout and its arguments, per codec (one compile
    each, shared by the equivalence and byte tests)."""
    cache = {}

    def get(spec, layout="dp"):
        if (spec, layout) not in cache:
            fn, args = models(layout).manual(parse_compression(spec))
            cache[spec, layout] = (fn.lower(*args).compile(), args)
        return cache[spec, layout]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.pair("dp", "compression")
@pytest.mark.pair("tp", "compression")
def test_none_equals_the_automatic_data_parallel_gradient(models, compiled, layout):
    m = models(layout)
    assert m.axes == (("data", "fsdp") if layout == "dp" else ("data",))
    loss_ref, grads_ref = m.automatic()
    fn, args = compiled("none", layout)
    (loss, _), grads, residual = fn(*args)
    assert residual is None
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    for (path, g), g_ref in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_ref), strict=True
    ):
        g, g_ref = np.asarray(g), np.asarray(g_ref)
        scale = np.abs(g_ref).max()
        assert scale > 0
        err = np.abs(g - g_ref).max()
        assert err <= GRAD_RTOL * scale, (jax.tree_util.keystr(path), err, scale)


@pytest.mark.pair("tp", "compression")
def test_int8_under_tensor_parallelism_encodes_each_shard_and_gathers_nothing(models, compiled):
    # With the parameters' specs each tensor shard encodes its own part: the tensor-axis
    # traffic is the model's own (as with codec none) and the data-axis bytes are a quarter.
    m = models("dp+tp")
    sizes = mesh_sizes(m.mesh)
    rows = {}
    for spec in ("none", "int8"):
        c, args = compiled(spec, "dp+tp")
        rows[spec] = summarize(collectives(c.as_text(), m.mesh.devices.size), sizes)
        if spec == "int8":
            _, grads, _ = c(*args)
    tensor = {s: sorted((r.kind, r.bytes) for r in rows[s] if r.axes == ("tensor",)) for s in rows}
    assert tensor["int8"] == tensor["none"]
    data = {s: sum(r.wire_bytes for r in rows[s] if r.axes == ("data",)) for s in rows}
    assert abs(data["int8"] / data["none"] - 0.25) <= 0.025, data
    # Two int8 roundings (measured ≤ 1.1e-2 of max|g| per leaf); a shard reduced into the wrong
    # place would be off by the gradient itself.
    _, ref = m.automatic()
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        g, g_ref = np.asarray(g), np.asarray(g_ref)
        assert np.abs(g - g_ref).max() <= 0.05 * np.abs(g_ref).max()


# ---- codecs on known per-replica tensors -------------------------------------------------

R = 8
MESH = "data=4,fsdp=2"  # two replica axes: chunk order over a tuple of axes is exercised
SHAPES = {"big": (4096,), "odd": (37, 5)}  # 4096 = 2·R·256: whole int8 blocks; 185: padded


@pytest.fixture(scope="module")
def codec_runs():
    """Per codec: two calls of `reduced_grads` (error feedback on) on known tensors.

    The 'gradient' of replica r is its own row of the batch, so every replica's input is known.
    """
    mesh = mt.make_mesh(MESH)
    axes = ("data", "fsdp")
    rng = np.random.default_rng(1)
    xs = [{k: rng.normal(size=(R, *s)).astype(np.float32) for k, s in SHAPES.items()}]
    xs.append({k: rng.normal(size=(R, *s)).astype(np.float32) for k, s in SHAPES.items()})
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    cache = {}

    def compute(params, rest, batch):
        grads = {k: batch[k][0] for k in params}
        return (jnp.zeros((), jnp.float32), (rest, {})), grads

    def get(spec):
        if spec not in cache:
            codec = parse_compression(spec)
            fn = jax.jit(
                lambda res, batch: reduced_grads(
                    compute,
                    params,
                    {},
                    batch,
                    res,
                    sets=ReplicaSets(mesh_sizes(mesh), axes, mesh=mesh),
                    codec=codec,
                    error_feedback=True,
                )
            )
            res0 = residual_init(params, R)
            fn = fn.lower(res0, xs[0]).compile()
            _, mean1, res1 = fn(res0, xs[0])
            _, mean2, res2 = fn(res1, xs[1])
            host = lambda t: {k: np.asarray(v) for k, v in t.items()}  # noqa: E731
            means, res = [host(mean1), host(mean2)], [host(res1), host(res2)]
            cache[spec] = (codec, xs, means, res, fn.as_text())
        return cache[spec]

    return get


def _np_topk(x_RN, k):
    """Each row with all but its k largest-magnitude entries zeroed (numpy argsort)."""
    out = np.zeros_like(x_RN)
    for r, row in enumerate(x_RN):
        keep = np.argsort(-np.abs(row), kind="stable")[:k]
        out[r, keep] = row[keep]
    return out


def _np_sign(x_RN):
    """mean|x_r| · sign(x_r) per row (zero counted as positive)."""
    scale = np.abs(x_RN).mean(axis=1, keepdims=True)
    return scale * np.where(x_RN >= 0, 1.0, -1.0).astype(np.float32)


def _np_int8(x_RN, block):
    """Block-wise int8 round trip (scale max|x|/127, round to nearest) and the scales."""
    r, n = x_RN.shape
    pad = -n % block
    xb = np.pad(x_RN, ((0, 0), (0, pad))).reshape(r, -1, block)
    scale = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    q = np.clip(np.round(xb / np.where(scale > 0, scale, 1)), -127, 127)
    return (q * scale).reshape(r, -1)[:, :n].astype(np.float32), scale


def _inputs(xs, res, call):
    """What each replica encodes in `call` (0 or 1): its gradient plus the carried residual."""
    return {
        k: xs[call][k].reshape(R, -1) + (res[0][k].reshape(R, -1) if call else 0) for k in xs[0]
    }


@pytest.mark.parametrize("spec", ["topk:0.01", "sign"])
def test_topk_and_sign_mean_and_residual_equal_the_numpy_reference(codec_runs, spec):
    codec, xs, means, res, _ = codec_runs(spec)
    for call in (0, 1):
        for k, x_RN in _inputs(xs, res, call).items():
            if spec == "sign":
                sent = _np_sign(x_RN)
            else:
                sent = _np_topk(x_RN, codec.kept(x_RN.shape[1]))
                assert np.count_nonzero(sent, axis=1).tolist() == [codec.kept(x_RN.shape[1])] * R
            np.testing.assert_allclose(means[call][k].reshape(-1), sent.mean(0), atol=1e-6)
            # The residual is exactly what was not sent, and the next call encodes it.
            np.testing.assert_allclose(res[call][k].reshape(R, -1), x_RN - sent, atol=1e-6)


def test_topk_with_param_specs_keeps_the_top_entries_of_each_tensor_shard():
    # data=4 replicas, the tensor split in two halves over tensor=2: k = ceil(F·n/2) per half.
    mesh = mt.make_mesh("data=4,tensor=2")
    n, codec = 64, parse_compression("topk:0.05")
    x = np.random.default_rng(3).normal(size=(4, n)).astype(np.float32)
    params = {"w": jnp.zeros(n)}

    def compute(params, rest, batch):
        return (jnp.zeros(()), (rest, {})), {"w": batch["w"][0]}

    def f(residual, batch):
        return reduced_grads(
            compute,
            params,
            {},
            batch,
            residual,
            sets=ReplicaSets(mesh_sizes(mesh), ("data",), mesh=mesh),
            codec=codec,
            error_feedback=True,
            param_specs={"w": P("tensor")},
        )

    _, mean, res = jax.jit(f)(residual_init(params, 4), {"w": x})
    k = codec.kept(n // 2)
    sent = np.concatenate([_np_topk(half, k) for half in np.split(x, 2, axis=1)], axis=1)
    np.testing.assert_allclose(mean["w"], sent.mean(0), atol=1e-6)
    np.testing.assert_allclose(res["w"], x - sent, atol=1e-6)


def test_topk_keeps_ceil_of_the_fraction_and_at_least_one():
    c = parse_compression("topk:0.01")
    assert [c.kept(n) for n in (1, 99, 100, 101, 4096)] == [1, 1, 1, 2, 41]
    assert parse_compression("topk:0.07").kept(100) == 7
    assert parse_compression("topk:1").kept(37) == 37


def test_bf16_mean_is_within_two_roundings_and_the_residual_is_one(codec_runs):
    _, xs, means, res, _ = codec_runs("bf16")
    u = 2.0**-8  # bfloat16 (8 significant bits), round to nearest: |x − bf16(x)| ≤ 2⁻⁸|x|
    for call in (0, 1):
        for k, x_RN in _inputs(xs, res, call).items():
            true = x_RN.mean(0)
            first = u * np.abs(x_RN).mean(0)  # the replicas' own roundings, averaged
            bound = first + u * (np.abs(true) + first) + 1e-6
            err = np.abs(means[call][k].reshape(-1) - true)
            assert (err <= bound).all(), (k, call, (err - bound).max())
            assert (err > 0).any()  # it did round
            r = np.abs(res[call][k].reshape(R, -1))
            assert (r <= u * np.abs(x_RN) + 1e-12).all()
            assert r.max() > 0


def test_int8_mean_is_within_two_quantisations_and_the_residual_is_the_first(codec_runs):
    codec, xs, means, res, _ = codec_runs("int8")
    for call in (0, 1):
        for k, x_RN in _inputs(xs, res, call).items():
            n = x_RN.shape[1]
            true = x_RN.mean(0)
            err = np.abs(means[call][k].reshape(-1) - true)
            if k == "big":  # whole blocks of `codec.block`: the per-block bound
                assert n % (R * codec.block) == 0
                sent, s1 = _np_int8(x_RN, codec.block)
                first = np.repeat(s1.mean(0)[:, 0] / 2, codec.block)  # per element
                s2 = np.abs(true.reshape(-1, codec.block)).max(-1) / 127
                second = np.repeat(s2 / 2, codec.block) + first / 127
                np.testing.assert_allclose(res[call][k].reshape(R, -1), x_RN - sent, atol=1e-6)
            else:  # padded, smaller blocks: the per-tensor bound (max |x| over the tensor)
                first = np.abs(x_RN).max(1).mean() / 127 / 2
                second = (np.abs(true).max() + first) / 127 / 2
                s1 = np.abs(x_RN).max(1, keepdims=True) / 127
                assert (np.abs(res[call][k].reshape(R, -1)) <= s1 / 2 + 1e-6).all()
            bound = first + second + 1e-6
            assert (err <= bound).all(), (k, call, (err - bound).max())
            assert err.max() > 1e-4  # it did quantise


def test_without_error_feedback_nothing_is_carried():
    mesh = mt.make_mesh(MESH)
    x = np.random.default_rng(2).normal(size=(R, 64)).astype(np.float32)
    params = {"w": jnp.zeros(64)}

    def compute(params, rest, batch):
        return (jnp.zeros(()), (rest, {})), {"w": batch["w"][0]}

    def f(batch):
        return reduced_grads(
            compute,
            params,
            {},
            batch,
            None,
            sets=ReplicaSets(mesh_sizes(mesh), ("data", "fsdp"), mesh=mesh),
            codec=parse_compression("sign"),
            error_feedback=False,
        )

    _, mean, res = jax.jit(f)({"w": x})
    assert res is None
    np.testing.assert_allclose(mean["w"], _np_sign(x).mean(0), atol=1e-6)
    with pytest.raises(ValueError, match="residual_init"):
        reduced_grads(
            compute,
            params,
            {},
            {"w": x},
            None,
            sets=ReplicaSets(mesh_sizes(mesh), ("data", "fsdp"), mesh=mesh),
            codec=parse_compression("int8"),
            error_feedback=True,
        )


# ---- bytes ---------------------------------------------------------------------------------


def _rows(compiled):
    """The collectives of a compiled program (or its HLO text) on the dp mesh, and by kind."""
    mesh = mt.make_mesh(LAYOUTS["dp"][0])
    text = compiled if isinstance(compiled, str) else compiled[0].as_text()
    cs = collectives(text, mesh.devices.size)
    return cs, summarize(cs, mesh_sizes(mesh))


def _wire(compiled):
    """Ring-algorithm bytes each device sends per call, over data+fsdp (every collective here)."""
    cs, rows = _rows(compiled)
    assert {r.axes for r in rows} == {("data", "fsdp")}, rows
    return sum(r.wire_bytes for r in rows)


def _param_sizes(models):
    return [p.size for p in jax.tree.leaves(models("dp").params)]


def test_fp32_gradient_bytes_are_one_all_reduce_of_the_parameters(models, compiled):
    cs, rows = _rows(compiled("none"))
    n = sum(_param_sizes(models))
    reduced = sum(r.bytes for r in rows if r.kind == "all-reduce")
    assert {r.kind for r in rows} == {"all-reduce"}
    assert 4 * n <= reduced <= 4 * n + 64  # + the loss and metrics' scalars


def _fp32_ring(n):
    """Ring all-reduce bytes each device sends for `n` float32 values over the R replicas."""
    return 2 * (R - 1) / R * 4 * n


KNOWN = sum(math.prod(s) for s in SHAPES.values())  # entries of the known tensors


def test_int8_gradient_bytes_are_a_quarter_of_fp32(codec_runs):
    # On the known tensors (same mesh, R = 8): one whole-block tensor, one padded.
    hlo = codec_runs("int8")[-1]
    ratio = _wire(hlo) / _fp32_ring(KNOWN)
    assert abs(ratio - 0.25) <= 0.025, ratio
    cs, _ = _rows(hlo)
    assert {d for c in cs if c.kind in ("all-to-all", "all-gather") for d in c.dtypes} >= {"s8"}


def test_bf16_bytes_are_half_of_fp32_on_uint16_payloads(codec_runs):
    # On the known tensors: XLA's CPU backend widens a bfloat16 all-gather to float32 and
    # aborts on a bfloat16 all-reduce, so the payloads travel as uint16 bits.
    hlo = codec_runs("bf16")[-1]
    ratio = _wire(hlo) / _fp32_ring(KNOWN)
    assert abs(ratio - 0.5) <= 0.05, ratio
    cs, _ = _rows(hlo)
    moved = [c for c in cs if c.kind in ("all-to-all", "all-gather")]
    assert moved and all(set(c.dtypes) == {"u16"} for c in moved)
    assert not [c for c in cs if c.kind == "all-reduce" and c.result_bytes > 64]


def test_topk_gathers_exactly_R_k_values_and_indices_per_tensor(codec_runs):
    codec, *_, hlo = codec_runs("topk:0.01")
    cs, _ = _rows(hlo)
    gathered = sum(c.count * c.buffer_bytes for c in cs if c.kind == "all-gather")
    sizes = [math.prod(s) for s in SHAPES.values()]
    assert gathered == sum(R * codec.kept(n) * (4 + 4) for n in sizes)


def test_sign_gathers_one_bit_per_entry_and_a_scale_per_tensor(codec_runs):
    hlo = codec_runs("sign")[-1]
    cs, _ = _rows(hlo)
    gathered = sum(c.count * c.buffer_bytes for c in cs if c.kind == "all-gather")
    sizes = [math.prod(s) for s in SHAPES.values()]
    assert gathered == sum(R * (math.ceil(n / 8) + 4) for n in sizes)
    # Each replica sends 1/32 of its float32 gradient; an all-gather of R such payloads
    # moves R/64 of a float32 ring all-reduce's bytes.
    ratio = _wire(hlo) / _fp32_ring(KNOWN)
    assert abs(ratio - R / 64) <= 0.1 * R / 64, ratio


# ---- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, fix",
    [
        ("topk:0", "(0, 1]"),
        ("topk:1.5", "(0, 1]"),
        ("topk:abc", "must be a number"),
        ("topk", "e.g. --grad-compression topk:0.01"),
        ("int4", "choose from none, bf16, int8"),
    ],
)
def test_bad_compression_is_one_line_naming_the_field_value_and_fix(spec, fix):
    with pytest.raises(ValueError) as info:
        parse_compression(spec)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"grad_compression={spec!r}: ")
    assert fix in msg and "e.g." in msg


@pytest.mark.parametrize("spec", ["none", "bf16", "int8", "topk:0.25", "sign"])
def test_every_codec_parses_and_spells_itself_back(spec):
    codec = parse_compression(spec)
    assert codec.spec == spec
    assert codec.lossy == (spec != "none")
