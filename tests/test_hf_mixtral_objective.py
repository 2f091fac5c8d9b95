"""An imported Mixtral trains with ``MixtralForCausalLM``'s objective: its pooled load-balancing
loss equals transformers' ``load_balancing_loss_func`` on the same router logits, and three
AdamW steps of a tiny Mixtral with ``output_router_logits=True`` equal three torch AdamW steps
of transformers' (`scripts/make_hf_mixtral_steps.py` made the reference: the losses of each step
and the parameters after); the defaults and overrides of the objective, and the field's check;
the run check lets an imported Mixtral train on its own loss under every hand-scheduled
pipeline schedule.
"""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtrain.check import check_run
from meshtrain.hf.mixtral import config_from_hf, config_to_hf, load_mixtral, save_mixtral
from meshtrain.layout import rules_for
from meshtrain.models import DataSpec, MoEConfig
from meshtrain.models.moe_routing import pooled_load_balance_loss, route, router_sums
from meshtrain.optim import OptimConfig, make_optimizer
from meshtrain.pipeline import PipelineConfig
from meshtrain.run import RunSpec, TrainConfig
from meshtrain.state import TrainState
from meshtrain.train.step import train_step

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
# What scripts/make_hf_mixtral_steps.py trains with: AdamW, no clipping, no schedule.
ADAMW = OptimConfig(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, warmup_steps=0,
                    min_lr_ratio=1.0, clip_norm=0.0)  # fmt: skip
# Measured: losses within 1.2e-7 relative, parameters within 3.7e-6. meshtrain's own router
# losses instead, or its z-loss left at 0.001, or no router loss, move the losses by ≥ 9e-4
# relative and some parameter by ≥ 3e-3.
LOSS_RTOL = 1e-5
PARAM_ATOL = 5e-5  # 5% of one AdamW step (lr 1e-3), as tests/test_train_step.py


@pytest.fixture(scope="module")
def steps():
    return np.load(FIXTURES / "mixtral_steps.npz")


def test_pooled_load_balancing_loss_equals_transformers_on_the_same_router_logits(steps):
    logits_LNE = steps["router_logits"]  # [layers, B·T rows, E], transformers' routers
    L, _, E = logits_LNE.shape
    B, T = steps["mask"].shape[1:]
    mask_BT = jnp.asarray(steps["mask"][0] > 0)
    assert not mask_BT.all()  # padding, which the loss leaves out
    totals = None
    for logits_NE in logits_LNE:
        logits_BTE = jnp.asarray(logits_NE.reshape(B, T, E))
        routing = route(logits_BTE, 2, renormalize=True, capacity_slots=None)
        sums = router_sums(logits_BTE, routing.expert_BTK, mask_BT)
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    assert float(totals["router_tokens"]) == L * int(mask_BT.sum())
    got = pooled_load_balance_loss(
        totals["router_choices"], totals["router_probs"], totals["router_tokens"]
    )
    np.testing.assert_allclose(got, steps["load_balancing_loss"], rtol=1e-6)


def _batch(steps, s: int) -> dict:
    """Step `s`'s batch as meshtrain takes it: the attention mask as segment ids, the ignored
    targets (-100) as any id (the loss leaves them out)."""
    mask = steps["mask"][s]
    return {
        "inputs": steps["inputs"][s],
        "targets": np.maximum(steps["targets"][s], 0),
        "segment_ids": mask,
        "positions": np.broadcast_to(np.arange(mask.shape[1], dtype=np.int32), mask.shape),
    }


def _params(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_three_adamw_steps_equal_transformers_with_its_router_loss(steps):
    model = load_mixtral(FIXTURES / "mixtral_steps")
    cfg = model.cfg
    assert (cfg.router_losses, cfg.aux_loss_coef, cfg.z_loss_coef) == ("mixtral", 0.1, 0.0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    tx = make_optimizer(ADAMW, len(steps["loss"]))
    state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), rest)
    step = jax.jit(lambda st, b: train_step(graphdef, tx, st, b))
    for s, (want, want_aux) in enumerate(zip(steps["loss"], steps["aux_loss"], strict=True)):
        state, metrics = step(state, _batch(steps, s))
        np.testing.assert_allclose(metrics["moe_aux_loss"], want_aux, rtol=LOSS_RTOL)
        np.testing.assert_allclose(metrics["loss"], want, rtol=LOSS_RTOL, err_msg=f"step {s}")
        assert float(metrics["loss"] - metrics["task_loss"]) > 0.1  # the router loss is in it
    trained = _params(load_mixtral(FIXTURES / "mixtral_steps_trained"))
    start = _params(model)
    for (path, got), want, was in zip(
        jax.tree_util.tree_leaves_with_path(state.params),
        jax.tree.leaves(trained),
        jax.tree.leaves(start),
        strict=True,
    ):
        where = jax.tree_util.keystr(path)
        assert np.abs(np.asarray(want) - np.asarray(was)).max() > 1e-3, where  # it moved
        np.testing.assert_allclose(got, want, rtol=0, atol=PARAM_ATOL, err_msg=where)


