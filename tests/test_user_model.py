"""A model that is not in `meshtrain.models`, written here the way a user would, trains under
every preset and under the gpipe and 1f1b pipelines through its own `PipelineParts`, equal to
its single-device run. Nothing in meshtrain knows this model: it offers the interface only.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import fit_briefly
from flax import nnx

import meshtrain as mt
from meshtrain.models import PipelineParts

# One worker builds the module-scoped reference run(s) for all of them (under --dist loadgroup).
pytestmark = pytest.mark.xdist_group("user_model")

VOCAB, D, LAYERS, SEQ, BATCH, STEPS = 64, 32, 4, 16, 16, 3


def _named(names, std=0.05):
    """A normal initialiser carrying logical axis names."""
    return nnx.with_partitioning(nnx.initializers.normal(std), names)


class Block(nnx.Module):
    """A residual MLP block."""

    def __init__(self, rngs: nnx.Rngs):
        zeros = nnx.initializers.zeros
        self.up = nnx.Linear(
            D,
            2 * D,
            kernel_init=_named(("embed", "mlp")),
            bias_init=nnx.with_partitioning(zeros, ("mlp",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            2 * D,
            D,
            kernel_init=_named(("mlp", "embed")),
            bias_init=nnx.with_partitioning(zeros, ("embed",)),
            rngs=rngs,
        )

    def __call__(self, x_BTD):
        h_BTF = mt.constrain(jax.nn.gelu(self.up(x_BTD)), ("batch", "seq", "mlp"))
        return mt.constrain(x_BTD + self.down(h_BTF), ("batch", "seq", "embed"))


def run_stack(blocks: Block, x_BTD):
    """Runs stacked blocks (any number of them) over the activations."""

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(block, x):
        return block(x)

    return body(blocks, x_BTD)


class StackLM(nnx.Module):
    """Token embedding, a stack of blocks created with one leading ``layers`` dimension, and
    a head: the shape a pipeline can cut."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Param(_named(("vocab", "embed"))(rngs.params(), (VOCAB, D)))

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(
            D, VOCAB, use_bias=False, kernel_init=_named(("embed", "vocab")), rngs=rngs
        )

    def embed_tokens(self, tokens_BT):
        table_VD = mt.constrain(self.embed[...], ("vocab", "embed"))
        return mt.constrain(jnp.take(table_VD, tokens_BT, axis=0), ("batch", "seq", "embed"))

    def logits(self, x_BTD):
        return mt.constrain(self.head(x_BTD), ("batch", "seq", "vocab")).astype(jnp.float32)

    def __call__(self, tokens_BT):
        return self.logits(run_stack(self.blocks, self.embed_tokens(tokens_BT)))

    def pipeline_parts(self) -> PipelineParts:
        return PipelineParts(
            blocks="blocks",
            embed=self.embed_tokens,
            run_blocks=run_stack,
            head=self.logits,
            head_params=("head",),
        )


def _data():
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, VOCAB, (8 * BATCH, SEQ + 1))
    return mt.make_arrays_dataset(tokens[:, :-1], tokens[:, 1:], batch_size=BATCH, val_fraction=0)


def _train(mesh, strategy, pipeline=None, seed=3):
    """Trains StackLM (the class itself is the constructor: it gets the seed) for STEPS."""
    return fit_briefly(StackLM, _data(), mesh, strategy, STEPS, pipeline, seed=seed)


@pytest.fixture(scope="module")
def single_device():
    return _train(mt.make_mesh("data=1", devices=jax.devices()[:1]), "dp")


def _assert_same(run, reference, tol=2e-5):
    losses, params = run
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=tol)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(got, want, atol=tol * 10, rtol=tol * 10)


LAYOUTS = [
    ("data=8", "dp"),
    ("data=2,fsdp=4", "fsdp"),
    ("data=2,fsdp=4", "hsdp"),
    ("data=8", "zero1"),
    ("data=4,tensor=2", "dp+tp"),
    ("data=2,fsdp=2,tensor=2", "fsdp+tp"),
    ("data=2,fsdp=2,tensor=2", "hsdp+tp"),
    ("data=4,tensor=2", "zero1+tp"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "strategy"), LAYOUTS)
def test_a_user_model_trains_under_every_preset_equal_to_one_device(mesh, strategy, single_device):
    _assert_same(_train(mt.make_mesh(mesh), strategy), single_device)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_user_model_pipelines_through_its_parts_equal_to_one_device(schedule, single_device):
    mesh = mt.make_mesh("pipe=2,data=2,tensor=2")
    pipeline = mt.PipelineConfig(schedule=schedule, microbatches=4)
    _assert_same(_train(mesh, "fsdp", pipeline), single_device)


def test_the_seed_reaches_a_constructor_that_takes_rngs(single_device):
    mesh = mt.make_mesh("data=1", devices=jax.devices()[:1])
    other = _train(mesh, "dp", seed=4)
    assert not np.allclose(other[0][0], single_device[0][0])


def test_a_zero_argument_constructor_refuses_a_seed_it_would_ignore():
    mesh = mt.make_mesh("data=8")
    with pytest.raises(mt.RunCheckError, match=r"train.seed=5: a zero-argument model constructor"):
        mt.Trainer(
            run=mt.RunSpec(
                model=lambda: StackLM(nnx.Rngs(0)),
                data=_data(),
                mesh=mesh,
                rules=mt.rules_for("dp", mesh),
                train=mt.TrainConfig(steps=1, seed=5, run_dir="", progress=False),
            )
        )


def test_a_model_without_pipeline_parts_is_refused_on_a_pipe_mesh():
    class Plain(StackLM):
        pipeline_parts = None

    mesh = mt.make_mesh("pipe=2,data=4")
    with pytest.raises(mt.RunCheckError, match=r"mesh.pipe=2: this model cannot be pipelined"):
        mt.Trainer(
            run=mt.RunSpec(
                model=Plain,
                data=_data(),
                mesh=mesh,
                rules=mt.rules_for("dp", mesh),
                train=mt.TrainConfig(steps=1, run_dir="", progress=False),
            )
        )


def test_the_trainer_takes_a_custom_loss():
    """A loss of the user's own (cross-entropy plus PaLM's z-loss) drives the Trainer."""

    def with_z_loss(logits, targets):
        lse = jax.nn.logsumexp(logits, axis=-1)
        return mt.lower.cross_entropy(logits, targets) + 1e-2 * jnp.mean(lse**2)

    mesh = mt.make_mesh("data=8")
    trainer = mt.Trainer(
        run=mt.RunSpec(
            model=StackLM,
            data=_data(),
            mesh=mesh,
            rules=mt.rules_for("dp", mesh),
            train=mt.TrainConfig(steps=1, run_dir="", progress=False, eval_every=0),
            loss_fn=with_z_loss,
        )
    )
    model = trainer.model  # the initial parameters, before the step
    batch = next(_data().train_iter())
    logits = model(jnp.asarray(batch["inputs"]))
    want = float(with_z_loss(logits, batch["targets"]))
    plain = float(mt.lower.cross_entropy(logits, batch["targets"]))
    (entry,) = trainer.fit()
    np.testing.assert_allclose(entry["loss"], want, rtol=1e-5)
    assert entry["loss"] - plain > 0.1  # the z-loss term is really in it
