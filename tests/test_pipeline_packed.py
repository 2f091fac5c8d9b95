"""Packed documents through the pipeline's executors: three training steps on ``pipe=2,data=4``
under gpipe and circular equal the single-device steps (losses and every parameter); an MoE's
packed batch through 1F1B with NaN-filled bubbles on ``pipe=2,expert=2,data=2`` equals the
one-device loss and gradients; pipeline parts that take no packed batches are refused before
compiling.

The batches come from the packer's own row cutter over a random stream of documents, some
longer than a row (so they continue in the next row) and some rows padded at the end, so the
microbatches hold different numbers of real tokens: their loss must be the sum over real tokens
divided by the count of the whole batch's, not a mean of microbatch means. Tolerances are
tests/test_pipeline.py's (fp32: 1e-5 relative on the loss, 2e-5 of each parameter's largest
entry).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _pipeline_helpers import LOSS_RTOL, assert_close, random_params
from flax import nnx

from meshtrain.check import check_run
from meshtrain.data.packing import row_segments
from meshtrain.layout import (
    activation_rules,
    batch_shardings,
    rules_for,
    shard_batch,
    split_microbatches,
)
from meshtrain.loss import cross_entropy
from meshtrain.lower import init_train_state, jit_train_step
from meshtrain.mesh import make_mesh
from meshtrain.models import GPT, DataSpec, GPTConfig, MoEConfig, PipelineParts
from meshtrain.pipeline import PipelineConfig, pipeline_loss, pipeline_loss_and_grads, spmd
from meshtrain.run import RunSpec
from meshtrain.state import TrainState, abstract_model
from meshtrain.train.step import jit_eval_step, train_step

B, T, VOCAB, STEPS = 16, 16, 64, 3
TX = optax.sgd(0.5)


def _cfg(style: str) -> GPTConfig:
    return GPTConfig(style=style, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                     max_seq_len=T, vocab_size=VOCAB, vocab_multiple=64)  # fmt: skip


def packed_batch(rng) -> dict:
    """B rows cut from a random stream of documents of 2..2T tokens (so some continue into the
    next row); every third row also ends in padding (segment 0)."""
    n = B * T + 1
    lengths = rng.integers(2, 2 * T, n)
    starts = np.cumsum(lengths)
    starts = starts[starts < n]
    stream = rng.integers(0, VOCAB, n)
    rows = [row_segments(r * T, starts, T) for r in range(B)]
    seg, pos = (np.stack(a).astype(np.int32) for a in zip(*rows, strict=True))
    for r in range(0, B, 3):
        pad = int(rng.integers(1, T // 2))
        seg[r, -pad:], pos[r, -pad:] = 0, 0
    windows = np.stack([stream[r * T : r * T + T + 1] for r in range(B)]).astype(np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:], "segment_ids": seg,
            "positions": pos}  # fmt: skip


@pytest.mark.parametrize(
    "schedule,style,v",
    [
        pytest.param("gpipe", "llama", 1, marks=pytest.mark.pair("packed", "gpipe")),
        pytest.param("circular", "gpt2", 2, marks=pytest.mark.pair("packed", "circular")),
    ],
)
def test_packed_pipeline_steps_equal_one_device(schedule, style, v):
    cfg = _cfg(style)
    graphdef, params = random_params(cfg, seed=3)
    rng = np.random.default_rng(17)
    batches = [packed_batch(rng) for _ in range(STEPS)]
    counts = [int((b["segment_ids"] > 0).sum()) for b in batches]
    assert all(0 < c < B * T for c in counts)  # padding and real tokens in every batch

    # One device: the plain step, the loss the masked mean over the batch's real tokens.
    state = TrainState(jnp.zeros((), jnp.int32), params, TX.init(params), {})
    plain = jax.jit(lambda st, b: train_step(graphdef, TX, st, b, run=RunSpec()))
    want_losses = []
    for batch in batches:
        state, metrics = plain(state, batch)
        want_losses.append(float(metrics["loss"]))
    want_params = jax.tree.map(np.asarray, state.params)

    mesh = make_mesh("pipe=2,data=4")
    rules = rules_for("dp", mesh)
    pipeline = PipelineConfig(schedule=schedule, microbatches=4, repeats=v)
    model = nnx.merge(graphdef, params)
    graphdef, sharded, shardings = init_train_state(lambda: model, TX, mesh, rules)
    shard = batch_shardings(batches[0], mesh, rules)
    step = jit_train_step(RunSpec(mesh=mesh, rules=rules, pipeline=pipeline), graphdef, TX,
                          shardings, shard)  # fmt: skip
    # Evaluation takes the packed entries the same way: the loss before the first update.
    evaluate = jit_eval_step(graphdef, mesh, rules, shardings, shard, pipeline=pipeline)
    evaluated = evaluate(sharded, shard_batch(batches[0], mesh, rules))
    np.testing.assert_allclose(float(evaluated), want_losses[0], rtol=LOSS_RTOL)
    got_losses = []
    for batch in batches:
        sharded, metrics = step(sharded, shard_batch(batch, mesh, rules))
        got_losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(got_losses, want_losses, rtol=LOSS_RTOL)
    assert_close(jax.tree.map(np.asarray, sharded.params), want_params, schedule)


class _PlainParts(GPT):
    """A GPT whose pipeline parts predate packed batches: ``run_blocks(blocks, x)`` only."""

    def pipeline_parts(self):
        parts = super().pipeline_parts()
        return PipelineParts(
            blocks=parts.blocks,
            embed=lambda tokens: parts.embed(tokens),
            run_blocks=lambda blocks, x: parts.run_blocks(blocks, x),
            head=parts.head,
            head_params=parts.head_params,
        )


def test_parts_without_packed_inputs_refuse_packed_batches_before_compiling():
    cfg = _cfg("llama")
    sizes = dict(pipe=2, data=4, fsdp=1, expert=1, seq=1, tensor=1)
    rules = rules_for("dp", sizes)
    abstract = abstract_model(lambda: _PlainParts(cfg, rngs=nnx.Rngs(0)))
    data = DataSpec("lm", B, T, VOCAB, packed=True)
    problems = check_run(RunSpec(data=data, mesh=sizes, rules=rules), abstract=abstract)
    assert [p.field for p in problems] == ["data.packing"], problems
    assert "_PlainParts's pipeline_parts() takes no packed batches" in problems[0].message
    # Plain windows still pipeline through the old two-argument run_blocks.
    plain = DataSpec("lm", B, T, VOCAB)
    assert check_run(RunSpec(data=plain, mesh=sizes, rules=rules), abstract=abstract) == []
    graphdef, state = nnx.split(nnx.eval_shape(lambda: _PlainParts(cfg, rngs=nnx.Rngs(0))))
    batch = packed_batch(np.random.default_rng(0))
    with pytest.raises(ValueError, match="model _PlainParts: a packed batch"):
        pipeline_loss(graphdef, nnx.to_pure_dict(state), {}, batch,
                      config=PipelineConfig(), mesh=make_mesh("pipe=2,data=4"),
                      loss_fn=cross_entropy)  # fmt: skip


@pytest.mark.pair("packed", "moe-capacity")
@pytest.mark.pair("moe-capacity", "1f1b")
@pytest.mark.pair("packed", "1f1b")
def test_nan_filled_1f1b_bubbles_with_a_packed_moe_batch_equal_one_device():
    """1F1B with NaN in every idle slot and unused buffer entry, an MoE on ``pipe=2,expert=2,
    data=2`` and a packed batch: the loss and every gradient equal the one-device math, the
    task loss over the batch's real tokens plus the mean over the 4 microbatches of each one's
    router losses (computed on its own rows, padding included)."""
    cfg = MoEConfig(d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_expert=16,
                    vocab_size=VOCAB, vocab_multiple=64, max_seq_len=T, capacity_factor=1.0,
                    aux_loss_coef=0.1, z_loss_coef=0.01)  # fmt: skip
    graphdef, params = random_params(cfg, seed=11)
    batch = packed_batch(np.random.default_rng(29))

    def reference(params):
        mask = batch["segment_ids"] > 0
        whole = nnx.merge(graphdef, params)(batch["inputs"], segment_ids=batch["segment_ids"],
                                            positions=batch["positions"])  # fmt: skip
        loss = cross_entropy(whole.logits, batch["targets"], mask=mask)

        # The router losses of each microbatch's rows (one after another), averaged.
        def router_loss(part):
            model = nnx.merge(graphdef, params)
            return model(part["inputs"], segment_ids=part["segment_ids"],
                         positions=part["positions"]).aux_loss  # fmt: skip

        parts = {k: split_microbatches(v, 4) for k, v in batch.items()}
        return loss + jax.lax.map(router_loss, parts).mean()

    want_loss, want_grads = jax.jit(jax.value_and_grad(reference))(params)
    mesh = make_mesh("pipe=2,expert=2,data=2")
    rules = rules_for("dp", mesh)
    _, sharded, _ = init_train_state(lambda: nnx.merge(graphdef, params), TX, mesh, rules)

    @jax.jit
    def piped(params, batch):
        with activation_rules(mesh, rules), spmd.poison_buffers():
            config = PipelineConfig(schedule="1f1b", microbatches=4)
            return pipeline_loss_and_grads(graphdef, params, {}, batch, config=config, mesh=mesh,
                                           loss_fn=cross_entropy)  # fmt: skip

    loss, grads = piped(sharded.params, shard_batch(batch, mesh, rules))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=LOSS_RTOL)
    assert_close(jax.tree.map(np.asarray, grads), want_grads, "moe")
