"""Tests for meshtrain.pipeline: schedule tables, equivalence of every schedule with the
unpipelined GPT (loss and every gradient), NaN-filled bubbles, and errors before compiling.

fp32 tolerance: the pipelined and plain programs sum the same microbatch terms in a different
order, so gradients agree to a few ulps of their largest entry; we allow 2e-5 of it (measured
≤ 1e-6), and 1e-5 relative on the loss. bf16 compute is judged against the float32 truth
instead (see `_assert_as_accurate`).
"""

import contextlib
import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import initial_values
from flax import nnx

from meshtrain.comm.hlo import collectives
from meshtrain.data import make_arrays_dataset
from meshtrain.layout import activation_rules, rules_for
from meshtrain.loss import cross_entropy_with
from meshtrain.lower import cross_entropy, init_train_state
from meshtrain.mesh import make_mesh
from meshtrain.models import GPTConfig, build_model
from meshtrain.optim import OptimConfig
from meshtrain.pipeline import (
    BWD,
    FWD,
    IDLE,
    PipelineConfig,
    pipeline_loss_and_grads,
    pipeline_problems,
    schedule_table,
    spmd,
)
from meshtrain.pipeline.schedules import buffer_depth
from meshtrain.run import RunSpec
from meshtrain.train.trainer import TrainConfig, Trainer

GRAD_RTOL, LOSS_RTOL = 2e-5, 1e-5  # fp32
CFG = GPTConfig(d_model=32, n_layers=8, n_heads=4, n_kv_heads=2, max_seq_len=8, vocab_size=64)
B, T = 32, 8


# --- schedule tables (no compiling) --------------------------------------------------------

CASES = [(s, p, m, 1) for s in ("gpipe", "1f1b") for p in (2, 4) for m in (p, 2 * p, 4 * p)]
CASES += [("circular", p, m, v) for p in (2, 4) for m in (p, 2 * p, 4 * p) for v in (1, 2)]


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_counted_bubble_equals_closed_form(schedule, p, m, v):
    table = schedule_table(schedule, p, m, v)
    assert table.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert table.bubble_fraction == pytest.approx(table.closed_form_bubble, abs=1e-12)


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_table_runs_every_microbatch_once_each_way_in_dependency_order(schedule, p, m, v):
    table = schedule_table(schedule, p, m, v)
    when = {}
    for t, s in itertools.product(range(table.slots), range(p)):
        ph = table.phase[t, s]
        if ph != IDLE:
            key = (int(ph), int(table.micro[t, s]), int(table.chunk[t, s]), s)
            assert key not in when, f"{key} scheduled twice"
            when[key] = t
    assert len(when) == 2 * m * v * p
    for i, r, s in itertools.product(range(m), range(v), range(p)):
        # The global chunk order is (r, s) → r·p + s; each chunk's input is the previous one's
        # output, and a backward follows the next chunk's backward and its own forward.
        prev = (r, s - 1) if s > 0 else (r - 1, p - 1)
        nxt = (r, s + 1) if s < p - 1 else (r + 1, 0)
        if prev[0] >= 0:
            assert when[(FWD, i, *prev)] < when[(FWD, i, r, s)]
        if nxt[0] < v:
            assert when[(BWD, i, *nxt)] < when[(BWD, i, r, s)]
        assert when[(FWD, i, r, s)] < when[(BWD, i, r, s)]


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 16)])
def test_1f1b_keeps_at_most_p_microbatches_in_flight_where_gpipe_keeps_m(p, m):
    one = schedule_table("1f1b", p, m)
    assert one.in_flight() == p
    assert buffer_depth(one, "res") == p
    assert schedule_table("gpipe", p, m).in_flight() == m


def test_gantt_chart_draws_every_busy_slot():
    import matplotlib

    matplotlib.use("Agg")
    table = schedule_table("circular", 2, 4, 2)
    ax = table.plot()
    assert len(ax.patches) == int(np.sum(table.phase != IDLE))
    assert "bubble" in ax.get_title()


# --- equivalence with the unpipelined GPT --------------------------------------------------


_REFERENCES: dict = {}


