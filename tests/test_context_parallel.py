"""Context parallelism over ``seq``: every algorithm against full attention (outputs and
gradients), zig-zag balance against its closed form, whole GPT runs against one device, and
bad input refused before anything compiles.

Inputs are fresh random arrays from seeded jax/numpy; everything is float32 unless stated.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cp_helpers import assert_split, errors_vs_full, qkv
from _helpers import count_compiles, losses_and_params, model_from, state_and_step, token_batches
from flax import nnx

from meshtrain import cli
from meshtrain import context_parallel as cp
from meshtrain.check import check_run
from meshtrain.checkpoint import CheckpointManager, restore
from meshtrain.context_parallel import blocks, ring, zigzag
from meshtrain.kernels import reference
from meshtrain.layout import manual_region, rules_for, shard_batch
from meshtrain.lower import RunSpec, make_optimizer
from meshtrain.mesh import make_mesh
from meshtrain.metrics import read_jsonl
from meshtrain.models import DataSpec, GPTConfig, build_model
from meshtrain.state import abstract_target
from meshtrain.train import OptimConfig, TrainConfig

ATOL = 2e-5  # float32: measured ≤ 2e-6 on outputs and gradients of unit-scale inputs


def _algorithm_vs_full(algorithms, n, causal, H, G, T, window=None):
    """Max |difference| of output and of dq, dk, dv, per algorithm, against full attention."""
    return errors_vs_full(
        algorithms, n, causal, H, G, T, K=16, B=2, window=window, seed=n * 100 + H + G + T
    )


# (seq, causal, heads, kv heads, T, window): MHA and GQA, causal and not, seq 2/4/8; T = 2·seq
# (one token per zig-zag chunk, the smallest edge) and larger; a window shorter than a block.
CASES = [
    (2, True, 4, 2, 4, None),
    (4, False, 4, 4, 16, None),
    pytest.param(8, True, 8, 2, 32, 5, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("n, causal, H, G, T, window", CASES)
def test_every_algorithm_equals_full_attention_with_gradients(n, causal, H, G, T, window):
    algorithms = ["ring", "allgather", "ulysses"]
    for algorithm, diffs in _algorithm_vs_full(algorithms, n, causal, H, G, T, window).items():
        assert max(diffs) < ATOL, (algorithm, diffs)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_balances_causal_blocks_and_the_plain_split_does_not(n):
    T = 2 * n * 4  # 2n chunks of 4 tokens
    balanced = cp.causal_chunk_pairs(cp.order(T, n), n, 2 * n)
    plain = cp.causal_chunk_pairs(np.arange(T), n, 2 * n)
    assert max(balanced) - min(balanced) <= 1
    assert balanced == [2 * n + 1] * n
    assert plain == cp.naive_counts(n)  # 4i + 3: the closed form
    assert max(plain) - min(plain) == 4 * (n - 1)
    assert sum(balanced) == sum(plain)  # the same work, redistributed


def test_zigzag_order_is_a_permutation_and_inverse_undoes_it():
    idx = cp.order(24, 3)
    assert sorted(idx) == list(range(24))
    np.testing.assert_array_equal(idx[cp.inverse(idx)], np.arange(24))
    assert list(idx[:8]) == [0, 1, 2, 3, 20, 21, 22, 23]  # device 0: first and last chunk


# --- the half-work ring -------------------------------------------------------------------


def _ring_region(mesh, n, T, causal, window, **flags):
    """`ring` in a region manual over seq, on global arrays in the zig-zag order (the form
    `context_attention` runs), with the given ring flags."""
    idx = jnp.asarray(cp.order(T, n) if causal else np.arange(T))
    opts = blocks.Options(causal, window, **flags)
    fn = lambda q, k, v, p: ring.ring(q, k, v, p, p, "seq", opts)  # noqa: E731
    seq = jax.P(None, "seq")
    region = manual_region(
        fn, mesh=mesh, axes={"seq"}, in_specs=(seq, seq, seq, jax.P("seq")), out_specs=seq
    )
    return lambda q, k, v: region(q, k, v, idx)


def _half_vs_whole_vs_full(n, H, G, T, window, leaf, causal=True, whole=True):
    """Max |difference| of output, dq, dk, dv: the half-work ring and (with `whole`) the
    whole-block ring against full attention, and against each other."""
    mesh = make_mesh(f"data={8 // n},seq={n}")
    q, k, v, w = qkv(n * 1000 + H + G + T + leaf, 2, T, H, G, 16)
    idx = cp.order(T, n) if causal else np.arange(T)
    inv = cp.inverse(idx)

    def full(q, k, v, w):  # w an input, not a constant of the program
        o = reference.attention(q, k, v, causal=causal, window=window)
        return (o * w).sum(), o

    def run(**flags):
        attend = _ring_region(mesh, n, T, causal, window, **flags)

        def split(q, k, v, w):
            o = attend(q[:, idx], k[:, idx], v[:, idx])
            return (o * w[:, idx]).sum(), o[:, inv]

        with jax.set_mesh(mesh):
            return jax.jit(jax.value_and_grad(split, (0, 1, 2), has_aux=True))(q, k, v, w)

    results = {"full": jax.jit(jax.value_and_grad(full, (0, 1, 2), has_aux=True))(q, k, v, w)}
    if whole or not causal:
        results["whole"] = run(halve=False)
    if causal:
        results["half"] = run(halve=True, leaf=leaf)

    def diffs(a, b):
        (_, o_a), g_a = a
        (_, o_b), g_b = b
        return [
            float(np.abs(np.asarray(x) - np.asarray(y)).max())
            for x, y in zip((o_a, *g_a), (o_b, *g_b), strict=True)
        ]

    names = [x for x in results if x != "full"]
    out = {f"{x}-full": diffs(results[x], results["full"]) for x in names}
    if causal and "whole" in results:
        out["half-whole"] = diffs(results["half"], results["whole"])
    return out


# (seq, heads, kv heads, T, window, leaf, whole): MHA and GQA, seq 2/4/8; T = 2·seq·c with
# chunks of c tokens; leaf < c/2 halves the own block's diagonals (twice where c = 8, leaf = 2
# or c = 4, leaf = 1; once where c = 2, leaf = 1); a window shorter than a chunk and one
# longer. An own block left whole (leaf ≥ c/2) is the whole-block ring's; which pieces the ring
# plans, for more chunk sizes and leaves, is checked without running it
# (`test_half_work_pieces_cover_each_causal_pair_once`). `whole`: the whole-block ring (a
# program as costly as the half-work one) runs beside it.
HALF_CASES = [
    (2, 4, 4, 16, 3, 1, True),
    (4, 8, 2, 64, 11, 2, False),
    (8, 4, 2, 32, None, 1, True),
]


@pytest.mark.parametrize("n, H, G, T, window, leaf, whole", HALF_CASES)
def test_half_work_ring_equals_whole_block_ring_and_full_attention(n, H, G, T, window, leaf, whole):
    for pair, d in _half_vs_whole_vs_full(n, H, G, T, window, leaf, whole=whole).items():
        assert max(d) < ATOL, (pair, d)  # output, dq, dk, dv


# seq = 4: context_attention's ring without a mask, in the algorithms' test above.
@pytest.mark.parametrize("n", [2])
def test_whole_block_ring_equals_full_attention_without_a_causal_mask(n):
    for pair, d in _half_vs_whole_vs_full(n, 4, 2, 16, None, 1, causal=False).items():
        assert max(d) < ATOL, (pair, d)


def test_half_work_is_chosen_only_for_causal_zigzag_positions_and_jnp_blocks():
    T, n = 32, 4

    def halve(positions, n, causal=True, impl="xla"):
        return ring.for_positions(positions, n, blocks.Options(causal, impl=impl)).keywords["halve"]

    assert halve(cp.order(T, n), n)
    assert not halve(cp.order(T, n), n, impl="pallas")  # the kernel skips empty tiles itself
    assert halve(jnp.asarray(cp.order(T, n)), n)  # a concrete jax array
    assert not halve(cp.order(T, n), n, causal=False)
    assert not halve(np.arange(T), n)  # the plain split
    assert not halve(cp.order(T, 2), n)  # balanced for another seq
    assert not halve(cp.order(36, 3)[:-4], 2)
    seen = []
    jax.jit(lambda p: seen.append(halve(p, n)) or p)(jnp.asarray(cp.order(T, n)))
    assert seen == [False]  # traced positions: the whole-block ring
    mesh = make_mesh("data=4,seq=2")
    q, k, v, _ = qkv(0, 1, 8, 2, 2, 8)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="halve=True"):
        jax.jit(_ring_region(mesh, 2, 8, False, None, halve=True)).trace(q, k, v)


@pytest.mark.parametrize("n, c, leaf", [(2, 8, 2), (4, 6, 1), (8, 4, 128), (3, 16, 4)])
def test_half_work_pieces_cover_each_causal_pair_once(n, c, leaf):
    """The pieces `zigzag` plans (the ones the ring computes) against the causal pairs of the
    zig-zag layout: every visible pair exactly once, per device the closed form
    ``zigzag.half_pairs``, and the pieces stacked in one call share one position shift."""
    T, rows = 2 * n * c, 2 * c
    pos = cp.order(T, n)
    for i in range(n):
        covered = np.zeros((rows, T), int)  # local query row × global key index
        for j in range(n):
            groups = zigzag.own_groups(c, leaf) if j == i else zigzag.step_groups(i, j, c)
            q_pos, k_pos = pos[i * rows : (i + 1) * rows], pos[j * rows : (j + 1) * rows]
            for group in groups:
                shifts = {(int(q_pos[p.q]), int(k_pos[p.k])) for p in group}
                gaps = {a - b for a, b in shifts}
                assert len(gaps) == 1, group  # one position shift for the whole group
                for p in group:
                    covered[p.q : p.q + p.nq, j * rows + p.k : j * rows + p.k + p.nk] += 1
        visible = pos[i * rows : (i + 1) * rows, None] >= pos[None, :]  # causal
        assert (covered[visible] == 1).all()  # every causal pair once
        assert covered.max() == 1  # nothing twice
        assert covered.sum() == zigzag.half_pairs(n, c, leaf)
    s = c >> zigzag.diagonal_depth(c, leaf)
    assert zigzag.half_pairs(n, c, leaf) == 2 * n * c * c + c * s  # the closed form
    assert zigzag.half_pairs(n, c, leaf) <= 4 * n * c * c // 2 + c * c  # at most half + c²


@pytest.mark.parametrize("n", [2, 4, 8])
def test_half_work_ring_computes_the_closed_form_of_pairs(n, monkeypatch):
    """Counts the (query, key) pairs the traced ring hands to `blocks.attend` (forward) and
    `blocks.grads` (backward), telling the own block from a hop (the scan body, traced once
    and run n − 1 times): per device own + (n − 1)·hop must be ``zigzag.half_pairs`` with
    `halve`, 4n·c² without."""
    c, leaf, T = 8, 2, 2 * n * 8
    calls, state = [], {"hop": False, "bodies": 0}
    real_scan = jax.lax.scan

    def scan(f, init, xs=None, *args, **kw):
        def body(carry, x):
            state["hop"], state["bodies"] = True, state["bodies"] + 1
            try:
                return f(carry, x)
            finally:
                state["hop"] = False

        return real_scan(body, init, xs, *args, **kw)

    def counted(name, real):
        def fn(q, k, *args, **kw):  # B = 1: the batch counts the pieces stacked in one call
            calls.append((name, state["hop"], q.shape[0] * q.shape[1] * k.shape[1]))
            return real(q, k, *args, **kw)

        return fn

    monkeypatch.setattr(jax.lax, "scan", scan)
    for name in ("attend", "grads"):
        monkeypatch.setattr(blocks, name, counted(name, getattr(blocks, name)))
    mesh = make_mesh(f"data={8 // n},seq={n}")
    q, k, v, _ = qkv(0, 1, T, 4, 2, 16)
    for halve, want in ((True, zigzag.half_pairs(n, c, leaf)), (False, 4 * n * c * c)):
        attend = _ring_region(mesh, n, T, True, None, halve=halve, leaf=leaf)
        loss = lambda q, k, v, attend=attend: attend(q, k, v).sum()  # noqa: E731
        calls.clear()
        state["bodies"] = 0
        with jax.set_mesh(mesh):
            jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, k, v)
        assert state["bodies"] == 2  # one hop traced for the forward, one for the backward
        for name in ("attend", "grads"):
            own = sum(pairs for who, hop, pairs in calls if who == name and not hop)
            hop = sum(pairs for who, hop, pairs in calls if who == name and hop)
            assert own + (n - 1) * hop == want, (name, halve, calls)
    assert 2 * zigzag.half_pairs(n, c, leaf) < 1.1 * 4 * n * c * c  # about half the work


# --- a whole GPT --------------------------------------------------------------------------

T, B, STEPS = 16, 8, 3
TX = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 10)
GPT = GPTConfig(style="llama", n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=T)


def _batches(cfg):
    out = token_batches(STEPS, cfg.vocab_size, B, T)
    return out + out[:1]  # one more batch for a resumed step


def _train(cfg, mesh_str, strategy="dp", context="ring", devices=None):
    """STEPS steps from the same initial values: losses, final parameters, and what it takes
    to go on (state, shardings, the jitted step)."""
    mesh = make_mesh(mesh_str, devices=devices)
    rules = rules_for(strategy, mesh, context_parallel=context)
    values = _initial(cfg)

    data = _batches(cfg)
    _, state, shardings, step = state_and_step(model_from(cfg, values), TX, mesh, rules, data[0])
    assert_split(step, state, shard_batch(data[0], mesh, rules), mesh, rules)
    losses, params, state = losses_and_params(step, state, data[:STEPS], mesh, rules)

    def go_on(state, batch):
        return step(state, shard_batch(batch, mesh, rules))

    return dict(loss=losses, params=params, state=state, shardings=shardings, step=go_on)


_INIT = {}


def _initial(cfg):
    if cfg not in _INIT:
        state = jax.jit(lambda: nnx.to_pure_dict(nnx.state(build_model(cfg))))()
        _INIT[cfg] = jax.tree.map(np.asarray, state)
    return _INIT[cfg]


_REF = {}
# The tests sharing a one-device run go to one worker (under --dist loadgroup).
shares_the_reference = pytest.mark.xdist_group("context_parallel_gpt")


def _reference(cfg):
    if cfg not in _REF:
        _REF[cfg] = _train(cfg, "data=1", devices=jax.devices()[:1])
    return _REF[cfg]


def _assert_same(got, want):
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(want["params"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-5)
    assert not np.allclose(got["loss"][0], got["loss"][-1])  # it trained


@pytest.mark.slow
@shares_the_reference
@pytest.mark.pair("dp", "ring")
@pytest.mark.pair("remat", "ring")
@pytest.mark.pair("resume-relayout", "ring")
@pytest.mark.pair("dp", "remat")
@pytest.mark.pair("dp", "resume-relayout")
def test_gpt_on_seq4_data2_equals_one_device_and_resumes_on_seq1(tmp_path):
    """3 steps with ring attention (and full remat, which recomputes the ring's custom-VJP
    forward) on seq=4 × data=2 equal one device (losses, parameters); the state saved there
    restores onto one device and its next step equals the single-device run's."""
    cfg = dataclasses.replace(GPT, remat="full")
    got, want = _train(cfg, "seq=4,data=2"), _reference(cfg)
    _assert_same(got, want)
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(STEPS, got["state"])
    restored = restore(tmp_path / "ck", abstract_target(want["state"], want["shardings"]))
    assert restored.step == STEPS
    batch = _batches(cfg)[STEPS]
    _, m_resumed = want["step"](restored.state, batch)
    _, m_straight = want["step"](want["state"], batch)
    np.testing.assert_allclose(float(m_resumed["loss"]), float(m_straight["loss"]), atol=1e-5)


