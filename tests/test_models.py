"""Tests for meshtrain.models: shapes, causality, GQA, RoPE, remat, scan, FLOPs, no-mesh rule,
the padded vocabulary (masked logits, loss, gradients, sampling)."""

import dataclasses
import functools
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshtrain.models
from meshtrain.layout import activation_rules, constrain, rules_for
from meshtrain.mesh import make_mesh
from meshtrain.models import REMAT_POLICIES, GPTConfig, MLPConfig, build_model, layers
from meshtrain.models.sampling import sample
from meshtrain.train import OptimConfig, cross_entropy

V, T, B = 256, 16, 2


def gpt_config(style="llama", kv=0, **kw) -> GPTConfig:
    base = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=kv, max_seq_len=T)
    return GPTConfig(style=style, **{**base, **kw})


def tokens(seed=0, rows=B, length=T) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (rows, length), np.int32)


def params_of(model) -> dict[str, jax.Array]:
    """{'a/b/c': array} for every nnx.Param of `model`."""
    return {
        "/".join(str(k) for k in path): var.get_value()
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@functools.cache
def forward(config: GPTConfig):
    """(model, jitted apply(state, tokens)) for `config`, seed 0; cached per config."""
    model = build_model(config, seed=0)
    graphdef, _ = nnx.split(model)
    return model, jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))


def logits(config: GPTConfig, x, state=None) -> np.ndarray:
    model, apply = forward(config)
    return np.asarray(apply(nnx.state(model) if state is None else state, x))


def abstract(config) -> nnx.Module:
    """The model with shape structs for values: no initialiser runs."""
    return nnx.eval_shape(lambda: build_model(config))


def output_shape(config, x, method=None) -> jax.ShapeDtypeStruct:
    """Shape and dtype of the forward (or of `method`) on `x`, without running it."""
    graphdef, state = nnx.split(abstract(config))

    def apply(state, x):
        model = nnx.merge(graphdef, state)
        return (method(model) if method else model)(x)

    return jax.eval_shape(apply, state, x)


# --- shapes and causality -----------------------------------------------------------------


@pytest.mark.parametrize("style, kv", [("gpt2", 0), ("llama", 4)])
def test_forward_shape_and_dtype(style, kv):
    out = logits(gpt_config(style, kv), tokens())
    assert out.shape == (B, T, V) and out.dtype == np.float32
    assert np.all(np.isfinite(out))
    # shorter sequences work; longer than max_seq_len is a clear error
    assert output_shape(gpt_config(style, kv), tokens(length=5)).shape == (B, 5, V)
    with pytest.raises(ValueError, match=r"sequence length 17 exceeds max_seq_len=16"):
        output_shape(gpt_config(style, kv), tokens(length=T + 1))