def _reference(cfg):
    """The unpipelined GPT's jitted loss and gradients, one per config: called on host
    parameters and batch, it runs on one device (the single-device math)."""
    if cfg not in _REFERENCES:
        graphdef = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))[0]

        def loss(params, batch):
            return cross_entropy(nnx.merge(graphdef, params)(batch["inputs"]), batch["targets"])

        _REFERENCES[cfg] = jax.jit(jax.value_and_grad(loss))
    return _REFERENCES[cfg]


def _setup(mesh_spec, devices, cfg=CFG, strategy="fsdp", batch_size=B):
    """A sharded state, a fresh random batch and the one-device reference loss and gradients
    (for a cfg computed in bfloat16, also the same parameters' float32 ones: the truth)."""
    mesh = make_mesh(mesh_spec, devices=jax.devices()[:devices])
    rules = rules_for(strategy, mesh)
    exact = dataclasses.replace(cfg, dtype="float32")
    values = initial_values(exact)
    graphdef, state, _ = init_train_state(
        lambda: build_model(cfg), optax.sgd(0.1), mesh, rules, params=values
    )
    rng = np.random.default_rng(abs(hash(mesh_spec)) % 2**32)
    batch = {
        k: rng.integers(0, cfg.vocab_size, (batch_size, T)).astype(np.int32)
        for k in ("inputs", "targets")
    }
    env = dict(mesh=mesh, rules=rules, graphdef=graphdef, state=state, batch=batch)
    env["ref"] = _reference(cfg)(values, batch)
    if cfg.dtype != "float32":
        env["exact"] = _reference(exact)(values, batch)
    return env


@pytest.fixture(scope="module")
def layouts():
    """Built lazily and shared: pipe alone, pipe × data, and pipe × data × tensor."""
    cache = {}

    def get(spec, devices=8, strategy="fsdp", cfg=CFG):
        if (spec, strategy, cfg) not in cache:
            cache[spec, strategy, cfg] = _setup(spec, devices, cfg, strategy)
        return cache[spec, strategy, cfg]

    return get


def _pipelined(env, config, poison=False):
    """Loss and gradients of the pipelined GPT on `env` (its buffers NaN-filled with `poison`)."""
    mesh, rules = env["mesh"], env["rules"]

    @jax.jit
    def run(params, batch):
        poisoned = spmd.poison_buffers() if poison else contextlib.nullcontext()
        with activation_rules(mesh, rules), poisoned:
            return pipeline_loss_and_grads(
                env["graphdef"],
                params,
                env["state"].rest,
                batch,
                config=config,
                mesh=mesh,
                loss_fn=cross_entropy,
            )

    return run(env["state"].params, env["batch"])


def _assert_matches(env, got, dtype=jnp.float32):
    if dtype != jnp.float32:
        return _assert_as_accurate(env, got)
    ref_loss, ref_grads = env["ref"]
    loss, grads = got
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=LOSS_RTOL)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    flat_got = jax.tree.leaves(grads)
    assert len(flat_ref) == len(flat_got)
    for (path, r), g in zip(flat_ref, flat_got, strict=True):
        r, g = np.asarray(r, np.float32), np.asarray(g, np.float32)
        assert r.shape == g.shape, path
        assert np.all(np.isfinite(g)), f"non-finite gradient at {jax.tree_util.keystr(path)}"
        err = np.abs(r - g).max() / max(np.abs(r).max(), 1e-6)
        assert err <= GRAD_RTOL, f"{jax.tree_util.keystr(path)}: rel err {err:.2e}"


def _assert_as_accurate(env, got):
    """bf16: per-microbatch matmuls round differently from whole-batch ones, so instead of
    matching the unpipelined bf16 run we require the pipelined gradients to be as close to the
    float32 truth as it is (relative Frobenius error at most 1.5× its own, plus 2e-3)."""
    exact_loss, exact = env["exact"]
    plain_loss, plain = env["ref"]
    loss, grads = got
    assert (
        abs(float(loss) - float(exact_loss))
        <= 1.5 * abs(float(plain_loss) - float(exact_loss)) + 1e-2
    )
    for (path, e), p, g in zip(
        jax.tree_util.tree_leaves_with_path(exact),
        jax.tree.leaves(plain),
        jax.tree.leaves(grads),
        strict=True,
    ):
        e, p, g = (np.asarray(a, np.float32) for a in (e, p, g))
        assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
        norm = max(np.linalg.norm(e), 1e-6)
        ours, theirs = np.linalg.norm(g - e) / norm, np.linalg.norm(p - e) / norm
        assert ours <= 1.5 * theirs + 2e-3, (
            f"{jax.tree_util.keystr(path)}: {ours:.2e} vs {theirs:.2e}"
        )


