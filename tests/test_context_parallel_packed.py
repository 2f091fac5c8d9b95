"""Packed documents under context parallelism: every algorithm (ring, all-gather, Ulysses) with
segment ids against `layers.causal_attention(..., segment_ids=...)` (output and gradients),
and whole GPTs (llama; gpt2 with the Pallas blocks) trained 3 steps on packed batches on
``seq=4,data=2`` against one device.

A packed row holds documents of random lengths back to back (they cross the zig-zag chunks
and so the devices' shards), then padding (segment 0). Inputs are fresh random arrays from
seeded generators; everything is float32.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cp_helpers import assert_split, qkv
from _helpers import initial_values, losses_and_params, model_from, state_and_step

from meshtrain import context_parallel as cp
from meshtrain.check import check_run
from meshtrain.context_parallel import blocks, ring
from meshtrain.layout import manual_region, rules_for, shard_batch
from meshtrain.lower import make_optimizer
from meshtrain.mesh import make_mesh
from meshtrain.models import DataSpec, GPTConfig
from meshtrain.models.layers import causal_attention
from meshtrain.run import RunSpec
from meshtrain.train import OptimConfig

ATOL = 2e-5  # float32, as the context-parallel attention tests (measured ≤ 2e-6 there)
ALGORITHMS = ("ring", "allgather", "ulysses")


def documents(rng, rows: int, T: int, *, longest: int):
    """Random ``(segment_ids, positions)`` [rows, T] int32: documents of 1..`longest` tokens,
    then 1..T/4 tokens of padding (segment 0)."""
    seg, pos = np.zeros((rows, T), np.int32), np.zeros((rows, T), np.int32)
    for r in range(rows):
        end, start, doc = T - int(rng.integers(1, T // 4 + 1)), 0, 1
        while start < end:
            n = min(int(rng.integers(1, longest + 1)), end - start)
            seg[r, start : start + n], pos[r, start : start + n] = doc, np.arange(n)
            start, doc = start + n, doc + 1
    return seg, pos


def _crosses_shards(seg, n: int) -> bool:
    """Whether some document has tokens on two devices of the zig-zag layout."""
    T = seg.shape[1]
    device = np.empty(T, int)
    device[cp.order(T, n)] = np.arange(T) // (T // n)
    return any(len(set(device[row == d])) > 1 for row in seg for d in set(row.tolist()) - {0})


# --- attention ------------------------------------------------------------------------------


def _segment_errors(algorithm, n, H, G, T, *, K, B, window=None, impl="xla", seed=0, run=None):
    """Max |difference| of the output and of dq, dk, dv against plain attention with segment
    ids; the tokens and their segment ids take the zig-zag order, as the GPT passes them.
    `run(q, k, v, idx, seg)` replaces `context_attention` (to call `ring` itself)."""
    mesh = make_mesh(f"data={8 // n},seq={n}")
    q, k, v, w = qkv(seed, B, T, H, G, K)
    seg, _ = documents(np.random.default_rng(seed), B, T, longest=T // 3)
    assert _crosses_shards(seg, n) and (seg == 0).any()
    idx, inv = cp.order(T, n), cp.inverse(cp.order(T, n))

    def full(q, k, v, w):  # w an input, not a constant of the program
        o = causal_attention(q, k, v, window=window, segment_ids=jnp.asarray(seg))
        return (o * w).sum(), o

    def split(q, k, v, w):
        args = (q[:, idx], k[:, idx], v[:, idx], idx, jnp.asarray(seg[:, idx]))
        if run is None:
            o = cp.context_attention(
                *args[:4], mesh=mesh, algorithm=algorithm, window=window, impl=impl,
                segment_ids=args[4],
            )  # fmt: skip
        else:
            o = run(*args)
        return (o * w[:, idx]).sum(), o[:, inv]

    (_, want), g_want = jax.jit(jax.value_and_grad(full, (0, 1, 2), has_aux=True))(q, k, v, w)
    with jax.set_mesh(mesh):
        (_, got), g = jax.jit(jax.value_and_grad(split, (0, 1, 2), has_aux=True))(q, k, v, w)
    assert all(np.isfinite(np.asarray(x)).all() for x in (got, *g))  # padding too
    pairs = zip((got, *g), (want, *g_want), strict=True)
    return [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in pairs]


@pytest.mark.parametrize(
    "algorithm",
    [pytest.param(a, marks=pytest.mark.pair("packed", a)) for a in ALGORITHMS],
)
@pytest.mark.parametrize("n, H, G, T, window", [(4, 4, 2, 32, None), (2, 4, 4, 24, 5)])
def test_every_algorithm_masks_by_segment_like_the_plain_attention(algorithm, n, H, G, T, window):
    errors = _segment_errors(algorithm, n, H, G, T, K=16, B=2, window=window, seed=n + T)
    assert max(errors) < ATOL, errors


@pytest.mark.parametrize("leaf", [4, 128])
def test_half_work_ring_with_segments_equals_plain_attention(leaf):
    """The half-work ring (hops halved; with leaf 4 the own block's diagonals too) skips only
    pieces the causal mask hides; the segments only hide more, so it stays exact."""
    n, T = 2, 32
    opts = blocks.Options(True, None, "xla")
    seq = jax.P(None, "seq")

    def run(q, k, v, idx, seg):
        def per_device(q, k, v, pos, seg):
            return ring.ring(
                q,
                k,
                v,
                pos,
                pos,
                "seq",
                opts._replace(halve=True, leaf=leaf),
                q_segments=seg,
                k_segments=seg,
            )

        region = manual_region(
            per_device, mesh=make_mesh(f"data={8 // n},seq={n}"), axes={"seq"},
            in_specs=(seq, seq, seq, jax.P("seq"), seq), out_specs=seq,
        )  # fmt: skip
        return region(q, k, v, jnp.asarray(idx, jnp.int32), seg)

    errors = _segment_errors("ring", n, 4, 2, T, K=16, B=2, seed=leaf, run=run)
    assert max(errors) < ATOL, errors
    assert ring.for_positions(cp.order(T, n), n, opts).keywords["halve"]  # what the GPT runs


@pytest.mark.pair("packed", "pallas")
@pytest.mark.pair("packed", "ring")
def test_ring_with_the_kernel_masks_by_segment_like_the_plain_attention():
    """The Pallas blocks (interpreted): 80 tokens per device with head width 64 cross the
    kernel's 64-row block."""
    errors = _segment_errors("ring", 2, 2, 1, 160, K=64, B=1, impl="pallas", seed=3)
    assert max(errors) < ATOL, errors


# --- a whole GPT ----------------------------------------------------------------------------

T, B, STEPS = 32, 8, 3
ADAMW = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 10)
# SGD for the kernel, as its context-parallel test: parameters move by lr × gradient.
SGD = make_optimizer(OptimConfig(optimizer="sgd", lr=0.1, warmup_steps=0), 10)
LLAMA = GPTConfig(style="llama", n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=T)
# gpt2 (learned positions) with the Pallas blocks: head width 64.
GPT2 = dataclasses.replace(
    LLAMA, style="gpt2", d_model=128, n_heads=2, n_kv_heads=2, attention_impl="pallas"
)


