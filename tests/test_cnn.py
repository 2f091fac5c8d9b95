"""The CNN family: every data strategy (and channel-wise tensor parallelism) equal to one
device, synchronised batch-norm statistics, the Pallas ReLU/MSE path equal to XLA's, the
accuracy on the embedded digits, the image data and its errors before anything compiles."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import fit_briefly
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshtrain as mt
from meshtrain.data import DataConfig, make_dataset
from meshtrain.models import CNNConfig
from meshtrain.models.cnn import batch_statistics

# One worker builds the module-scoped reference run(s) for all of them (under --dist loadgroup).
pytestmark = pytest.mark.xdist_group("cnn")

STEPS = 3
LENET = CNNConfig(widths=(8, 16), hidden=16)
RESNET = CNNConfig(preset="resnet18", widths=(8,), depth=1)  # stem + one residual block


def _digits(batch_size=16, val_fraction=0.0):
    return make_dataset(
        DataConfig(source="digits", batch_size=batch_size, val_fraction=val_fraction)
    )


def _train(cfg, mesh, strategy, *, loss="cross_entropy", loss_impl="xla"):
    """STEPS steps of AdamW on the digits (nothing held out, so no evaluation compiles)."""
    return fit_briefly(cfg, _digits(), mesh, strategy, STEPS, loss=loss, loss_impl=loss_impl)


def _one_device():
    return mt.make_mesh("data=1", devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def lenet_single():
    """The LeNet-style net with XLA's ReLU and the MSE loss (the proof of concept's), 1 device."""
    return _train(LENET, _one_device(), "dp", loss="mse")


@pytest.fixture(scope="module")
def resnet_single():
    return _train(RESNET, _one_device(), "dp")


def _assert_same(run, reference, tol=2e-5):
    losses, params = run
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=tol)
    assert abs(losses[-1] - losses[0]) > 1e-3  # the steps moved the parameters
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(got, want, atol=tol * 10, rtol=tol * 10)


# Each case below proves something the others do not (suite time is the budget): zero1 is data
# parallelism with the optimizer state sharded; dp+tp splits the LeNet's channels over tensor
# with the Pallas kernels; fsdp+tp shards the ResNet's parameters over data × fsdp and its
# blocks' inner channels over tensor; hsdp shards them over fsdp alone, replicated over data.


@pytest.mark.slow
def test_lenet_under_zero1_equals_one_device(lenet_single):
    _assert_same(_train(LENET, mt.make_mesh("data=8"), "zero1", loss="mse"), lenet_single)


@pytest.mark.slow
def test_pallas_relu_and_mse_under_tensor_parallelism_train_like_xla_on_one_device(lenet_single):
    """The hand-written ReLU and MSE kernels (interpreted on CPU), run per shard with the
    channels split over tensor, train the CNN as XLA's own ReLU and loss do on one device."""
    pallas = dataclasses.replace(LENET, act_impl="pallas")
    mesh = mt.make_mesh("data=4,tensor=2")
    _assert_same(_train(pallas, mesh, "dp+tp", loss="mse", loss_impl="pallas"), lenet_single)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mesh", "strategy"), [("data=2,fsdp=2,tensor=2", "fsdp+tp"), ("data=2,fsdp=4", "hsdp")]
)
def test_resnet_under_sharded_parameters_equals_one_device(resnet_single, mesh, strategy):
    """FSDP shards the convolution kernels' stream channels over data × fsdp (hsdp: over fsdp
    only, replicated over data); +tp splits the residual blocks' inner channels over tensor
    (channel-parallel pairs); batch norm's statistics span the whole batch."""
    _assert_same(_train(RESNET, mt.make_mesh(mesh), strategy), resnet_single)


def test_channel_names_split_the_kernels_over_tensor():
    """A residual block's first kernel [3, 3, in, out]: its input (the stream) split over
    fsdp, its output channels over tensor; the second kernel the other way round."""
    from flax import nnx

    from meshtrain.layout.resolve import state_specs

    mesh = mt.make_mesh("fsdp=4,tensor=2")
    rules = mt.rules_for("hsdp+tp", mesh)
    _, state = mt.lower.abstract_model(lambda: RESNET.build(rngs=nnx.Rngs(params=0)))
    specs = state_specs(state, rules.params, mesh)
    block = specs["blocks"][0]
    assert block["first"]["conv"]["kernel"] == P(None, None, "fsdp", "tensor")
    assert block["second"]["conv"]["kernel"] == P(None, None, "tensor", "fsdp")