# Four stages (inner stages both receive and send) at m = 2p, where 1F1B reuses its depth-p
# buffers and circular's outputs wait at stage 0 for their next round, and for those two at
# m = p (nothing reused, nothing waits); m = 4p runs the same code with a longer scan (its
# schedule tables are checked above). Two stages at m = 2p are the NaN-bubble test's cases,
# every schedule. Then fewer microbatches than stages, and circular with v = 1.
MATRIX = [("gpipe", 4, 8, 1), ("1f1b", 4, 4, 1), ("1f1b", 4, 8, 1)]
MATRIX += [("circular", 4, 4, 2), ("circular", 4, 8, 2)]
MATRIX += [("gpipe", 2, 1, 1), ("circular", 2, 2, 1)]
# interleaved-1f1b needs m a multiple of p; zb-h1 takes any m ≥ p (see the test below).
MATRIX += [("interleaved-1f1b", 4, 8, 2), ("zb-h1", 4, 8, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,p,m,v", MATRIX)
@pytest.mark.pair("dp", "gpipe")
@pytest.mark.pair("dp", "circular")
@pytest.mark.pair("dp", "1f1b")
@pytest.mark.pair("dp", "interleaved-1f1b")
@pytest.mark.pair("dp", "zb-h1")
def test_pipe_x_data_matches_unpipelined(layouts, schedule, p, m, v):
    # dp: data is a replica axis, manual inside the loop, each replica its own rows
    env = layouts(f"pipe={p},data={8 // p}", strategy="dp")
    _assert_matches(
        env, _pipelined(env, PipelineConfig(schedule=schedule, microbatches=m, repeats=v))
    )


def test_zb_h1_with_microbatches_not_a_multiple_of_the_stages_matches_unpipelined():
    """zb-h1 (unlike interleaved-1f1b) runs any m ≥ p: 3 microbatches on 2 stages."""
    env = _setup("pipe=2,data=4", 8, strategy="dp", batch_size=24)
    _assert_matches(env, _pipelined(env, PipelineConfig(schedule="zb-h1", microbatches=3)))


# Pipe alone: one schedule per executor (the forward loop with its ring and repeats, the
# scheduled slots); every schedule runs on two stages in the NaN-bubble test below.
@pytest.mark.parametrize("schedule,v", [("circular", 2), ("1f1b", 1)])
def test_pipe_alone_matches_unpipelined(layouts, schedule, v):
    env = layouts("pipe=2", devices=2)
    _assert_matches(
        env, _pipelined(env, PipelineConfig(schedule=schedule, microbatches=4, repeats=v))
    )


# data a replica axis (dp+tp) under the forward loop's schedules, data splitting the weights
# (fsdp, tensor too) under the scheduled ones; each schedule meets the other kind of data axis
# in the tests above and below.
NAN_CASES = [
    ("gpipe", 1, "dp+tp"),
    ("circular", 2, "dp+tp"),
    ("1f1b", 1, "fsdp"),
    ("interleaved-1f1b", 2, "fsdp"),
    ("zb-h1", 1, "fsdp"),
]


@pytest.mark.parametrize("schedule,v,strategy", NAN_CASES)
@pytest.mark.pair("tp", "gpipe")
@pytest.mark.pair("tp", "circular")
@pytest.mark.pair("tp", "1f1b")
@pytest.mark.pair("tp", "interleaved-1f1b")
@pytest.mark.pair("tp", "zb-h1")
@pytest.mark.pair("fsdp", "interleaved-1f1b")
@pytest.mark.pair("fsdp", "zb-h1")
def test_nan_filled_bubbles_never_reach_the_result(layouts, schedule, v, strategy):
    """Idle slots and unused buffer entries hold NaN; on pipe × data × tensor the loss and all
    gradients stay finite and equal to the unpipelined ones."""
    env = layouts("pipe=2,data=2,tensor=2", strategy=strategy)
    config = PipelineConfig(schedule=schedule, microbatches=4, repeats=v)
    _assert_matches(env, _pipelined(env, config, poison=True))


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,remat,dtype,strategy",
    [
        ("1f1b", "full", "float32", "hsdp"),  # data replicas, fsdp-sharded stage weights
        ("1f1b", "save-dots", "bfloat16", "fsdp"),
        ("gpipe", "save-attention-out", "bfloat16", "fsdp"),
        # The split backward cuts through the rematerialised forward of each layer.
        ("zb-h1", "full", "float32", "hsdp"),
        ("interleaved-1f1b", "save-dots", "bfloat16", "hsdp"),
    ],
)
@pytest.mark.pair("hsdp", "1f1b")
@pytest.mark.pair("fsdp", "1f1b")
@pytest.mark.pair("fsdp", "gpipe")
@pytest.mark.pair("remat", "1f1b")
@pytest.mark.pair("remat", "gpipe")
@pytest.mark.pair("hsdp", "zb-h1")
@pytest.mark.pair("remat", "zb-h1")
@pytest.mark.pair("hsdp", "interleaved-1f1b")
@pytest.mark.pair("remat", "interleaved-1f1b")
@pytest.mark.pair("bf16", "interleaved-1f1b")
@pytest.mark.pair("bf16", "1f1b")
@pytest.mark.pair("bf16", "gpipe")
@pytest.mark.pair("remat", "hsdp")
@pytest.mark.pair("remat", "fsdp")
@pytest.mark.pair("bf16", "fsdp")
@pytest.mark.pair("remat", "bf16")
def test_remat_and_mixed_precision(layouts, schedule, remat, dtype, strategy):
    """The reference runs without remat (which only recomputes what it drops): one reference
    per strategy and dtype, shared by the cases and by the gather-once tests below."""
    plain = layouts(
        "pipe=2,data=2,fsdp=2", strategy=strategy, cfg=dataclasses.replace(CFG, dtype=dtype)
    )
    cfg = dataclasses.replace(CFG, remat=remat, dtype=dtype)
    env = plain | {"graphdef": nnx.split(nnx.eval_shape(lambda: build_model(cfg)))[0]}
    got = _pipelined(env, PipelineConfig(schedule=schedule, microbatches=4))
    _assert_matches(env, got, jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)


# --- stage weights gathered once per step ---------------------------------------------------


# 1f1b under the fsdp preset: the test after this one.
@pytest.mark.parametrize(
    "strategy,schedule,v",
    [
        ("hsdp", "gpipe", 1),
        ("fsdp", "zb-h1", 1),
        ("fsdp", "interleaved-1f1b", 2),
    ],
)
def test_gather_once_equals_the_unpipelined_math(layouts, strategy, schedule, v):
    """hsdp splits the stage weights over fsdp, the fsdp preset over data and fsdp: gathered
    whole before the loop and their gradients reduce-scattered after it, the loss and every
    gradient equal the plain GPT's."""
    env = layouts("pipe=2,data=2,fsdp=2", strategy=strategy)
    config = PipelineConfig(schedule=schedule, microbatches=4, repeats=v, gather_once=True)
    _assert_matches(env, _pipelined(env, config))


def _gathers(env, config):
    """(all-gather bytes outside any branch per step, all-gathers inside branches, the
    executable) of the compiled pipelined step."""
    mesh, rules = env["mesh"], env["rules"]

    def run(params, batch):
        with activation_rules(mesh, rules):
            return pipeline_loss_and_grads(
                env["graphdef"], params, env["state"].rest, batch, config=config, mesh=mesh,
                loss_fn=cross_entropy,
            )  # fmt: skip

    compiled = jax.jit(run).lower(env["state"].params, env["batch"]).compile()
    gathers = [c for c in collectives(compiled.as_text()) if c.kind == "all-gather"]
    once = sum(c.count * c.result_bytes for c in gathers if not c.conditional)
    return once, sum(1 for c in gathers if c.conditional), compiled


@pytest.mark.slow
def test_gather_once_moves_the_gathers_out_of_the_loop_whatever_the_microbatches(layouts):
    """Without gather_once, 1f1b gathers the fsdp-split stage weights (over data and fsdp)
    inside its slots' branches (once per pass); with it, nothing is gathered inside them, the
    bytes gathered per step are the same at m = 2 and m = 4, and the step's loss and every
    gradient equal the plain GPT's."""
    env = layouts("pipe=2,data=2,fsdp=2", strategy="fsdp")
    _, inside, _ = _gathers(env, PipelineConfig(schedule="1f1b", microbatches=2))
    assert inside > 0
    per_m = []
    for m in (2, 4):
        once, inside, compiled = _gathers(
            env, PipelineConfig(schedule="1f1b", microbatches=m, gather_once=True)
        )
        assert inside == 0
        per_m.append(once)
    assert per_m[0] == per_m[1] > 0
    _assert_matches(env, compiled(env["state"].params, env["batch"]))


# --- the trainer ---------------------------------------------------------------------------


def _lm_arrays(n=64, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (n, T + 1))
    return make_arrays_dataset(
        tokens[:, :-1], tokens[:, 1:], batch_size=B, seed=seed, vocab_size=CFG.vocab_size
    )


def _fit(mesh_spec, pipeline=None, steps=2, devices=8):
    mesh = make_mesh(mesh_spec, devices=jax.devices()[:devices])
    run = RunSpec(
        model=CFG,
        data=_lm_arrays(),
        mesh=mesh,
        rules=rules_for("fsdp", mesh),
        pipeline=pipeline or PipelineConfig(),
        train=TrainConfig(steps=steps, eval_every=0, log_every=1, run_dir="", progress=False),
    )
    trainer = Trainer(run=run)
    return [e["loss"] for e in trainer.fit()], trainer


@pytest.mark.slow
def test_trainer_losses_match_unpipelined_step_for_step():
    """Under the circular schedule stage s holds chunks s and p + s of the layers (one per
    round); the Trainer with 1f1b is the Pallas Trainer test below."""
    plain, _ = _fit("data=1", devices=1)
    piped, trainer = _fit(
        "pipe=2,data=2,fsdp=2", PipelineConfig(schedule="circular", microbatches=4, repeats=2)
    )
    np.testing.assert_allclose(piped, plain, rtol=2e-5)
    layer_spec = trainer.shardings.params["blocks"]["mlp"]["up"]["kernel"].spec
    assert layer_spec[0] == "pipe"  # each stage holds only its own layers


# --- the Pallas kernels inside stages ------------------------------------------------------

# Two heads of width 64 (the kernels' head width), one key/value head (kept whole under
# tensor parallelism, so each shard picks it), 72 positions: two 64-row attention blocks,
# the second padded.
KERNELS = GPTConfig(
    d_model=128, n_layers=4, n_heads=2, n_kv_heads=1, max_seq_len=72, vocab_size=64,
    attention_impl="pallas", norm_impl="pallas",
)  # fmt: skip
KB, KT = 16, 72
# Plain SGD, as the composition cover trains: an update linear in the gradient.
SGD = OptimConfig(
    optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=0.0, clip_norm=0.0, warmup_steps=0
)


def _kernel_batch(seed):
    rng = np.random.default_rng(seed)
    return {
        k: jnp.asarray(rng.integers(0, KERNELS.vocab_size, (KB, KT)), jnp.int32)
        for k in ("inputs", "targets")
    }


# hsdp under the forward loop (gpipe) and the scheduled slots (interleaved, two chunks per
# stage), fsdp+tp under circular, dp under 1f1b (the Pallas Trainer test below too). zb-h1's
# split backward cutting around the kernels' calls (each goes whole into the pass that needs
# it) is tests/test_composition_cover.py's: its pallas zb-h1 cases equal one device.
KERNEL_CASES = [
    ("gpipe", 1, "pipe=2,data=2,fsdp=2", "hsdp"),
    ("circular", 2, "pipe=2,fsdp=2,tensor=2", "fsdp+tp"),
    ("1f1b", 1, "pipe=2,data=4", "dp"),
    ("interleaved-1f1b", 2, "pipe=2,data=2,fsdp=2", "hsdp"),
]


@pytest.mark.parametrize("schedule,v,spec,strategy", KERNEL_CASES)
@pytest.mark.pair("pallas", "interleaved-1f1b")
@pytest.mark.pair("pallas", "gpipe")
@pytest.mark.pair("pallas", "circular")
@pytest.mark.pair("pallas", "1f1b")
@pytest.mark.pair("dp", "pallas")
@pytest.mark.pair("fsdp", "pallas")
@pytest.mark.pair("hsdp", "pallas")
@pytest.mark.pair("tp", "pallas")
@pytest.mark.pair("dp", "1f1b")
@pytest.mark.pair("fsdp", "circular")
@pytest.mark.pair("hsdp", "gpipe")
@pytest.mark.pair("hsdp", "interleaved-1f1b")
@pytest.mark.pair("tp", "circular")
@pytest.mark.pair("fsdp", "tp")
def test_pallas_kernels_inside_stages_match_the_plain_math(schedule, v, spec, strategy):
    """Pallas attention, norms and (as the loss) cross-entropy run inside every stage; the
    loss and every gradient equal the unpipelined jnp model's on one device."""
    mesh = make_mesh(spec)
    rules = rules_for(strategy, mesh)
    # 1f1b on fsdp+tp with a key/value head that tensor does not divide hangs with the jnp
    # attention too (a resharding collective inside a slot only some stages run: a known
    # limit, see the Pipelines guide); there the stages run two key/value heads.
    cfg = dataclasses.replace(KERNELS, n_kv_heads=2) if strategy == "fsdp+tp" else KERNELS
    plain = dataclasses.replace(cfg, attention_impl="xla", norm_impl="xla")
    values = initial_values(plain)
    graphdef, state, _ = init_train_state(
        lambda: build_model(cfg), optax.sgd(0.1), mesh, rules, params=values
    )
    batch = _kernel_batch(abs(hash((spec, schedule))) % 2**32)
    ref = _reference(plain)(values, batch)
    env = dict(mesh=mesh, rules=rules, graphdef=graphdef, state=state, batch=batch, ref=ref)
    config = PipelineConfig(schedule=schedule, microbatches=4, repeats=v)

    @jax.jit
    def run(params, batch):
        with activation_rules(mesh, rules):
            return pipeline_loss_and_grads(
                graphdef, params, state.rest, batch, config=config, mesh=mesh,
                loss_fn=cross_entropy_with("pallas"),
            )  # fmt: skip

    _assert_matches(env, run(state.params, batch))


@pytest.mark.pair("pallas", "1f1b")
@pytest.mark.pair("tp", "1f1b")
@pytest.mark.pair("dp", "1f1b")
@pytest.mark.pair("dp", "pallas")
@pytest.mark.pair("tp", "pallas")
@pytest.mark.pair("dp", "tp")
def test_trainer_with_pallas_kernels_on_pipe_data_tensor_equals_one_device():
    """A GPT trained 2 steps (an update, and a loss after it) with the Pallas kernels on
    pipe=2,data=2,tensor=2 (1f1b) takes the losses of the jnp GPT trained on one device, and
    ends with its parameters."""

    def fit(cfg, mesh_spec, devices, pipeline, strategy):
        mesh = make_mesh(mesh_spec, devices=jax.devices()[:devices])
        tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, (4 * KB, KT + 1))
        data = make_arrays_dataset(
            tokens[:, :-1], tokens[:, 1:], batch_size=KB, seed=0, vocab_size=cfg.vocab_size
        )
        trainer = Trainer(run=RunSpec(
            model=cfg, data=data, mesh=mesh, rules=rules_for(strategy, mesh),
            pipeline=pipeline or PipelineConfig(),
            train=TrainConfig(
                steps=2, eval_every=0, log_every=1, run_dir="", progress=False,
                loss_impl="pallas" if pipeline else "xla",
            ),
            optim=SGD,
        ))  # fmt: skip
        start = jax.device_get(trainer.state.params)
        return [e["loss"] for e in trainer.fit()], jax.device_get(trainer.state.params), start

    plain = dataclasses.replace(KERNELS, attention_impl="xla", norm_impl="xla")
    want, want_params, start = fit(plain, "data=1", 1, None, "dp")
    got, got_params, _ = fit(
        KERNELS,
        "pipe=2,data=2,tensor=2",
        8,
        PipelineConfig(schedule="1f1b", microbatches=4),
        "dp+tp",
    )
    np.testing.assert_allclose(got, want, rtol=2e-5)
    for (path, w), g in zip(
        jax.tree_util.tree_leaves_with_path(want_params), jax.tree.leaves(got_params), strict=True
    ):
        # Plain SGD: the parameters differ by lr × the gradients' difference. (Under Adam, which
        # normalises each update, an entry whose gradient is near zero could move by a whole
        # step either way on another summation order.)
        np.testing.assert_allclose(g, w, rtol=0, atol=5e-5, err_msg=jax.tree_util.keystr(path))
    moved = max(float(np.abs(w - s).max()) for w, s in zip(
        jax.tree.leaves(want_params), jax.tree.leaves(start), strict=True))  # fmt: skip
    assert moved > 20 * 5e-5  # it trained: the comparison is not of two idle runs