def _batches(cfg, seed):
    """STEPS fresh packed batches whose documents cross the shards of seq = 4."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):  # noqa: B007
        tokens = rng.integers(0, cfg.vocab_size, (B, T + 1), np.int32)
        seg, pos = documents(rng, B, T, longest=12)
        assert _crosses_shards(seg, 4)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
                    "positions": pos})  # fmt: skip
    return out


def _train(cfg, tx, mesh_str, context, values, data, devices=None):
    """STEPS steps from `values` on `data`: the losses and the final parameters."""
    mesh = make_mesh(mesh_str, devices=devices)
    rules = rules_for("dp", mesh, context_parallel=context)

    _, state, _, step = state_and_step(model_from(cfg, values), tx, mesh, rules, data[0])
    assert_split(step, state, shard_batch(data[0], mesh, rules), mesh, rules)
    losses, params, _ = losses_and_params(step, state, data, mesh, rules)
    return losses, params


_REF: dict = {}


def _one_device(cfg, tx, values, data, key):
    if key not in _REF:
        _REF[key] = _train(cfg, tx, "data=1", "ring", values, data, devices=jax.devices()[:1])
    return _REF[key]


# (model, algorithm): llama (jnp blocks, AdamW) with every algorithm; gpt2 (learned positions)
# with the Pallas blocks and the ring (SGD, as the kernel's context-parallel GPT test). The
# parameter tolerances are the existing context-parallel GPT tests': AdamW 5e-5, SGD 1e-6.
GPT_CASES = [
    pytest.param("llama", "ring", marks=pytest.mark.pair("packed", "ring")),
    pytest.param("llama", "allgather", marks=pytest.mark.pair("packed", "allgather")),
    pytest.param("llama", "ulysses", marks=pytest.mark.pair("packed", "ulysses")),
    pytest.param(
        "gpt2",
        "ring",
        marks=[pytest.mark.pair("packed", "ring"), pytest.mark.pair("packed", "pallas")],
    ),
]
MODELS = {"llama": (LLAMA, ADAMW, 5e-5), "gpt2": (GPT2, SGD, 1e-6)}


@pytest.mark.parametrize("model, algorithm", GPT_CASES)
def test_gpt_on_packed_batches_on_seq4_data2_equals_one_device(model, algorithm):
    """3 steps on packed batches (documents across shards, padding) on seq=4 × data=2 equal
    the single-device run: losses (the mean over the whole batch's real tokens) and every
    parameter."""
    cfg, tx, atol = MODELS[model]
    values, data = initial_values(cfg), _batches(cfg, seed=len(model))
    loss, params = _train(cfg, tx, "seq=4,data=2", algorithm, values, data)
    loss_1, params_1 = _one_device(cfg, tx, values, data, model)
    np.testing.assert_allclose(loss, loss_1, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_1), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)
    assert not np.allclose(loss[0], loss[-1])  # it trained


def test_the_run_check_takes_packed_batches_under_seq():
    """The pair is no longer refused (the run check says nothing)."""
    sizes = dict(pipe=1, data=2, fsdp=1, expert=1, seq=4, tensor=1)
    data = DataSpec("lm", B, T, LLAMA.vocab_size, packed=True)
    for algorithm in ALGORITHMS:
        rules = rules_for("dp", sizes, context_parallel=algorithm)
        assert check_run(RunSpec(model=LLAMA, data=data, mesh=sizes, rules=rules)) == []
