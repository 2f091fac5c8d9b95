"""The mixture of experts under context parallelism: on ``seq=2,expert=2,data=2`` an MoE
(capacity dispatch with tokens dropped, and dropless with Mixtral's router losses) trains 3
steps equal to one device: the total loss (router losses included), every ``moe_*`` metric
and every parameter. The tokens run in the zig-zag order; the router ranks them in their own
order, so capacity drops the same choices.

Inputs are fresh random tokens from a seeded generator; everything is float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cp_helpers import assert_split
from _helpers import initial_values, state_and_step, token_batches
from flax import nnx

from meshtrain import context_parallel as cp
from meshtrain.check import check_run
from meshtrain.layout import activation_rules, rules_for, shard_batch
from meshtrain.lower import make_optimizer
from meshtrain.mesh import make_mesh
from meshtrain.models import DataSpec, MoEConfig, build_model
from meshtrain.run import RunSpec
from meshtrain.train import OptimConfig

T, B, STEPS = 16, 8, 3
TX = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 10)
# capacity_factor 1: each expert holds T·k/E choices per sequence, so some drop and which
# ones depends on the order the slots are given in.
MOE = dict(
    d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, moe_every=1, n_experts=4, top_k=2,
    d_expert=32, vocab_size=64, vocab_multiple=16, max_seq_len=T, aux_loss_coef=0.1,
    z_loss_coef=0.01,
)  # fmt: skip
CONFIGS = {
    "capacity": MoEConfig(**MOE, dispatch="capacity", capacity_factor=1.0),
    # with transformers' Mixtral load-balancing loss, pooled over the blocks and reduced over
    # the rows of every shard (capacity's run has the default router losses)
    "dropless": MoEConfig(**MOE, dispatch="dropless", router_losses="mixtral"),
}


def _batches(cfg):
    return token_batches(STEPS, cfg.vocab_size, B, T, seed=len(cfg.dispatch))


def _train(cfg, mesh_str, values, devices=None):
    """STEPS steps from `values`: per step the metrics, and the final parameters."""
    mesh = make_mesh(mesh_str, devices=devices)
    rules = rules_for("dp", mesh)
    # `values` moved into the layout (no initialiser program is compiled)
    data = _batches(cfg)
    _, state, _, step = state_and_step(lambda: build_model(cfg), TX, mesh, rules, data[0], values)
    assert_split(step, state, shard_batch(data[0], mesh, rules), mesh, rules)
    metrics = []
    for batch in data:
        state, m = step(state, shard_batch(batch, mesh, rules))
        metrics.append({k: float(v) for k, v in m.items()})
    return metrics, jax.tree.map(np.asarray, state.params), state


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("capacity", marks=[pytest.mark.pair("moe-capacity", "ring")]),
        pytest.param("dropless", marks=[pytest.mark.pair("moe-dropless", "ring")]),
    ],
)
def test_moe_on_seq2_expert2_data2_equals_one_device(kind):
    cfg = CONFIGS[kind]
    values = initial_values(cfg)
    got, params, state = _train(cfg, "seq=2,expert=2,data=2", values)
    want, params_1, _ = _train(cfg, "data=1", values, devices=jax.devices()[:1])
    names = ["loss", "task_loss"] + [k for k in want[0] if k.startswith("moe_")]
    assert len(names) == 8  # aux and z losses, tokens per expert (min, mean, max), drops
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for name in names:
            np.testing.assert_allclose(g[name], w[name], rtol=0, atol=1e-5, err_msg=(step, name))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_1), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-5)
    assert not np.allclose(got[0]["loss"], got[-1]["loss"])  # it trained
    dropped = [m["moe_dropped_fraction"] for m in want]
    assert (min(dropped) > 0) if kind == "capacity" else (max(dropped) == 0)
    gate = state.params["groups"]["moe_block"]["moe"]["gate"]
    assert gate.sharding.shard_shape(gate.shape)[1] == cfg.n_experts // 2  # split over expert


def test_the_moe_runs_the_tokens_in_the_balanced_order_under_seq():
    """`embed_tokens` puts the tokens in the zig-zag order under seq > 1 and `head_logits`
    restores theirs (the logits equal the plain forward's); the run check takes seq > 1."""
    cfg = CONFIGS["capacity"]
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))
    nnx.replace_by_pure_dict(state, initial_values(cfg))
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 64, (B, T)), jnp.int32)
    mesh = make_mesh("seq=2,expert=2,data=2")

    @jax.jit
    def run(state, tokens):  # one program: the plain path, and the split one under the mesh
        model = nnx.merge(graphdef, state)
        want = model.embed(tokens)
        with activation_rules(mesh, rules_for("dp", mesh)):
            x = model.embed_tokens(tokens)
            back = model.head_logits(x)
        return want, x, back, model.head_logits(want)

    with jax.set_mesh(mesh):
        want, x, back, plain = run(state, tokens)
    np.testing.assert_array_equal(x, np.asarray(want)[:, cp.order(T, 2)])
    np.testing.assert_allclose(back, plain, rtol=0, atol=1e-6)
    sizes = dict(pipe=1, data=2, fsdp=1, expert=2, seq=2, tensor=1)
    data = DataSpec("lm", B, T, 64)
    assert check_run(RunSpec(model=cfg, data=data, mesh=sizes, rules=rules_for("dp", sizes))) == []