def test_synchronised_batch_norm_uses_the_whole_batch():
    """With the batch split over 8 devices, the statistics are the whole batch's (XLA
    all-reduces them), not one device's slice."""
    x = np.random.default_rng().normal(size=(16, 5, 5, 12)).astype(np.float32) * 3 + 1
    mesh = mt.make_mesh("data=8")
    sharded = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
    fn = jax.jit(batch_statistics)
    mean, var = fn(sharded)
    np.testing.assert_allclose(mean, x.mean(axis=(0, 1, 2)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(var, x.var(axis=(0, 1, 2)), rtol=1e-5)
    local = x[:2].mean(axis=(0, 1, 2))  # what an unsynchronised device would see
    assert np.abs(local - mean).max() > 1e-3
    assert "all-reduce" in fn.lower(sharded).compile().as_text()


@pytest.mark.slow
def test_cnn_reaches_90_percent_on_the_embedded_digits():
    """The LeNet-style net on the held-out 10% of the digits (180 images), 8 devices."""
    start = time.perf_counter()
    mesh = mt.make_mesh("data=8")
    cfg = CNNConfig(widths=(16, 32), hidden=64)
    data = _digits(batch_size=64, val_fraction=0.1)
    run = mt.RunSpec(
        model=cfg,
        data=data,
        mesh=mesh,
        rules=mt.rules_for("dp", mesh),
        optim=mt.OptimConfig(lr=3e-3, warmup_steps=10),
        train=mt.TrainConfig(steps=150, run_dir="", progress=False, eval_every=0, log_every=50),
    )
    trainer = mt.Trainer(run=run)
    trainer.fit()
    model = trainer.model
    model.eval()  # batch norm from its running averages
    held_out = data.eval_batches(3)  # 192 rows in order, wrapping after the 180 held out
    inputs = np.concatenate([b["inputs"] for b in held_out])[: data.num_val]
    targets = np.concatenate([b["targets"] for b in held_out])[: data.num_val]
    predicted = np.asarray(jax.jit(lambda x: model(x).argmax(-1))(jnp.asarray(inputs)))
    accuracy = float((predicted == targets).mean())
    took = time.perf_counter() - start
    print(f"digits test accuracy {accuracy:.3f} on {len(targets)} images in {took:.0f} s")
    assert accuracy >= 0.9


def test_images_are_sharded_deterministic_and_resumable(tmp_path):
    """An .npz of uint8 images [N, H, W] (MNIST style) becomes rows scaled to [0, 1]; a saved
    position resumes with the same next batch; two processes' rows make up the batch."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 6, 6), dtype=np.uint8)
    labels = rng.integers(0, 3, 40)
    path = tmp_path / "mnist.npz"
    np.savez(path, x_train=images[:30], y_train=labels[:30], x_test=images[30:], y_test=labels[30:])
    data = make_dataset(
        DataConfig(source="images", path=str(path), batch_size=4, val_fraction=0.25)
    )
    assert data.image_shape == (6, 6, 1) and data.num_val == 10
    np.testing.assert_allclose(data.eval_batches(1)[0]["inputs"][0], images[30].ravel() / 255)
    it = data.train_iter()
    next(it)
    state = it.get_state()
    want = next(it)
    again = data.train_iter()
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["inputs"], want["inputs"])
    halves = [next(data.train_iter(rows=r))["inputs"] for r in ((0, 2), (2, 4))]
    np.testing.assert_array_equal(np.concatenate(halves), next(data.train_iter())["inputs"])


def _problems(cfg, data_cfg, mesh="data=8", strategy="dp", abstract=None):
    mesh = mt.make_mesh(mesh)
    data = make_dataset(data_cfg)
    rules = mt.rules_for(strategy, mesh)
    no_dir = mt.TrainConfig(run_dir="")  # the settings' problems only
    run = mt.RunSpec(model=cfg, data=data, mesh=mesh, rules=rules, train=no_dir)
    return mt.lower.check_run(run, abstract=abstract)


def test_bad_input_is_named_before_compiling(tmp_path):
    digits = DataConfig(source="digits", batch_size=16)
    (wrong,) = _problems(CNNConfig(image_size=28), digits)
    assert wrong.field == "cnn.image_size" and "--cnn.image-size 8" in wrong.message
    narrow = CNNConfig(widths=(6, 16))
    abstract = mt.lower.abstract_model(lambda: narrow.build(rngs=nnx.Rngs(0)))
    # One line naming the field, not one more per parameter the width reaches.
    (split,) = _problems(narrow, digits, "data=2,tensor=4", "dp+tp", abstract=abstract)
    assert split.field == "cnn.widths" and "divisible" in split.message
    with pytest.raises(ValueError, match="halves the image 3 times and needs at least 8×8"):
        CNNConfig(preset="vgg", image_size=4)
    with pytest.raises(ValueError, match="no such file"):
        make_dataset(DataConfig(source="images", path=str(tmp_path / "missing.npz")))
    (text,) = _problems(CNNConfig(), DataConfig(source="synthetic", seq_len=16, batch_size=16))
    assert "--data.source digits" in text.message
    mesh = mt.make_mesh("data=8")
    with pytest.raises(mt.RunCheckError, match="train.loss='mse': a custom loss_fn with a built"):
        mt.Trainer(
            run=mt.RunSpec(
                model=LENET,
                data=make_dataset(digits),
                mesh=mesh,
                rules=mt.rules_for("dp", mesh),
                train=mt.TrainConfig(loss="mse", run_dir="", progress=False),
                loss_fn=lambda logits, targets: logits.mean(),
            )
        )


@pytest.mark.slow
def test_launch_two_processes_matches_one_process(tmp_path):
    """``meshtrain launch --nproc 2 -- train --model cnn`` (2 × 4 devices) against one process
    of 8 devices, same mesh: every step's loss and the final held-out loss."""
    import subprocess
    import sys

    from test_distributed import ROOT, _env, _wait

    from meshtrain.metrics import read_jsonl

    train = [
        "train", "--model", "cnn", "--data.source", "digits", "--data.batch-size", "16",
        "--mesh", "data=4,tensor=2", "--strategy", "dp+tp", "--cnn.widths", "8", "16",
        "--cnn.hidden", "16", "--steps", "3", "--log-every", "1", "--eval-every", "0",
        "--no-save", "--no-progress",
    ]  # fmt: skip
    cli = [sys.executable, "-m", "meshtrain.cli"]
    launch = ["launch", "--nproc", "2", "--devices-per-proc", "4", "--"]
    runs = {
        "multi": cli + launch + train + ["--run-dir", str(tmp_path / "multi")],
        "single": cli + train + ["--devices", "8", "--run-dir", str(tmp_path / "single")],
    }
    procs = {
        name: subprocess.Popen(
            argv,
            env=_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for name, argv in runs.items()
    }
    for name, proc in procs.items():
        _wait(proc, name)
    records = {name: read_jsonl(tmp_path / name / "metrics.jsonl") for name in runs}
    losses = {
        name: [(r["split"], r["step"], r["loss"]) for r in rs] for name, rs in records.items()
    }
    assert [x[:2] for x in losses["multi"]] == [x[:2] for x in losses["single"]]
    assert len([x for x in losses["single"] if x[0] == "train"]) == 3
    np.testing.assert_allclose(
        [x[2] for x in losses["multi"]], [x[2] for x in losses["single"]], rtol=1e-5
    )


def test_group_norm_normalises_each_group_of_channels():
    """norm='group': right after the first convolution every group of channels of every image
    has mean 0 and variance 1 (scale 1, bias 0 at initialisation), whatever the batch."""
    from flax import nnx

    from meshtrain.models.cnn import ConvNorm

    cfg = CNNConfig(widths=(8, 16), hidden=16, norm="group", groups=4)
    first = ConvNorm(cfg, 1, 8, ("features", "mlp"), rngs=nnx.Rngs(params=0))  # the first layer
    x = np.random.default_rng().normal(size=(3, 8, 8, 1)).astype(np.float32) * 5 + 2
    y = np.asarray(jax.jit(lambda x: first(x))(jnp.asarray(x)))  # [3, 8, 8, 8]
    groups = y.reshape(3, 8, 8, 4, 2)
    np.testing.assert_allclose(groups.mean(axis=(1, 2, 4)), 0, atol=1e-5)
    np.testing.assert_allclose(groups.var(axis=(1, 2, 4)), 1, rtol=1e-3)


def test_a_strided_residual_block_halves_the_image_through_its_projection():
    """The first block of a later ResNet stage: stride 2 in its first convolution and in the
    1×1 projection of its input, so the two paths meet at [B, H/2, W/2, out]."""
    from flax import nnx

    from meshtrain.models.cnn import ResidualBlock

    def run(x):
        block = ResidualBlock(RESNET, 8, 16, 2, rngs=nnx.Rngs(params=0))
        assert block.skip is not None
        return block(x)

    y = nnx.eval_shape(run, jax.ShapeDtypeStruct((3, 7, 7, 8), jnp.float32))  # nothing compiles
    assert y.shape == (3, 4, 4, 16)
    assert RESNET.convs() == [(3, 1, 8, 8), (3, 8, 8, 8), (3, 8, 8, 8)]