# --- errors before compiling ---------------------------------------------------------------


@pytest.mark.parametrize(
    "config,kw,match",
    [
        (PipelineConfig(), dict(layers=6, pipe=4), r"layers=6: .* pipe × repeats = 4"),
        (
            PipelineConfig(schedule="circular", repeats=2),
            dict(layers=4, pipe=4),
            r"pipe × repeats = 4 × 2 = 8",
        ),
        (
            PipelineConfig(schedule="1f1b", microbatches=2),
            dict(pipe=4),
            r"microbatches=2: fewer than pipe=4.*--microbatches 4",
        ),
        (PipelineConfig(microbatches=3), dict(batch_size=32), r"batch_size=32: .*microbatches=3"),
        (
            PipelineConfig(microbatches=8),
            dict(batch_size=32, batch_ways=8),
            r"4 rows per microbatch, not divisible by data × fsdp = 8",
        ),
        (PipelineConfig(schedule="gpipe", repeats=2), dict(), r"repeats=2: .*only the circular"),
        (
            PipelineConfig(schedule="circular", repeats=2, microbatches=1),
            dict(),
            r"microbatches=1: fewer than pipe=2",
        ),
        (
            PipelineConfig(schedule="zb-h1", microbatches=2),
            dict(pipe=4),
            r"microbatches=2: fewer than pipe=4.*--microbatches 4",
        ),
        (
            PipelineConfig(schedule="interleaved-1f1b", repeats=2, microbatches=6),
            dict(pipe=4, layers=16),
            r"microbatches=6: not a multiple of pipe=4.*--microbatches 8",
        ),
        (
            PipelineConfig(schedule="interleaved-1f1b", repeats=3),
            dict(layers=8, pipe=2),
            r"pipe × repeats = 2 × 3 = 6",
        ),
        (PipelineConfig(schedule="zb-h1", repeats=2), dict(), r"repeats=2: "),
        (  # the batch the user gave, and a multiple that splits, beside accumulation
            PipelineConfig(microbatches=4),
            dict(batch_size=8, batch_ways=4, accum_steps=2),
            r"batch_size=16: / accum_steps=2 = 8 rows per accumulation step, / microbatches=4 "
            r"= 2 rows per microbatch, .* = 4 devices; use a batch that is a multiple of 32",
        ),
        (
            PipelineConfig(microbatches=3),
            dict(batch_size=8, accum_steps=2),
            r"batch_size=16: / accum_steps=2 = 8 rows per accumulation step, not divisible by "
            r"microbatches=3; use a batch that is a multiple of 6",
        ),
    ],
)
def test_bad_pipelines_are_rejected_with_the_fix(config, kw, match):
    args = dict(layers=8, pipe=2, batch_size=32, batch_ways=1) | kw
    problems = "\n".join(map(str, pipeline_problems(config, **args)))
    assert re.search(match, problems), problems


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match=r"schedule='zb'.*gpipe, circular, 1f1b"):
        PipelineConfig(schedule="zb")
    with pytest.raises(ValueError, match="microbatches=-1"):
        PipelineConfig(microbatches=-1)


def test_trainer_rejects_a_bad_pipeline_before_compiling():
    from _helpers import count_compiles

    mesh = make_mesh("pipe=4,data=2")
    with count_compiles() as compiles, pytest.raises(ValueError, match="layers=8: .* = 12"):
        Trainer(
            run=RunSpec(
                model=CFG,
                data=_lm_arrays(),
                mesh=mesh,
                rules=rules_for("fsdp", mesh),
                pipeline=PipelineConfig(schedule="circular", repeats=3, microbatches=4),
                train=TrainConfig(steps=1, run_dir="", progress=False),
            )
        )
    assert compiles == []
