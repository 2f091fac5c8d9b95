"""Packed batches in the model: document masks in the reference attention and the Pallas flash
kernel, positions that restart per document, a loss over real tokens only, the sharded step,
and the clear errors for what does not take packed batches.

A packed row holds documents 1, 2, … back to back, then padding (segment 0); ``positions`` count
from 0 at each document's start. Inputs are fresh random arrays from seeded generators.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import packed_layout
from flax import nnx

from meshtrain import layout as S
from meshtrain.check import check_run
from meshtrain.kernels import attention as flash
from meshtrain.kernels import reference
from meshtrain.layout import batch_shardings
from meshtrain.loss import cross_entropy, loss_and_metrics, loss_mask
from meshtrain.lower import RunSpec, init_train_state, jit_train_step, make_optimizer
from meshtrain.mesh import make_mesh
from meshtrain.models import (
    PACKED_KEYS,
    DataSpec,
    GPTConfig,
    MoEConfig,
    build_model,
    call_model,
    logits_of,
)
from meshtrain.models.layers import causal_attention
from meshtrain.state import TrainState, abstract_model
from meshtrain.train import OptimConfig, TrainConfig
from meshtrain.train.step import eval_loss, train_step

T = 24


def other_documents_changed(rng, x, seg, row, doc):
    """`x` [B, T, ...] with every token of row `row` outside document `doc` replaced."""
    x = np.array(x)
    other = seg[row] != doc
    x[row, other] = rng.normal(size=x[row, other].shape).astype(x.dtype)
    return x


# --- attention: the reference and the Pallas kernel ------------------------------------------


def _qkv(rng, B, T, H, G, K, dtype):
    """Random q [B, T, H, K], k and v [B, T, G, K]."""
    return [jnp.asarray(rng.normal(size=(B, T, n, K)), dtype) for n in (H, G, G)]


def test_reference_attention_never_sees_another_document():
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 2, T, 4, 2, 16, jnp.float32)
    seg, _ = packed_layout(rng, 2, T)
    out = np.asarray(causal_attention(q, k, v, segment_ids=seg))
    assert np.isfinite(out).all()  # padding rows too
    for row, doc in ((0, 2), (1, 3)):
        mine = seg[row] == doc
        changed = [other_documents_changed(rng, x, seg, row, doc) for x in (q, k, v)]
        again = np.asarray(causal_attention(*changed, segment_ids=seg))
        np.testing.assert_array_equal(again[row, mine], out[row, mine])
        assert not np.allclose(again[row, ~mine], out[row, ~mine])  # the change got through
        # The document alone, as a sequence of its own.
        alone = causal_attention(*(x[row : row + 1, mine] for x in (q, k, v)))
        np.testing.assert_allclose(out[row, mine], np.asarray(alone)[0], rtol=1e-6, atol=1e-6)


def _with_grads(attend):
    """Jitted ``(q, k, v, do) -> (out, dq, dk, dv)``: the output and the vjp of `do`."""

    def fn(q, k, v, seg, do):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
        return (out, *vjp(do))

    return jax.jit(fn)


FLASH = _with_grads(
    lambda q, k, v, seg: flash.flash_attention(
        q, k, v, impl="pallas", segment_ids=seg, block_q=16, block_k=16
    )
)
REFERENCE = _with_grads(lambda q, k, v, seg: reference.attention(q, k, v, segment_ids=seg))
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}  # max |error| / max |reference|


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.pair("packed", "pallas")
def test_flash_kernel_with_segments_matches_reference(dtype):
    """Forward and the three gradients on random segment layouts (padding included), GQA, a
    length that is no multiple of the blocks; and a token's output ignores other documents."""
    rng = np.random.default_rng(2)
    B, Tk, H, G, K = 2, 40, 2, 1, 64
    q, k, v = _qkv(rng, B, Tk, H, G, K, dtype)
    seg = packed_layout(rng, B, Tk)[0]
    do = jnp.asarray(rng.normal(size=q.shape), dtype)
    got = [np.asarray(x, np.float32) for x in FLASH(q, k, v, seg, do)]
    want = [np.asarray(x, np.float32) for x in REFERENCE(q, k, v, seg, do)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert np.isfinite(a).all(), name
        np.testing.assert_allclose(a, b, atol=TOL[dtype] * np.abs(b).max(), rtol=0, err_msg=name)
    row, doc = 1, 2
    mine = seg[row] == doc
    changed = [jnp.asarray(other_documents_changed(rng, x, seg, row, doc)) for x in (q, k, v)]
    again = np.asarray(FLASH(*changed, seg, do)[0], np.float32)
    np.testing.assert_array_equal(again[row, mine], got[0][row, mine])
    assert not np.allclose(again[row, ~mine], got[0][row, ~mine])


def test_flash_kernel_with_segments_runs_per_shard():
    """On data=2 × fsdp=2 × tensor=2 (fsdp+tp) the kernel runs per shard, the segment ids
    split with the batch: output and gradients equal the one-device reference."""
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng, 4, 40, 4, 2, 64, jnp.float32)
    seg = packed_layout(rng, 4, 40)[0]
    do = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    rules = S.rules_for("fsdp+tp", mesh)

    def attend(q, k, v, seg):
        with S.activation_rules(mesh, rules):
            return flash.flash_attention(q, k, v, impl="pallas", segment_ids=seg, block_q=16)

    got = _with_grads(attend)(q, k, v, seg, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, REFERENCE(q, k, v, seg, do), strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, atol=TOL[jnp.float32] * np.abs(b).max(),
                                   rtol=0, err_msg=name)  # fmt: skip