@pytest.mark.parametrize("style, kv", [("gpt2", 0), ("llama", 1), ("llama", 2)])
def test_changing_a_token_changes_no_earlier_logit(style, kv):
    config = gpt_config(style, kv)
    x = tokens(seed=1)
    t = 7
    y = x.copy()
    y[:, t] = (x[:, t] + 1 + np.arange(B)) % V
    before, after = logits(config, x), logits(config, y)
    # fp32: earlier positions see exactly the same inputs; masked keys get weight exactly 0
    np.testing.assert_allclose(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    assert np.abs(after[:, t:] - before[:, t:]).max(axis=-1).min() > 1e-4  # t and later do change


# --- grouped-query attention --------------------------------------------------------------


def naive_attention(q, k, v):
    """Direct causal attention in float64; query head h reads key/value head h // (H // G)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, t_, h_, k_ = q.shape
    group = h_ // k.shape[2]
    out = np.zeros_like(q)
    for b in range(b_):
        for h in range(h_):
            s = q[b, :, h] @ k[b, :, h // group].T / math.sqrt(k_)
            s = np.where(np.tril(np.ones((t_, t_), bool)), s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v[b, :, h // group]
    return out


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_grouped_query_attention_matches_direct_computation(kv):
    rng = np.random.default_rng(kv)
    q = rng.normal(size=(2, 8, 4, 16)).astype(np.float32)
    k = rng.normal(size=(2, 8, kv, 16)).astype(np.float32)
    v = rng.normal(size=(2, 8, kv, 16)).astype(np.float32)
    out = layers.causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    assert out.shape == q.shape
    # fp32 softmax over 8 keys against a float64 reference
    np.testing.assert_allclose(np.asarray(out), naive_attention(q, k, v), atol=2e-5)


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_gqa_parameter_shapes(kv):
    config = gpt_config("llama", kv)
    model = nnx.eval_shape(lambda: build_model(config))
    shapes = {p: a.shape for p, a in params_of(model).items()}
    assert shapes["blocks/attn/q/kernel"] == (2, 64, 4, 16)
    assert shapes["blocks/attn/k/kernel"] == (2, 64, kv, 16)
    assert shapes["blocks/attn/v/kernel"] == (2, 64, kv, 16)
    assert config.kv_heads == kv


@pytest.mark.parametrize("kv", [1, 2])
def test_gqa_equals_mha_with_shared_key_value_heads(kv):
    """A GQA model is the MHA model whose key/value heads are copied across each group."""
    gqa_model, _ = forward(gpt_config("llama", kv))
    mha_model, _ = forward(gpt_config("llama", 4))
    pure = nnx.to_pure_dict(nnx.state(gqa_model))
    for name in ("k", "v"):
        kernel = pure["blocks"]["attn"][name]["kernel"]  # [layers, D, G, K]
        pure["blocks"]["attn"][name]["kernel"] = jnp.repeat(kernel, 4 // kv, axis=2)
    mha_state = nnx.state(mha_model)
    nnx.replace_by_pure_dict(mha_state, pure)
    x = tokens(seed=2)
    # fp32, same math in a different grouping of the einsums
    np.testing.assert_allclose(
        logits(gpt_config("llama", 4), x, mha_state),
        logits(gpt_config("llama", kv), x),
        atol=1e-5,
    )


def test_bad_head_counts_are_rejected():
    with pytest.raises(ValueError, match=r"n_kv_heads=3: does not divide n_heads=4"):
        gpt_config("llama", 3)
    with pytest.raises(ValueError, match=r"d_model=60: not divisible by n_heads = 8"):
        gpt_config("gpt2", d_model=60, n_heads=8)


# --- rotary positions ---------------------------------------------------------------------


def rope_direct(x, theta=10_000.0):
    """Complex rotation of pairs (i, i + K/2) by position · theta^(-2i/K), in float64."""
    x = np.asarray(x, np.float64)  # [B, T, H, K]
    half = x.shape[-1] // 2
    freq = theta ** (-2.0 * np.arange(half) / x.shape[-1])
    angle = np.arange(x.shape[1])[:, None] * freq[None, :]  # [T, K/2]
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * angle)[None, :, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def rope(x, theta=10_000.0):
    cos, sin = layers.rope_tables(x.shape[1], x.shape[-1], theta)
    return np.asarray(layers.apply_rope(jnp.asarray(x), cos, sin))


def test_rope_matches_direct_rotation():
    x = np.random.default_rng(0).normal(size=(2, 24, 3, 16)).astype(np.float32)
    # fp32 sin/cos of angles up to 23 rad
    np.testing.assert_allclose(rope(x), rope_direct(x), atol=1e-5)
    np.testing.assert_allclose(rope(x)[:, 0], x[:, 0], atol=0)  # position 0 is the identity
    np.testing.assert_allclose(
        np.linalg.norm(rope(x), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5
    )


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(1)
    n = 32
    q = np.broadcast_to(rng.normal(size=16).astype(np.float32), (1, n, 1, 16))
    k = np.broadcast_to(rng.normal(size=16).astype(np.float32), (1, n, 1, 16))
    scores = rope(q)[0, :, 0] @ rope(k)[0, :, 0].T  # [query pos m, key pos n]
    # shifting both positions by one keeps every score (fp32 rotations, |score| ≲ 20)
    np.testing.assert_allclose(scores[1:, 1:], scores[:-1, :-1], atol=1e-4)
    assert np.ptp(np.diag(scores, -5)) < 1e-4 < abs(scores[5, 0] - scores[0, 0])


# --- remat --------------------------------------------------------------------------------


def _checkpoint_policies(jaxpr) -> list:
    """The `policy` of every remat (checkpoint) equation, searching nested jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("checkpoint", "remat2"):
            found.append(eqn.params["policy"])
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += _checkpoint_policies(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += _checkpoint_policies(sub)
    return found


@functools.cache
def loss_and_grads(remat: str):
    # the parameters of the plain model under the graph of the `remat` one
    graphdef, _, rest = nnx.split(abstract(gpt_config("llama", 2, remat=remat)), nnx.Param, ...)
    params = nnx.state(forward(gpt_config("llama", 2))[0], nnx.Param)
    x = tokens(seed=3, length=T + 1)

    def loss(p):
        return cross_entropy(nnx.merge(graphdef, p, rest)(x[:, :-1]), x[:, 1:])

    policies = _checkpoint_policies(jax.make_jaxpr(loss)(params).jaxpr)
    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    flat_grads = {
        jax.tree_util.keystr(p): np.asarray(g) for p, g in jax.tree.leaves_with_path(grads)
    }
    return float(value), flat_grads, policies


@pytest.mark.parametrize("remat", ["full", "save-dots", "save-attention-out"])
def test_remat_policy_gives_the_same_loss_and_grads(remat):
    loss, grads, policies = loss_and_grads(remat)
    ref_loss, ref_grads, ref_policies = loss_and_grads("none")
    assert ref_policies == []
    assert policies == [REMAT_POLICIES[remat]]  # one remat around the scanned block
    # fp32: the backward recomputes the same forward ops; measured ≤ 1e-8 on grads ≈ 1e-2
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for path, g in ref_grads.items():
        np.testing.assert_allclose(grads[path], g, rtol=0, atol=1e-6, err_msg=path)


def test_unknown_remat_policy_is_rejected():
    with pytest.raises(
        ValueError,
        match=r"remat='everything': choose from none, full, save-dots, save-attention-out, "
        r"offload-dots \(or save:NAME,\.\.\. / offload:NAME,\.\.\. joined by \+\)",
    ):
        gpt_config(remat="everything")


# --- scanned layers -----------------------------------------------------------------------


def compiled_forward_hlo(n_layers: int) -> str:
    model = abstract(gpt_config("llama", 4, n_layers=n_layers))
    graphdef, state = nnx.split(model)
    apply = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    return apply.lower(state, tokens()).compile().as_text()


def test_layers_are_scanned_into_one_block():
    small, big = compiled_forward_hlo(2), compiled_forward_hlo(8)
    for hlo in (small, big):
        assert re.search(r"\bwhile\b", hlo)
    # eight layers compile to (nearly) the same program as two
    assert len(big) < 1.2 * len(small)
    model = abstract(gpt_config("llama", 4, n_layers=8))
    assert params_of(model)["blocks/attn/q/kernel"].shape[0] == 8


# --- FLOPs --------------------------------------------------------------------------------


def counted_flops_per_token(model, seq_len: int) -> int:
    """6 FLOPs per matmul weight per token (2 forward + 4 backward), plus attention: per layer
    and token, q·k over seq_len keys and p·v, 2·seq_len·H·K each forward, ×3 with backward."""
    params = params_of(model)
    matmul = sum(math.prod(a.shape) for p, a in params.items() if p.endswith("kernel"))
    if getattr(model, "head", "") is None:  # tied: the embedding is also the output matmul
        matmul += math.prod(params["embed/embedding"].shape)
    flops = 6 * matmul
    if "blocks/attn/q/kernel" in params:
        n_layers, _, heads, head_dim = params["blocks/attn/q/kernel"].shape
        window = model.cfg.sliding_window  # each query is counted against `window` keys
        keys = min(seq_len, window) if window else seq_len
        flops += 3 * n_layers * 2 * (2 * keys * heads * head_dim)
    return flops


@pytest.mark.parametrize(
    "config",
    [
        gpt_config("gpt2"),
        gpt_config("llama", 2),
        gpt_config("llama", 1, d_ff=96, n_layers=3),
        gpt_config("gpt2", tie_embeddings=True, d_model=32, n_heads=2),
        gpt_config("llama", 2, vocab_size=300),  # the padded vocabulary (384) counts
        MLPConfig(num_features=16, num_classes=10, d_model=32, d_hidden=48, n_layers=3),
        gpt_config("llama", 2, sliding_window=24, qkv_bias=True),
    ],
    ids=[
        "gpt2",
        "llama-gqa",
        "llama-mqa-dff",
        "gpt2-tied",
        "llama-padded-vocab",
        "mlp",
        "llama-window-bias",
    ],
)
@pytest.mark.parametrize("seq_len", [16, 128])
def test_flops_per_token_matches_a_count_from_param_shapes(config, seq_len):
    model = nnx.eval_shape(lambda: build_model(config))
    assert config.flops_per_token(seq_len) == counted_flops_per_token(model, seq_len)


# --- the padded vocabulary ----------------------------------------------------------------

PV = 300  # a vocabulary that 128 does not divide: 384 rows


def _sliced_to_vocab(padded: GPTConfig, state) -> tuple[GPTConfig, nnx.State]:
    """The unpadded config (vocab_multiple=1) and `state` with its padded rows cut off."""
    plain = dataclasses.replace(padded, vocab_multiple=1)
    pure = nnx.to_pure_dict(state)
    pure["embed"]["embedding"] = pure["embed"]["embedding"][:PV]
    if "head" in pure:
        pure["head"]["kernel"] = pure["head"]["kernel"][:, :PV]
    plain_state = nnx.state(abstract(plain))
    nnx.replace_by_pure_dict(plain_state, pure)
    return plain, plain_state


def test_byte_level_default_is_not_padded():
    """vocab 256 keeps its shapes and its exact numbers (parameters and logits)."""
    default, plain = GPTConfig(), GPTConfig(vocab_multiple=1)
    assert default.vocab_multiple == 128 and default.padded_vocab == 256
    x = np.random.default_rng(0).integers(0, 256, (2, 16), np.int32)

    @jax.jit
    def built(x):  # both models' parameters and logits, in one program
        models = [build_model(default), build_model(plain)]
        return [params_of(m) for m in models], [m(x) for m in models]

    (a, b), (logits_a, logits_b) = built(x)
    for path in b:
        np.testing.assert_array_equal(a[path], b[path], err_msg=path)
    np.testing.assert_array_equal(logits_a, logits_b)


@pytest.mark.parametrize("style, tied", [("gpt2", True), ("llama", False)])
def test_padded_vocabulary_is_masked_and_changes_nothing_else(style, tied):
    """Padded rows start at zero, their logits are PADDED_LOGIT, they get exactly zero
    gradient, and the loss and real gradients equal those of the unpadded model."""
    config = gpt_config(style, vocab_size=PV, tie_embeddings=tied)
    assert config.padded_vocab == 384
    model = nnx.eval_shape(lambda: build_model(config, seed=1))
    nnx.update(model, jax.jit(lambda: nnx.state(build_model(config, seed=1)))())  # one program
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    p = params_of(model)
    assert p["embed/embedding"].shape == (384, 64)
    assert not np.any(np.asarray(p["embed/embedding"][PV:]))
    assert tied or not np.any(np.asarray(p["head/kernel"][:, PV:]))
    x = np.random.default_rng(2).integers(0, PV, (B, T + 1), np.int32)

    def loss(params, graphdef=graphdef, rest=rest):
        out = nnx.merge(graphdef, params, rest)(x[:, :-1])
        return cross_entropy(out, x[:, 1:]), out

    # the logits come out of the loss's own program
    (value, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert np.all(np.asarray(out)[..., PV:] == layers.PADDED_LOGIT)
    g = {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}
    assert np.all(g["embed/embedding"][PV:] == 0) and np.any(g["embed/embedding"][:PV])
    assert tied or (np.all(g["head/kernel"][:, PV:] == 0) and np.any(g["head/kernel"][:, :PV]))

    plain, plain_params = _sliced_to_vocab(config, params)
    plain_graphdef, _, plain_rest = nnx.split(abstract(plain), nnx.Param, ...)
    plain_loss = functools.partial(loss, graphdef=plain_graphdef, rest=rest)
    (want, _), want_grads = jax.jit(jax.value_and_grad(plain_loss, has_aux=True))(plain_params)
    np.testing.assert_allclose(float(value), float(want), rtol=1e-6)  # fp32, one more sum
    _, sliced = _sliced_to_vocab(config, grads)
    for (path, got), (_, ref) in zip(
        nnx.to_flat_state(sliced), nnx.to_flat_state(want_grads), strict=True
    ):
        np.testing.assert_allclose(
            got.get_value(), ref.get_value(), rtol=0, atol=1e-6, err_msg=str(path)
        )


@pytest.mark.parametrize(
    "impl, mesh_str", [("xla", None), ("pallas", None), ("pallas", "data=2,tensor=4")]
)
def test_loss_of_masked_padded_logits_equals_the_unpadded_loss(impl, mesh_str):
    """Whatever the padded columns held, once masked they change neither the loss nor the
    real logits' gradient, and get none themselves (the Pallas loss also split over vocab)."""
    rng = np.random.default_rng()
    N, Vp = 24, 1024
    real = jnp.asarray(rng.normal(0, 3, (N, 1000)), jnp.float32)
    junk = jnp.asarray(rng.normal(20, 3, (N, Vp - 1000)), jnp.float32)  # would dominate
    targets = jnp.asarray(rng.integers(0, 1000, N), jnp.int32)

    def padded_loss(junk, real):
        x = layers.mask_padded_vocab(jnp.concatenate([real, junk], axis=-1), 1000)
        if mesh_str is None:
            return cross_entropy(x, targets, impl=impl)
        mesh = make_mesh(mesh_str)
        with activation_rules(mesh, rules_for("tp", mesh)):
            return cross_entropy(constrain(x, ("batch", "vocab")), targets, impl=impl)

    value, (d_junk, d_real) = jax.jit(jax.value_and_grad(padded_loss, (0, 1)))(junk, real)
    want, want_grad = jax.value_and_grad(lambda r: cross_entropy(r, targets, impl="xla"))(real)
    np.testing.assert_allclose(float(value), float(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(d_real), np.asarray(want_grad), rtol=0, atol=1e-7)
    assert np.all(np.asarray(d_junk) == 0)


def test_sampling_never_draws_a_padded_id():
    """Padded head columns set far above the real ones would win every draw unmasked."""
    config = gpt_config("llama", vocab_size=PV, n_layers=1)
    model = build_model(config, seed=0)
    model.head.kernel[...] = model.head.kernel[...].at[:, PV:].set(5.0)
    out = sample(model, jnp.arange(4), 12, key=jax.random.key(0), temperature=1.0)
    assert out.shape == (16,) and int(out.max()) < PV


# --- construction -------------------------------------------------------------------------


def test_build_model_is_deterministic_in_its_seed():
    config = MLPConfig(num_features=8, num_classes=4, d_model=16, d_hidden=16, n_layers=1)
    a, b, c = (params_of(build_model(config, seed=s)) for s in (0, 0, 1))
    for path in a:
        np.testing.assert_array_equal(a[path], b[path])
    assert any(not np.array_equal(a[p], c[p]) for p in a if p.endswith("kernel"))


def test_build_model_rejects_an_unknown_config():
    with pytest.raises(ValueError, match=r"model config OptimConfig: unknown model; known:"):
        build_model(OptimConfig())


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(style="bert"), r"gpt.style='bert': choose from gpt2, llama"),
        (dict(dtype="float64"), r"gpt.dtype='float64': choose from float32, bfloat16, float16"),
        (dict(n_layers=0), r"gpt.n_layers=0: must be a positive integer"),
        (dict(d_ff=-1), r"gpt.d_ff=-1: must be an integer ≥ 0"),
    ],
)
def test_bad_gpt_config_is_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        gpt_config(**kw)


def test_bf16_config_keeps_fp32_params():
    config = dataclasses.replace(gpt_config("llama", 2), dtype="bfloat16")
    assert {a.dtype for a in params_of(abstract(config)).values()} == {jnp.dtype("float32")}
    assert output_shape(config, tokens()).dtype == jnp.float32  # logits come back as float32
    # ... while the activations are bfloat16
    assert output_shape(config, tokens(), lambda m: m.embed).dtype == jnp.bfloat16


def test_embed_computes_what_nnx_embed_does_and_names_its_table():
    import meshtrain as mt

    assert mt.Embed is layers.Embed
    tokens = jnp.array([[0, 3, 9], [9, 1, 2]], jnp.int32)
    ours = layers.Embed(10, 4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    plain = nnx.Embed(10, 4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert ours(tokens).dtype == jnp.bfloat16 and ours(tokens).shape == (2, 3, 4)
    np.testing.assert_array_equal(ours(tokens), plain(tokens))
    np.testing.assert_array_equal(ours.attend(jnp.ones((2, 4))), plain.attend(jnp.ones((2, 4))))
    assert ours.embedding.get_metadata()["out_sharding"] == ("vocab", "embed")
    # An initialiser that carries its own names keeps them.
    init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", None))
    assert layers.Embed(10, 4, embedding_init=init, rngs=nnx.Rngs(0)).embedding.get_metadata()[
        "out_sharding"
    ] == ("vocab", None)
    with pytest.raises(ValueError, match="token ids must be integers"):
        ours(jnp.zeros(3))


# --- models never mention devices ---------------------------------------------------------


def test_model_code_mentions_no_mesh():
    pattern = re.compile(
        r"mesh(?!train)|NamedSharding|PartitionSpec|jax\.sharding|\bdevices?\b", re.IGNORECASE
    )
    sources = sorted(pathlib.Path(meshtrain.models.__file__).parent.glob("*.py"))
    assert len(sources) >= 4
    for path in sources:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{path.name}:{n}: {line.strip()}"


# --- Llama 3.1 RoPE scaling, q/k/v biases, sliding window -----------------------------------


def llama3_direct(freq, factor, low, high, original):
    """Llama 3.1's rule per frequency, in float64: a wavelength shorter than original / high
    is kept, one longer than original / low is slowed down `factor` times, and in between the
    two are mixed by how far original / wavelength lies from low towards high."""
    out = []
    for f in freq:
        wavelength = 2 * math.pi / f
        if wavelength < original / high:
            out.append(f)
        elif wavelength > original / low:
            out.append(f / factor)
        else:
            mix = (original / wavelength - low) / (high - low)
            out.append((1 - mix) * f / factor + mix * f)
    return np.array(out)


def test_llama3_rope_frequencies_follow_the_rule():
    theta, K = 5e5, 128  # Llama 3.1 8B
    freq = theta ** (-np.arange(0, K, 2) / K)
    wavelength = 2 * math.pi / freq
    assert (wavelength < 2048).sum() and (wavelength > 8192).sum()  # every band is present
    assert ((wavelength > 2048) & (wavelength < 8192)).sum() >= 3
    got = layers.llama3_frequencies(jnp.asarray(freq, jnp.float32), 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, llama3_direct(freq, 8.0, 1.0, 4.0, 8192), rtol=2e-6)
    cos, _ = layers.rope_tables(4, K, theta, llama3=(8.0, 1.0, 4.0, 8192))
    np.testing.assert_allclose(cos[3], np.cos(3 * llama3_direct(freq, 8.0, 1.0, 4.0, 8192)),
                               atol=1e-6)  # fmt: skip


def test_llama3_defaults_are_the_config_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    assert {k: defaults[k] for k in layers.LLAMA3_DEFAULTS} == layers.LLAMA3_DEFAULTS


def test_qkv_bias_biases_query_key_value_only():
    params = params_of(abstract(gpt_config("llama", 2, qkv_bias=True)))
    biases = {p: a.shape for p, a in params.items() if p.endswith("bias")}
    assert biases == {
        "blocks/attn/q/bias": (2, 4, 16),
        "blocks/attn/k/bias": (2, 2, 16),
        "blocks/attn/v/bias": (2, 2, 16),
    }


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_sliding_window_limits_how_far_a_token_reaches(style):
    """Through 2 layers with window 4 a token reaches 2 · (4 − 1) = 6 positions ahead, and no
    further; without the window it reaches the end."""
    config = gpt_config(style, sliding_window=4)
    x = tokens(seed=2)
    y = x.copy()
    y[:, 0] = (x[:, 0] + 1) % V
    change = np.abs(logits(config, y) - logits(config, x)).max(axis=(0, 2))  # [T]
    assert change[6] > 1e-4 and change[7:].max() == 0, change
    full = gpt_config(style)
    assert np.abs(logits(full, y) - logits(full, x))[:, -1].max() > 1e-4


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(rope_factor=4.0), r"rope_factor=4.0: has no effect with rope_scaling='none'"),
        (dict(rope_scaling="yarn"), r"rope_scaling='yarn': choose from none, llama3"),
        (dict(style="gpt2", rope_scaling="llama3"), r"rope_scaling='llama3': needs style='llama'"),
        (
            dict(rope_scaling="llama3", rope_low_freq_factor=4.0),
            r"rope_low_freq_factor=4.0: and rope_high_freq_factor=4.0 must satisfy 0 < low",
        ),
        (dict(rope_scaling="llama3", rope_factor=0.5), r"rope_factor=0.5: must be a number ≥ 1"),
        (dict(style="gpt2", qkv_bias=True), r"qkv_bias=True: style 'gpt2' already biases"),
        (dict(sliding_window=-1), r"sliding_window=-1: must be an integer ≥ 0"),
    ],
)
def test_bad_rope_scaling_bias_and_window_fields_are_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        gpt_config(**kw)
