"""A smoke subset that `make test-lowest` runs on the lowest versions pyproject.toml allows
(jax 0.11.2, the GPU image's jax; see scripts/lowest_versions.py). `make test` leaves it out
(marker ``lowest``): on the current versions the main suite covers each of these more fully.
Each test is a short equivalence or round trip, not a bare "it ran"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshtrain as mt
from meshtrain.kernels import flash_attention, matmul, reference, rms_norm, token_cross_entropy

pytestmark = pytest.mark.lowest

CFG = mt.GPTConfig(d_model=64, n_layers=2, n_heads=2, max_seq_len=16)
B, T = 8, 16


def _data():
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (32, T + 1))
    return mt.make_arrays_dataset(
        tokens[:, :-1], tokens[:, 1:], batch_size=B, seed=0, vocab_size=CFG.vocab_size
    )


def _trainer(mesh_spec, *, strategy="fsdp+tp", pipeline=None, run_dir="", checkpoint=None):
    mesh = mt.make_mesh(mesh_spec)
    run = mt.RunSpec(
        model=CFG,
        data=_data(),
        mesh=mesh,
        rules=mt.rules_for(strategy, mesh),
        pipeline=pipeline or mt.PipelineConfig(),
        checkpoint=checkpoint,
        train=mt.TrainConfig(steps=2, eval_every=0, log_every=1, run_dir=run_dir, progress=False),
    )
    return mt.Trainer(run=run)


def _losses(trainer):
    return [e["loss"] for e in trainer.fit()]


@pytest.fixture(scope="module")
def plain_losses():
    return _losses(_trainer("data=8", strategy="dp"))


def test_import_and_cli_parse():
    from meshtrain.cli import parse
    from meshtrain.cli.train import TrainJob

    job = parse(["train", "--steps", "2", "--mesh", "data=8"])
    assert isinstance(job, TrainJob) and job.train.steps == 2
    assert mt.__version__


def test_two_steps_on_a_2x2x2_mesh_match_data_parallel(plain_losses):
    losses = _losses(_trainer("data=2,fsdp=2,tensor=2"))
    assert len(losses) == 2 and losses[1] != losses[0]
    np.testing.assert_allclose(losses, plain_losses, rtol=2e-5)


def test_1f1b_pipeline_matches_data_parallel(plain_losses):
    pipeline = mt.PipelineConfig(schedule="1f1b", microbatches=4)
    losses = _losses(_trainer("pipe=2,data=2,tensor=2", pipeline=pipeline))
    np.testing.assert_allclose(losses, plain_losses, rtol=2e-5)


def test_kernels_in_interpret_mode_match_their_references():
    ks = jax.random.split(jax.random.key(7), 6)
    q = jax.random.normal(ks[0], (1, 40, 4, 64))
    kv = jax.random.normal(ks[1], (1, 40, 2, 64))
    x = jax.random.normal(ks[2], (30, 48))
    w = jax.random.normal(ks[3], (48, 40)) / 7
    t = jax.random.randint(ks[4], (30,), 0, 48)

    def rel(a, b):
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    out = flash_attention(q, kv, kv, impl="pallas", block_q=16, block_k=16)
    assert rel(out, reference.attention(q, kv, kv)) < 2e-5
    assert rel(rms_norm(x, w[:, 0] + 1, impl="pallas"), reference.rms_norm(x, w[:, 0] + 1)) < 2e-5
    assert rel(token_cross_entropy(x, t, impl="pallas"), reference.token_cross_entropy(x, t)) < 2e-5
    assert rel(matmul(x, w, impl="pallas"), reference.matmul(x, w)) < 2e-5
    g_pallas = jax.grad(lambda q: flash_attention(q, kv, kv, impl="pallas").sum())(q)
    g_ref = jax.grad(lambda q: reference.attention(q, kv, kv).sum())(q)
    assert rel(g_pallas, g_ref) < 1e-4


def test_checkpoint_round_trip_resumes_bit_exact(tmp_path, plain_losses):
    first = _trainer(
        "data=2,fsdp=2,tensor=2",
        run_dir=str(tmp_path),
        checkpoint=mt.CheckpointConfig(save_every=1),
    )
    first.fit(until=1)
    first.checkpoints.close()
    second = _trainer(
        "data=4,fsdp=2",  # restored onto another layout
        strategy="fsdp",
        run_dir=str(tmp_path),
        checkpoint=mt.CheckpointConfig(save_every=1, resume=True),
    )
    assert int(second.state.step) == 1
    for a, b in zip(
        jax.tree.leaves(second.state.params), jax.tree.leaves(first.state.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tail = _losses(second)
    second.checkpoints.close()
    np.testing.assert_allclose(tail, plain_losses[1:], rtol=2e-5)