def test_flash_segment_errors():
    q = jnp.zeros((1, 16, 2, 64))
    with pytest.raises(ValueError, match=r"segment_ids \(1, 8\) must be \[batch, seq\]"):
        flash.flash_attention(q, q, q, impl="pallas", segment_ids=jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids must be integers"):
        flash.flash_attention(q, q, q, impl="xla", segment_ids=jnp.zeros((1, 16)))


# --- the models: positions restart per document ----------------------------------------------

GPTS = {
    "llama": GPTConfig(style="llama", n_layers=2, d_model=32, n_heads=2, max_seq_len=T,
                       vocab_size=64),
    "gpt2": GPTConfig(style="gpt2", n_layers=2, d_model=32, n_heads=2, max_seq_len=T,
                      vocab_size=64),
}  # fmt: skip


def random_model(cfg, seed: int = 0):
    """``(graphdef, state)`` of `cfg`'s model with random float32 parameters from numpy (no
    compiled initialiser: this machine compiles slowly)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))
    rng = np.random.default_rng(seed)
    shapes = nnx.to_pure_dict(state)
    values = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.2, x.shape), x.dtype), shapes)
    nnx.replace_by_pure_dict(state, values)
    return graphdef, state


def logits_fn(cfg):
    """``f(tokens, segment_ids=None, positions=None) -> numpy logits`` of a random `cfg` model,
    jitted."""
    graphdef, state = random_model(cfg)

    @jax.jit
    def run(state, tokens, seg, pos):
        return logits_of(nnx.merge(graphdef, state)(tokens, segment_ids=seg, positions=pos))

    return lambda tokens, seg=None, pos=None: np.asarray(run(state, tokens, seg, pos))


def documents_alone(rng, fn, tokens, seg, docs):
    """The logits of each (row, document) of `docs` run at the start of a row of its own, then
    random tokens as a second document (which a causal model's first logits never see: this is
    the plain run of the document, through the same compiled function)."""
    rows = rng.integers(0, 64, (len(docs), tokens.shape[1]), np.int32)
    seg_alone = np.full(rows.shape, 2, np.int32)
    pos_alone = np.zeros(rows.shape, np.int32)
    for i, (row, doc) in enumerate(docs):
        mine = tokens[row, seg[row] == doc]
        n = len(mine)
        rows[i, :n], seg_alone[i, :n] = mine, 1
        pos_alone[i, :n], pos_alone[i, n:] = np.arange(n), np.arange(rows.shape[1] - n)
    logits = fn(rows, seg_alone, pos_alone)
    return [logits[i, : (seg[row] == doc).sum()] for i, (row, doc) in enumerate(docs)]


def check_documents(rng, fn):
    """Runs a packed batch through `fn`; each document's logits must equal its own run's."""
    rows = 4  # as many rows as the documents checked: one batch shape, one compile
    tokens = rng.integers(0, 64, (rows, T), np.int32)
    seg, pos = packed_layout(rng, rows, T)
    logits = fn(tokens, seg, pos)
    assert np.isfinite(logits).all()  # padding too
    docs = [(0, 1), (0, 2), (1, 2), (2, 3)]
    for (row, doc), alone in zip(docs, documents_alone(rng, fn, tokens, seg, docs), strict=True):
        np.testing.assert_allclose(logits[row, seg[row] == doc], alone, rtol=2e-5, atol=2e-5,
                                   err_msg=f"row {row} document {doc}")  # fmt: skip


@pytest.mark.parametrize("name", list(GPTS))
def test_a_packed_document_equals_the_document_alone(name):
    """Attention stays in the document and its positions restart: learned (gpt2), RoPE
    (llama)."""
    check_documents(np.random.default_rng(3), logits_fn(GPTS[name]))


def test_restart_positions_off_counts_along_the_row():
    """``restart_positions=False``: the model ignores ``positions`` (they run 0..T−1 along the
    row); attention still stays within each document."""
    cfg = dataclasses.replace(GPTS["gpt2"], restart_positions=False)
    off = logits_fn(cfg)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 64, (4, T), np.int32)
    seg, pos = packed_layout(rng, 4, T)
    got = off(tokens, seg, pos)
    np.testing.assert_array_equal(got, off(tokens, seg, np.tile(np.arange(T), (4, 1))))
    changed = tokens.copy()
    changed[seg != 2] = rng.integers(0, 64, changed[seg != 2].shape)
    mine = seg == 2
    np.testing.assert_allclose(off(changed, seg, pos)[mine], got[mine], rtol=1e-6, atol=1e-6)


@pytest.mark.pair("moe-capacity", "packed")
def test_moe_takes_packed_batches():
    cfg = MoEConfig(vocab_size=64, max_seq_len=T, d_model=32, n_layers=1, n_heads=2,
                    n_kv_heads=1, n_experts=4, capacity_factor=2.0)  # fmt: skip
    # Capacity for every token (2 · T · top_k / n_experts = T slots an expert): none dropped,
    # so a token's experts do not depend on the other tokens.
    check_documents(np.random.default_rng(5), logits_fn(cfg))


# --- the loss counts real tokens only ---------------------------------------------------------


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_loss_is_the_mean_over_real_tokens(impl):
    rng = np.random.default_rng(6)
    B, V = 4, 32
    logits = rng.normal(size=(B, T, V)).astype(np.float32)
    targets = rng.integers(0, V, (B, T), np.int32)
    seg, _ = packed_layout(rng, B, T)
    per_token = (np.log(np.exp(logits).sum(-1))
                 - np.take_along_axis(logits, targets[..., None], -1)[..., 0])  # fmt: skip
    want = per_token[seg > 0].mean()
    mask = loss_mask({"segment_ids": jnp.asarray(seg)})
    got = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), impl=impl, mask=mask)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    assert abs(float(got) - per_token.mean()) > 1e-4  # padding would have changed it
    loss, _ = loss_and_metrics(
        lambda lg, t, mask=None: cross_entropy(lg, t, impl=impl, mask=mask), logits, targets, mask
    )
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_a_loss_without_mask_is_refused_on_a_packed_batch():
    def my_loss(logits, targets):
        return cross_entropy(logits, targets)

    x, t = jnp.zeros((1, 4, 8)), jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="loss_fn my_loss: a packed batch needs a loss that"):
        loss_and_metrics(my_loss, x, t, t > 0)


# --- plumbing, the run check, the sharded step ------------------------------------------------


class Plain(nnx.Module):
    """A user's model that takes no packed batches."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, 8, rngs=rngs)

    def __call__(self, tokens):
        return self.embed(tokens)


def test_models_that_cannot_take_packed_batches_are_refused_before_compiling():
    batch = {k: jnp.zeros((2, T), jnp.int32) for k in ("inputs", "targets", *PACKED_KEYS)}
    model = Plain(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"model Plain: a packed batch passes segment_ids="):
        call_model(model, batch)
    plain = {k: batch[k] for k in ("inputs", "targets")}
    assert call_model(model, plain).shape == (2, T, 8)  # unchanged without packing
    data = DataSpec("lm", 8, T, 64, packed=True)
    sizes = dict(pipe=2, data=2, fsdp=1, expert=1, seq=2, tensor=2)
    run = RunSpec(data=data, train=TrainConfig(run_dir=""))  # no run directory to check
    text = "\n".join(
        map(str, check_run(run.replace(model=GPTS["llama"], mesh=sizes,
                                       rules=S.rules_for("tp", sizes))))
    )  # fmt: skip
    assert "packed batches with pipelines" not in text  # tests/test_pipeline_packed.py
    assert "packed batches with context parallelism" not in text  # test_context_parallel_packed
    sizes = dict(pipe=1, data=8, fsdp=1, expert=1, seq=1, tensor=1)
    rules = S.rules_for("dp", sizes)
    run = run.replace(mesh=sizes, rules=rules)
    assert check_run(run.replace(model=GPTS["llama"])) == []
    problems = check_run(run, abstract=abstract_model(lambda: Plain(nnx.Rngs(0))))
    assert [p.field for p in problems] == ["data.packing"]
    assert "model Plain's __call__ does not take the segment_ids=" in problems[0].message
    cudnn = dataclasses.replace(
        GPTS["llama"], d_model=128, attention_impl="cudnn", dtype="bfloat16"
    )
    assert check_run(run.replace(model=cudnn)) == []  # cuDNN's packed layout takes them
    windowed = dataclasses.replace(cudnn, sliding_window=8)
    refused = check_run(run.replace(model=windowed))
    assert [p.field for p in refused] == ["gpt.attention_impl"]
    assert "cuDNN attention with packed batches with a sliding window: " in refused[0].message


def packed_batch(rng, rows: int, vocab: int) -> dict:
    """A random packed language-model batch (the contract's five [rows, T] int32 entries)."""
    tokens = rng.integers(0, vocab, (rows, T + 1), np.int32)
    seg, pos = packed_layout(rng, rows, T)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
            "positions": pos}  # fmt: skip


