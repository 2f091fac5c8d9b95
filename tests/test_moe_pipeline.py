"""A mixture of experts in a pipeline: three training steps on ``pipe=2,expert=2,data=2``
under gpipe with capacity dispatch and 1f1b with dropless dispatch equal the single-device
steps with ``accum_steps`` = the pipeline's microbatch count (the router's losses are each
microbatch's, averaged, as accumulation computes them): the losses, the task loss, every
``moe_*`` metric and every parameter. The expert weights stay split over ``expert`` inside
each stage.

Tolerances: tests/test_pipeline.py's for fp32 (1e-5 relative on losses and metrics, 2e-5 of
each parameter's largest entry).
"""

import dataclasses

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
from meshtrain.models import MoEConfig
from meshtrain.pipeline import PipelineConfig
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
