"""Flash attention (Pallas, interpreted on CPU) against the jnp reference: values, logsumexp,
gradients, odd shapes, GQA, the causal mask, poisoned outputs and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_helpers import TOL, assert_all_written, assert_close, fresh_key

from meshtrain.kernels import _common, attention, flash_attention, reference
from meshtrain.kernels.attention import flash_attention_lse
from meshtrain.models import layers

BLOCK = 16  # small blocks so short test sequences still span several tiles

# (batch, T, heads, kv_heads, head_dim): T is never a multiple of the block (33: two blocks and
# one row; 24: one and a half); kv groups 2 and 8, head widths 64 and 128. MHA (kv groups 1)
# runs in the sliding-window cases, other shapes in the bf16, mask and poison tests.
CASES = [
    pytest.param(2, 33, 4, 2, 64, True, id="gqa2-T33-causal"),
    pytest.param(1, 24, 8, 1, 128, False, id="gqa8-K128-T24-full"),
]


@functools.partial(jax.jit, static_argnums=range(1, 7))
def _inputs(key, B, T, H, G, K, dtype):
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (B, T, H, K), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, T, G, K), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, T, G, K), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (B, T, H, K), jnp.float32).astype(dtype)
    return q, k, v, do


def _grads(fn, q, k, v, do):
    """Value and (dq, dk, dv) of ``sum(fn(q, k, v) · do)`` in float32."""

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    out = fn(q, k, v)
    return out, jax.grad(loss, (0, 1, 2))(q, k, v)


def _against(key, dims, dtype, pallas, ref, *extra):
    """One program: fresh inputs of `dims` (B, T, H, G, K), ``_grads`` of `pallas` and of
    `ref`, and each of `extra` called on the inputs."""

    def run(key):
        inputs = _inputs(key, *dims, dtype)
        more = [fn(*inputs) for fn in extra]
        return inputs, _grads(pallas, *inputs), _grads(ref, *inputs), *more

    return jax.jit(run)(key)


def _against_masked(key, dims, mask, *extra):
    """`_against` in float32 for the kernel and the reference under the same `mask` keywords
    (``causal`` or ``window``), with ``(kernel's, reference's)`` logsumexp after the gradients,
    then each of `extra`."""

    def pallas(q, k, v):
        return flash_attention(q, k, v, impl="pallas", block_q=BLOCK, block_k=BLOCK, **mask)

    def ref(q, k, v):
        return reference.attention(q, k, v, **mask)

    def lse(q, k, v, do):
        _, got = flash_attention_lse(q, k, v, block_q=BLOCK, block_k=BLOCK, **mask)
        return got, reference.attention_logsumexp(q, k, **mask)

    return _against(key, dims, jnp.float32, pallas, ref, lse, *extra)


@pytest.mark.parametrize("B,T,H,G,K,causal", CASES)
def test_matches_reference_fp32(B, T, H, G, K, causal):
    """Values, gradients and the logsumexp the forward saves."""
    key, seed = fresh_key()
    fwd_tol, grad_tol = TOL[jnp.float32]
    _, (out, grads), (ref, ref_grads), (got_lse, ref_lse) = _against_masked(
        key, (B, T, H, G, K), {"causal": causal}
    )
    assert_close(out, ref, fwd_tol, "output", seed)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert_close(g, r, grad_tol, f"d{name}", seed)
    assert got_lse.shape == (B, H, T) and got_lse.dtype == jnp.float32
    assert_close(got_lse, ref_lse, 1e-6, "lse", seed)


def test_matches_reference_bf16():
    """Causal, with query and key blocks of different heights."""
    key, seed = fresh_key()
    fwd_tol, grad_tol = TOL[jnp.bfloat16]

    def pallas(q, k, v):
        return flash_attention(q, k, v, impl="pallas", block_q=BLOCK, block_k=32)

    def ref32(q, k, v):  # the reference in float32 on the same bf16-rounded inputs
        return reference.attention(*[x.astype(jnp.float32) for x in (q, k, v)])

    _, (out, grads), (ref, ref_grads) = _against(
        key, (2, 37, 4, 2, 64), jnp.bfloat16, pallas, ref32
    )
    assert out.dtype == jnp.bfloat16 and grads[1].dtype == jnp.bfloat16
    assert_close(out, ref, fwd_tol, "output", seed)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert_close(g, r, grad_tol, f"d{name}", seed)


def test_causal_mask_first_and_last_rows():
    """Row 0 sees only key 0 (so it returns v[0] exactly); the last row sees every key; no row
    sees a later key (changing the last key moves only the last row)."""
    key, seed = fresh_key()
    B, T, H, G, K = 1, 35, 2, 1, 64
    q, k, v, _ = _inputs(key, B, T, H, G, K, jnp.float32)

    @jax.jit
    def run(k, v):
        return flash_attention(q, k, v, causal=True, impl="pallas", block_q=BLOCK, block_k=BLOCK)

    out = run(k, v)
    np.testing.assert_allclose(out[:, 0], jnp.broadcast_to(v[:, 0], (B, H, K)), rtol=1e-6)
    last = reference.attention(q[:, -1:], k, v, causal=False)  # one query over all keys
    assert_close(out[:, -1:], last, 2e-5, "last row", seed)
    k2 = k.at[:, -1].add(3.0)
    v2 = v.at[:, -1].add(3.0)
    out2 = run(k2, v2)
    np.testing.assert_array_equal(out2[:, :-1], out[:, :-1])
    assert float(jnp.max(jnp.abs(out2[:, -1] - out[:, -1]))) > 1e-3


@pytest.mark.parametrize(
    "H,G",
    [
        pytest.param(8, 2, id="8q-2kv-one-group-per-shard"),
        pytest.param(12, 3, id="12q-3kv-groups-straddle-shards"),
    ],
)
def test_kv_heads_replicated_over_tensor_match_reference(H, G):
    """On data=2 × tensor=4 with tp rules: query heads split 4 ways, key/value heads (fewer, or
    a count 4 does not divide) whole on every shard. Each shard's kernel must use the k/v head
    of each of its query heads (h // (H / G)), and dk/dv must sum every shard's part."""
    from meshtrain.layout import activation_rules, constrain, rules_for
    from meshtrain.mesh import make_mesh

    key, seed = fresh_key()
    mesh = make_mesh("data=2,tensor=4")
    rules = rules_for("tp", mesh)

    def pallas(q, k, v):
        with activation_rules(mesh, rules):
            q = constrain(q, ("batch", None, "heads", None))
            k, v = (constrain(x, ("batch", None, "kv_heads", None)) for x in (k, v))
            out = flash_attention(q, k, v, impl="pallas", block_q=BLOCK, block_k=BLOCK)
            return constrain(out, ("batch", None, "heads", None))

    _, (out, grads), (ref, ref_grads) = _against(
        key, (2, 33, H, G, 64), jnp.float32, pallas, reference.attention
    )
    split = jax.sharding.NamedSharding(mesh, jax.P("data", None, "tensor", None))
    assert out.sharding.is_equivalent_to(split, 4)
    fwd_tol, grad_tol = TOL[jnp.float32]
    assert_close(out, ref, fwd_tol, "output", seed)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert_close(g, r, grad_tol, f"d{name}", seed)


def test_xla_impl_is_the_model_attention():
    key, _ = fresh_key()
    q, k, v, _ = _inputs(key, 2, 20, 4, 2, 32, jnp.float32)
    np.testing.assert_array_equal(
        flash_attention(q, k, v, impl="xla"), layers.causal_attention(q, k, v)
    )


def test_every_output_element_is_written():
    """With NaN-filled output buffers, the forward and all three gradients come out finite."""
    key, seed = fresh_key()

    def pallas(q, k, v):
        return flash_attention(q, k, v, causal=True, impl="pallas", block_q=BLOCK, block_k=BLOCK)

    def lse(q, k, v, do):
        return flash_attention_lse(q, k, v, block_q=BLOCK, block_k=BLOCK)[1]

    with _common.poison_outputs():  # traced (and so built) inside: the kernels poisoned
        _, (out, grads), (ref, ref_grads), lse = _against(
            key, (1, 29, 4, 2, 64), jnp.float32, pallas, reference.attention, lse
        )
    assert_all_written(out, lse, *grads)
    assert_close(out, ref, 2e-5, "output", seed)
    assert_close(grads[0], ref_grads[0], 1e-4, "dq", seed)


def test_poisoning_catches_an_unwritten_block():
    """The poison check can fail: a kernel that skips its last grid cell leaves NaNs."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(0) < pl.num_programs(0) - 1)
        def _():
            o_ref[...] = x_ref[...]

    x = jnp.ones((64,), jnp.float32)
    spec = pl.BlockSpec((16,), lambda i: (i,))
    with _common.poison_outputs():
        call = _common.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[spec],
            out_specs=spec,
            grid=(4,),
            interpret=True,
        )
        out = call(x)
    assert bool(jnp.all(out[:48] == 1.0)) and bool(jnp.all(jnp.isnan(out[48:])))


def test_bad_input_errors():
    q = jnp.zeros((1, 16, 2, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"head_dim=32 is not supported.*64, 128"):
        flash_attention(q, q, q, impl="pallas")
    q64 = jnp.zeros((1, 16, 2, 64), jnp.float16)
    with pytest.raises(ValueError, match=r"dtype float16 .*float32, bfloat16"):
        flash_attention(q64, q64, q64, impl="pallas")
    q = jnp.zeros((1, 16, 3, 64), jnp.float32)
    kv = jnp.zeros((1, 16, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="2 key/value heads do not divide 3"):
        flash_attention(q, kv, kv, impl="pallas")
    with pytest.raises(ValueError, match=r"impl='fast' is not one of pallas, xla, cudnn, auto"):
        flash_attention(q, q, q, impl="fast")
    with pytest.raises(ValueError, match="rank"):
        flash_attention(q[0], q[0], q[0], impl="pallas")
    with pytest.raises(ValueError, match="block_q=24 must be a power of two"):
        flash_attention(q, q, q, impl="pallas", block_q=24)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU error")
def test_cudnn_on_cpu_is_a_clear_error():
    q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="impl='cudnn' needs a CUDA GPU"):
        flash_attention(q, q, q, impl="cudnn")


def test_auto_is_the_reference_on_cpu():
    key, _ = fresh_key()
    q, k, v, _ = _inputs(key, 2, 20, 4, 2, 32, jnp.float32)  # as the test above: its programs
    if jax.default_backend() != "gpu":
        np.testing.assert_array_equal(
            flash_attention(q, k, v, impl="auto"), reference.attention(q, k, v)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("K", [64, 128])
def test_compiled_on_gpu_matches_cudnn_and_reference(K):
    """Compiled (not interpreted) kernels on a GPU, bf16, against the reference and cuDNN."""
    key, seed = fresh_key()
    q, k, v, do = _inputs(key, 2, 1000, 8, 2, K, jnp.bfloat16)
    fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, impl="pallas"))
    out, grads = _grads(fn, q, k, v, do)
    ref, ref_grads = _grads(
        lambda q, k, v: reference.attention(*(x.astype(jnp.float32) for x in (q, k, v))),
        q,
        k,
        v,
        do,
    )
    assert_close(out, ref, 2e-2, "output", seed)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert_close(g, r, 3e-2, f"d{name}", seed)
    cudnn = flash_attention(q, k, v, impl="cudnn")
    assert_close(cudnn, ref, 2e-2, "cudnn output", seed)


def test_memory_is_linear_in_sequence():
    """No array in the forward+backward program has T × S elements (the reference has)."""
    B, T, H, K = 1, 512, 1, 64
    q = jnp.zeros((B, T, H, K), jnp.float32)

    def biggest(fn):
        jaxpr = jax.make_jaxpr(jax.grad(lambda q: jnp.sum(fn(q, q, q))))(q)
        return max(
            v.aval.size for eqn in jaxpr.eqns for v in eqn.outvars if hasattr(v.aval, "size")
        )

    assert biggest(lambda q, k, v: flash_attention(q, k, v, impl="pallas")) < T * T // 4
    assert biggest(reference.attention) >= T * T  # the check can fail


# --- sliding window -------------------------------------------------------------------------

# (batch, T, heads, kv_heads, window): a window of one key (MHA), one that spans blocks
# unevenly with GQA. Which blocks a window visits (windows of one key to several blocks, a
# window of exactly a block) is checked without running the kernels below.
WINDOWS = [
    pytest.param(1, 40, 2, 2, 1, id="w1-mha"),
    pytest.param(2, 45, 4, 2, 21, id="w21-gqa2"),
]


@pytest.mark.parametrize("B,T,H,G,window", WINDOWS)
def test_sliding_window_matches_reference(B, T, H, G, window):
    """Query t sees keys (t − window, t]: values, logsumexp and gradients as the reference."""
    key, seed = fresh_key()
    fwd_tol, grad_tol = TOL[jnp.float32]

    def causal(q, k, v, do):  # without the window
        return reference.attention(q, k, v)

    _, (out, grads), (ref, ref_grads), (got_lse, ref_lse), unwindowed = _against_masked(
        key, (B, T, H, G, 64), {"window": window}, causal
    )
    assert_close(out, ref, fwd_tol, "output", seed)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        if window == 1 and name in "qk":  # each query sees only itself: no gradient to q, k
            assert float(jnp.max(jnp.abs(r))) == 0 and float(jnp.max(jnp.abs(g))) < 1e-5, name
            continue
        assert_close(g, r, grad_tol, f"d{name}", seed)
    assert_close(got_lse, ref_lse, 1e-6, "lse", seed)
    # the window bites: the output differs from plain causal attention
    assert float(jnp.max(jnp.abs(ref - unwindowed))) > 1e-2


def test_reference_window_is_the_keys_t_minus_window_exclusive_to_t():
    ok = np.asarray(reference.visible(6, 6, causal=True, window=3))
    want = [[int(t - 3 < s <= t) for s in range(6)] for t in range(6)]
    np.testing.assert_array_equal(ok.astype(int), want)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("bq,bk", [(16, 16), (16, 32), (32, 16)])
def test_window_visits_exactly_the_blocks_it_sees(window, bq, bk):
    """The forward's key-block range and the dk/dv kernel's query-block range are the blocks
    holding at least one visible (query, key) pair: none skipped, none wasted."""
    n_q, n_kv = 96 // bq, 96 // bk
    ok = np.asarray(reference.visible(96, 96, causal=True, window=window))
    sees = ok.reshape(n_q, bq, n_kv, bk).any(axis=(1, 3))  # [query block, key block]
    for i in range(n_q):
        lo, hi = (int(x) for x in attention._kv_range(i, bq, bk, n_kv, True, window))
        assert list(range(lo, hi)) == list(np.flatnonzero(sees[i])), (i, lo, hi)
    for j in range(n_kv):
        lo, hi = (int(x) for x in attention._q_range(j, bq, bk, n_q, True, window))
        assert list(range(lo, hi)) == list(np.flatnonzero(sees[:, j])), (j, lo, hi)


def test_cudnn_window_argument_means_the_reference_window():
    """The cuDNN path passes ``local_window_size=(window − 1, 0)``; through jax's own XLA
    implementation of that argument (runs on CPU) it is the reference's window."""
    key, _ = fresh_key()
    q, k, v, _ = _inputs(key, 1, 30, 4, 2, 64, jnp.float32)

    @jax.jit
    def both(q, k, v):
        return [
            (
                jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, local_window_size=(w - 1, 0), implementation="xla"
                ),
                reference.attention(q, k, v, window=w),
            )
            for w in (1, 7)
        ]

    for got, want in both(q, k, v):
        # Two float32 summation orders: 1.3e-6 apart has been seen on values near 1.
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bad_window_errors():
    q = jnp.zeros((1, 16, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"window=8 \(causal=False\) is not supported"):
        flash_attention(q, q, q, window=8, causal=False, impl="pallas")
    with pytest.raises(ValueError, match=r"window=0 \(causal=True\) is not supported"):
        flash_attention(q, q, q, window=0, impl="xla")
    with pytest.raises(ValueError, match="a sliding window needs causal=True"):
        reference.attention(q, q, q, causal=False, window=8)


@pytest.mark.gpu
def test_compiled_window_on_gpu_matches_cudnn_and_reference():
    """Compiled kernels with a sliding window on a GPU, bf16, against the reference and cuDNN."""
    key, seed = fresh_key()
    q, k, v, do = _inputs(key, 2, 1000, 8, 2, 64, jnp.bfloat16)
    window = 200
    fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, window=window, impl="pallas"))
    out, grads = _grads(fn, q, k, v, do)
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]  # noqa: E731
    ref, ref_grads = _grads(
        lambda q, k, v: reference.attention(*f32(q, k, v), window=window), q, k, v, do
    )
    assert_close(out, ref, 2e-2, "output", seed)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert_close(g, r, 3e-2, f"d{name}", seed)
    cudnn = flash_attention(q, k, v, window=window, impl="cudnn")
    assert_close(cudnn, ref, 2e-2, "cudnn output", seed)