TX = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 10)


@pytest.mark.slow  # two compiled train steps: ~50 s on this loaded 2-core machine
@pytest.mark.pair("fsdp", "packed")
@pytest.mark.pair("tp", "packed")
def test_sharded_packed_step_equals_single_device():
    """One AdamW step on a packed batch under fsdp+tp (2 × 2 × 2) equals the plain jitted
    step on one device: loss, gradient norm and every updated parameter; evaluation gives
    the step's loss."""
    cfg = dataclasses.replace(GPTS["llama"], n_heads=4, n_kv_heads=2)
    graphdef, state = random_model(cfg, seed=7)
    params, rest = map(nnx.to_pure_dict, nnx.split_state(state, nnx.Param, ...))
    batch = packed_batch(np.random.default_rng(8), 8, cfg.vocab_size)
    single = TrainState(jnp.zeros((), jnp.int32), params, TX.init(params), rest)
    one, want = jax.jit(lambda st, b: train_step(graphdef, TX, st, b))(single, batch)
    want_params = jax.tree.map(np.asarray, one.params)
    # Evaluation passes the packed entries the same way: the loss before the update.
    evaluated = jax.jit(lambda st, b: eval_loss(graphdef, st, b))(single, batch)
    np.testing.assert_allclose(float(evaluated), float(want["loss"]), rtol=1e-6)

    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    rules = S.rules_for("fsdp+tp", mesh)
    graphdef, sharded, shardings = init_train_state(
        lambda: nnx.merge(graphdef, state), TX, mesh, rules
    )
    step = jit_train_step(RunSpec(mesh=mesh, rules=rules), graphdef, TX, shardings,
                          batch_shardings(batch, mesh, rules))  # fmt: skip
    sharded, got = step(sharded, S.shard_batch(batch, mesh, rules))
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=0, atol=1e-5)
    np.testing.assert_allclose(float(got["grad_norm"]), float(want["grad_norm"]), rtol=1e-5)
    got_params = jax.tree.map(np.asarray, sharded.params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_params),
                            jax.tree.leaves(want_params), strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.pair("packed", "accumulation")