def _hf(**changes) -> dict:
    hf = json.loads((FIXTURES / "mixtral_steps" / "config.json").read_text())
    return {k: v for k, v in (hf | changes).items() if v is not None}


@pytest.mark.parametrize(
    ("changes", "aux"),
    [
        ({}, 0.1),  # output_router_logits: the loss transformers trains with
        ({"output_router_logits": False}, 0.0),  # no router loss in transformers' loss
        ({"output_router_logits": None, "router_aux_loss_coef": None}, 0.0),  # absent
    ],
)
def test_config_from_hf_takes_mixtrals_objective(changes, aux):
    cfg = config_from_hf(_hf(**changes))
    assert (cfg.router_losses, cfg.aux_loss_coef, cfg.z_loss_coef) == ("mixtral", aux, 0.0)
    assert "mixtral losses" in cfg.describe()
    back = config_to_hf(cfg)
    assert (back["router_aux_loss_coef"], back["output_router_logits"]) == (aux, aux > 0)
    assert config_from_hf(back) == cfg


def test_load_mixtral_objective_override_and_export(tmp_path):
    own = {"router_losses": "meshtrain", "aux_loss_coef": 0.01, "z_loss_coef": 0.001}
    model = load_mixtral(FIXTURES / "mixtral_steps", objective=own)
    assert dataclasses.replace(model.cfg, **own) == model.cfg
    assert "losses" not in model.cfg.describe()  # meshtrain's: the default, not shown
    with pytest.raises(ValueError, match="dispatch is not a field of the training objective"):
        load_mixtral(FIXTURES / "mixtral_steps", objective={"dispatch": "capacity"})
    with pytest.raises(ValueError, match=r"moe.aux_loss_coef=-1.0: must be"):
        load_mixtral(FIXTURES / "mixtral_steps", objective={"aux_loss_coef": -1.0})
    off = load_mixtral(FIXTURES / "mixtral_steps", objective={"aux_loss_coef": 0.0})
    hf = json.loads((save_mixtral(off, tmp_path / "off") / "config.json").read_text())
    assert (hf["router_aux_loss_coef"], hf["output_router_logits"]) == (0.0, False)


def test_router_losses_must_name_a_definition():
    with pytest.raises(ValueError) as e:
        MoEConfig(router_losses="switch")
    assert str(e.value) == (
        "moe.router_losses='switch': choose from meshtrain, mixtral (meshtrain: per MoE block; "
        "mixtral: pooled over the blocks, as transformers'); e.g. --moe.router-losses mixtral"
    )


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-h1"])
def test_an_imported_mixtral_runs_its_own_loss_under_every_hand_scheduled_schedule(schedule):
    # Its pooled router loss is exact under them (tests/test_moe_pipeline.py): nothing refuses.
    cfg = load_mixtral(FIXTURES / "mixtral_steps").cfg
    cfg = dataclasses.replace(cfg, n_layers=4)  # whole layers for 2 stages × 2 chunks
    assert cfg.router_losses == "mixtral" and cfg.aux_loss_coef > 0
    sizes = {"pipe": 2, "data": 4}
    pipeline = PipelineConfig(schedule=schedule, repeats=2 if "interleaved" in schedule else 1)
    run = RunSpec(model=cfg, data=DataSpec("lm", 16, 16, cfg.vocab_size), mesh=sizes,
                  rules=rules_for("dp", sizes), pipeline=pipeline,
                  train=TrainConfig(run_dir=""))  # fmt: skip
    assert check_run(run) == []