@pytest.mark.slow
@shares_the_reference
@pytest.mark.pair("fsdp", "ulysses")
@pytest.mark.pair("tp", "ulysses")
@pytest.mark.pair("fsdp", "tp")
def test_gpt_on_seq2_tensor2_data2_with_ulysses_equals_one_device():
    # with remat as the ring's test above: the one-device run is theirs too
    cfg = dataclasses.replace(GPT, remat="full")
    _assert_same(_train(cfg, "seq=2,tensor=2,data=2", "fsdp+tp", "ulysses"), _reference(cfg))


# --- bad input ----------------------------------------------------------------------------

LM = DataSpec(kind="lm", batch_size=8, seq_len=20, vocab_size=256)


GPT32 = dataclasses.replace(GPT, max_seq_len=32)


def _problems(sizes, context, cfg=GPT32, data=LM):
    full = {**dict(pipe=1, data=1, fsdp=1, expert=1, seq=1, tensor=1), **sizes}
    rules = rules_for("dp", full, context_parallel=context)
    run = RunSpec(model=cfg, data=data, mesh=full, rules=rules, train=TrainConfig(run_dir=""))
    return [str(p) for p in check_run(run)]


def test_bad_context_settings_are_clear_errors_before_compiling():
    cfg = dataclasses.replace(GPT, n_heads=6, n_kv_heads=3, d_model=48, max_seq_len=32)
    with count_compiles() as compiles:
        assert _problems(dict(seq=4, data=2), "ring") == [
            "data.seq_len=20: not divisible by 2 × seq = 8: context parallelism cuts each "
            "sequence into 2·seq chunks to balance causal work; use --data.seq-len 24 (a "
            "multiple of 8) or a smaller seq"
        ]
        assert _problems(dict(seq=4, data=2), "ulysses", cfg, LM._replace(seq_len=32)) == [
            "gpt.n_heads=6: context_parallel='ulysses' splits the heads over seq=4, which does "
            "not divide 6; use a head count divisible by 4, or --context-parallel ring"
        ]
        assert _problems(dict(seq=2), "ulysses", cfg, LM._replace(seq_len=32)) == []
        assert _problems(dict(seq=2, data=4), "spiral") == [
            "context_parallel='spiral': unknown algorithm; choose from ring, allgather, ulysses "
            "(e.g. --context-parallel ring)"
        ]
        assert _problems(dict(seq=2, pipe=2, data=2), "ring") == []  # inside the stages
        assert _problems(dict(seq=1, data=8), "allgather") == [  # seq=1: it would do nothing
            "context_parallel='allgather': has no effect on a mesh with seq=1: it belongs to "
            "context parallelism; drop --context-parallel or add seq=N to --mesh (e.g. --mesh "
            "data=4,seq=2)"
        ]
    assert compiles == []