def test_accumulated_packed_microbatches_weigh_by_their_real_tokens():
    """Two accumulated microbatches with different numbers of real tokens give the loss and
    update of the whole packed batch (the mean over its real tokens, not of the microbatch
    means)."""
    from meshtrain.run import RunSpec
    from meshtrain.train import TrainConfig

    graphdef, state = random_model(GPTS["llama"], seed=3)
    params, rest = map(nnx.to_pure_dict, nnx.split_state(state, nnx.Param, ...))
    rng = np.random.default_rng(4)
    batch = packed_batch(rng, 4, GPTS["llama"].vocab_size)
    batch["segment_ids"][1::2, T // 2 :] = 0  # microbatch 2 (rows 1, 3): far fewer real tokens
    real = (batch["segment_ids"] > 0)[[0, 2]].sum(), (batch["segment_ids"] > 0)[[1, 3]].sum()
    assert real[0] != real[1]
    start = TrainState(jnp.zeros((), jnp.int32), params, TX.init(params), rest)

    def step(accum):
        run = RunSpec(train=TrainConfig(accum_steps=accum))
        return jax.jit(lambda st, b: train_step(graphdef, TX, st, b, run=run))(start, batch)

    (whole, want), (split, got) = step(1), step(2)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(got["grad_norm"]), float(want["grad_norm"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(split.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)  # Adam moves them ~1e-3
