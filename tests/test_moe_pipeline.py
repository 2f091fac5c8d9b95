"""A mixture of experts in a pipeline: three training steps on ``pipe=2,expert=2,data=2``
under gpipe with capacity dispatch and 1f1b with dropless dispatch equal the single-device
steps with ``accum_steps`` = the pipeline's microbatch count (the router's losses are each
microbatch's, averaged, as accumulation computes them): the losses, the task loss, every
``moe_*`` metric and every parameter. The expert weights stay split over ``expert`` inside
each stage.

Mixtral's router loss (pooled over every block and the whole batch) under 1f1b,
interleaved-1f1b and zb-h1: one step equals one unpipelined step on the whole batch, as under
gpipe and circular (tests/test_moe.py); only a loss not linear in the statistics makes the
hand-scheduled step run its forward first.

Tolerances: tests/test_pipeline.py's for fp32 (1e-5 relative on losses and metrics, 2e-5 of
each parameter's largest entry).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _pipeline_helpers import LOSS_RTOL, assert_close, random_params
from flax import nnx

from meshtrain.layout import batch_shardings, rules_for, shard_batch
from meshtrain.lower import init_train_state, jit_train_step
from meshtrain.mesh import make_mesh
from meshtrain.models import MoEConfig, build_model
from meshtrain.pipeline import PipelineConfig
from meshtrain.pipeline.hand_scheduled import _gradient_varies
from meshtrain.run import RunSpec, TrainConfig
from meshtrain.state import TrainState
from meshtrain.train.step import train_step

B, T, M, STEPS = 16, 8, 4, 3
TX = optax.sgd(0.5)
# Two MoE blocks, one per stage, four experts, two per expert shard. The capacity factor drops
# some choices, so the drop statistics are live.
CFG = MoEConfig(d_model=32, n_layers=2, moe_every=1, n_heads=2, n_experts=4, top_k=2,
                d_expert=16, vocab_size=64, vocab_multiple=16, max_seq_len=T,
                capacity_factor=1.0, aux_loss_coef=0.1, z_loss_coef=0.01)  # fmt: skip


@pytest.fixture(scope="module")
def one_device():
    """Per dispatch kind (built once): the random parameters, the batches, and the
    single-device steps' metrics and final parameters."""
    cache = {}

    def get(dispatch):
        if dispatch in cache:
            return cache[dispatch]
        cfg = dataclasses.replace(CFG, dispatch=dispatch)
        graphdef, params = random_params(cfg, seed=5)
        rng = np.random.default_rng(23)
        batches = []
        for _ in range(STEPS):
            tokens = rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
            batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
        state = TrainState(jnp.zeros((), jnp.int32), params, TX.init(params), {})
        run = RunSpec(train=TrainConfig(accum_steps=M))
        plain = jax.jit(lambda st, b: train_step(graphdef, TX, st, b, run=run))
        want = []
        for batch in batches:
            state, metrics = plain(state, batch)
            want.append(jax.tree.map(float, metrics))
        want_params = jax.tree.map(np.asarray, state.params)
        cache[dispatch] = (graphdef, params, batches, want, want_params)
        return cache[dispatch]

    return get


# Each schedule with one dispatch kind: 1f1b with capacity is tests/test_pipeline_packed.py's
# NaN-bubble test, gpipe with dropless tests/test_moe.py's Mixtral router loss test.
@pytest.mark.parametrize(
    "schedule,dispatch",
    [
        pytest.param(s, d, marks=pytest.mark.pair(f"moe-{d}", s))
        for s, d in (("gpipe", "capacity"), ("1f1b", "dropless"))
    ],
)  # fmt: skip
def test_moe_pipeline_steps_equal_one_device_with_accumulation(one_device, schedule, dispatch):
    graphdef, params, batches, want, want_params = one_device(dispatch)
    assert {"task_loss", "moe_aux_loss", "moe_z_loss", "moe_dropped_fraction"} <= set(want[0])
    assert want[0]["loss"] > want[0]["task_loss"]  # the router losses are in the loss
    if dispatch == "capacity":
        assert any(w["moe_dropped_fraction"] > 0 for w in want)

    mesh = make_mesh("pipe=2,expert=2,data=2")
    rules = rules_for("dp", mesh)
    pipeline = PipelineConfig(schedule=schedule, microbatches=M)
    model = nnx.merge(graphdef, params)
    graphdef, sharded, shardings = init_train_state(lambda: model, TX, mesh, rules)
    gate = shardings.params["groups"]["moe_block"]["moe"]["gate"].spec
    assert tuple(gate[:2]) == ("pipe", "expert")  # stages hold their layers, shards experts
    shard = batch_shardings(batches[0], mesh, rules)
    step = jit_train_step(RunSpec(mesh=mesh, rules=rules, pipeline=pipeline), graphdef, TX,
                          shardings, shard)  # fmt: skip
    for i, batch in enumerate(batches):
        sharded, metrics = step(sharded, shard_batch(batch, mesh, rules))
        assert set(metrics) == set(want[i])  # task_loss and every moe_* metric come out
        for k, w in want[i].items():
            np.testing.assert_allclose(float(metrics[k]), w, rtol=LOSS_RTOL, err_msg=f"{i} {k}")
    assert_close(jax.tree.map(np.asarray, sharded.params), want_params, f"{schedule} {dispatch}")