def test_cli_refuses_an_unknown_algorithm_in_one_line(capsys):
    assert cli.main(["train", "--context-parallel", "spiral"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "context_parallel='spiral': unknown algorithm" in err[0], err


def _cli_losses(tmp_path, name, *argv):
    """Train through `meshtrain train` in-process; the train losses by step."""
    run = tmp_path / name
    tiny = [
        "--gpt.d-model", "32", "--gpt.n-layers", "1", "--gpt.n-heads", "4",
        "--gpt.dtype", "bfloat16", "--data.seq-len", "32", "--data.batch-size", "8",
        "--log-every", "1", "--eval-every", "0", "--sample-tokens", "0", "--no-progress",
        "--warmup-steps", "0", "--min-lr-ratio", "1",  # one lr whatever --steps says
        "--data.val-fraction", "0",  # no held-out data: no evaluation
    ]  # fmt: skip
    argv = ["train", *tiny, *argv, "--run-dir", str(run)]
    assert cli.main(argv) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


@pytest.mark.slow
@pytest.mark.pair("bf16", "ring")
@pytest.mark.pair("resume-relayout", "ring")
@pytest.mark.pair("resume-relayout", "bf16")
def test_cli_trainer_bf16_on_seq4_resumes_on_seq1_as_data8_runs(tmp_path):
    """The CLI and Trainer with a bf16 GPT on seq=4 × data=2 (no --strategy: auto), and its
    checkpoint resumed on a mesh without seq: the losses of a straight data=8 run."""
    split = _cli_losses(tmp_path, "cp", "--mesh", "seq=4,data=2", "--steps", "2")
    resumed = _cli_losses(tmp_path, "cp", "--mesh", "data=8", "--steps", "3", "--resume")
    straight = _cli_losses(tmp_path, "dp", "--mesh", "data=8", "--steps", "3", "--no-save")
    # bf16 compute, float32 parameters and loss: reduction orders differ across layouts.
    np.testing.assert_allclose([split[1], split[2]], [straight[1], straight[2]], atol=2e-2)
    np.testing.assert_allclose(resumed[3], straight[3], rtol=0, atol=2e-2)
    assert straight[3] < straight[1]  # it trained