# Mixtral's router loss pools every block's statistics over the whole batch before a product,
# so it is not each microbatch's: one hand-scheduled step equals one unpipelined step on the
# whole batch (no accumulation), as gpipe and circular do (tests/test_moe.py). Four MoE blocks
# (two per stage; one per chunk under interleaved-1f1b), four experts (two per expert shard),
# padding in the first microbatch only, so the pooled token count differs between them.
MIXTRAL = MoEConfig(d_model=32, n_layers=4, n_heads=2, n_experts=4, top_k=2, d_expert=16,
                    vocab_size=64, vocab_multiple=16, max_seq_len=T, dispatch="dropless",
                    router_losses="mixtral", aux_loss_coef=0.5, z_loss_coef=0.0)  # fmt: skip
MIXTRAL_B = 8


@functools.cache
def _mixtral_unpipelined():
    """Random parameters, a padded batch and one plain SGD step on it without a pipeline:
    ``(graphdef, params, batch, state after, metrics)``."""
    graphdef, params = random_params(MIXTRAL, seed=3)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, MIXTRAL.vocab_size, (MIXTRAL_B, T + 1)).astype(np.int32)
    seg = np.ones((MIXTRAL_B, T), np.int32)
    seg[:2, T // 2 :] = 0  # padding in the first microbatch only
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (MIXTRAL_B, T))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
             "positions": positions}  # fmt: skip
    state = TrainState(jnp.zeros((), jnp.int32), params, TX.init(params), {})
    want_state, want = jax.jit(lambda st, b: train_step(graphdef, TX, st, b))(state, batch)
    return graphdef, params, batch, want_state, jax.tree.map(float, want)


@pytest.mark.parametrize(
    "pipeline",
    [
        pytest.param(PipelineConfig(schedule="1f1b", microbatches=2),
                     marks=pytest.mark.pair("1f1b", "moe-dropless"), id="1f1b"),
        pytest.param(PipelineConfig(schedule="interleaved-1f1b", repeats=2, microbatches=2),
                     marks=pytest.mark.pair("interleaved-1f1b", "moe-dropless"),
                     id="interleaved-1f1b"),
        pytest.param(PipelineConfig(schedule="zb-h1", microbatches=2),
                     marks=pytest.mark.pair("zb-h1", "moe-dropless"), id="zb-h1"),
    ],
)  # fmt: skip
def test_mixtral_router_loss_under_hand_scheduled_pipelines_equals_the_unpipelined_step(pipeline):
    graphdef, params, batch, want_state, want = _mixtral_unpipelined()
    assert want["loss"] - want["task_loss"] > 0.5  # the router loss is in it, and weighs

    mesh = make_mesh("pipe=2,expert=2,data=2")
    rules = rules_for("dp", mesh)
    host = jax.tree.map(np.asarray, params)  # the step donates its state: no aliasing
    graphdef, sharded, shardings = init_train_state(lambda: build_model(MIXTRAL), TX, mesh,
                                                    rules, host)  # fmt: skip
    shard = batch_shardings(batch, mesh, rules)
    step = jit_train_step(RunSpec(mesh=mesh, rules=rules, pipeline=pipeline), graphdef, TX,
                          shardings, shard)  # fmt: skip
    sharded, got = step(sharded, shard_batch(batch, mesh, rules))
    # One loss over the whole batch's real tokens in every block, as one unpipelined step.
    for k in ("loss", "task_loss", "moe_aux_loss"):
        np.testing.assert_allclose(float(got[k]), want[k], rtol=LOSS_RTOL, err_msg=k)
    assert_close(jax.tree.map(np.asarray, sharded.params), want_state.params, pipeline.schedule)


@pytest.mark.parametrize(
    ("router_losses", "aux_loss_coef", "varies"),
    [("meshtrain", 0.1, False), ("mixtral", 0.1, True), ("mixtral", 0.0, False)],
)
def test_only_a_loss_not_linear_in_the_statistics_takes_the_forward_first(
    router_losses, aux_loss_coef, varies
):
    # meshtrain's router losses are linear in the statistics: their gradient is the same
    # everywhere and the hand-scheduled step runs no forward before its schedule. Mixtral's
    # pooled loss is not, unless weighted 0: its gradient is taken at the step's statistics.
    cfg = dataclasses.replace(CFG, router_losses=router_losses, aux_loss_coef=aux_loss_coef)
    model = build_model(cfg)
    parts = model.pipeline_parts()
    _, stats = jax.eval_shape(parts.run_blocks, model.groups, jnp.zeros((1, T, CFG.d_model)))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stats)
    assert _gradient_varies(lambda s: parts.stats(s)[0], zeros) is varies
