"""The model registry drives the CLI: every family is a ``--model`` choice with its own
config flags, and builds, checks and describes itself through the model interface."""

import dataclasses

import pytest
from flax import nnx

from meshtrain import cli
from meshtrain.cli.train import TrainJob
from meshtrain.models import DataSpec, ModelConfig, families, family_of
from meshtrain.problem import Problem


def test_every_family_implements_the_model_interface():
    assert list(families()) == ["gpt", "mlp", "cnn", "moe"]
    for name, family in families().items():
        config = family.default
        assert isinstance(config, ModelConfig), name
        assert family_of(config) is family
        assert config.describe().startswith(name)
        assert config.flops_per_token(16) > 0
        module = config.build(rngs=nnx.Rngs(0))
        assert isinstance(module, nnx.Module)


def test_the_gpt_family_points_at_its_hugging_face_adapters():
    adapters = families()["gpt"].hf_adapters()
    for arch in ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert arch in adapters
    assert families()["mlp"].hf_adapters() == {}


def test_the_cli_offers_every_family_and_its_flags():
    job = cli.parse(["train", "--model", "mlp", "--mlp.d-model", "48", "--gpt.n-layers", "6"])
    assert job.model_config() == dataclasses.replace(families()["mlp"].default, d_model=48)
    assert job.gpt.n_layers == 6
    fields = {f.name for f in dataclasses.fields(TrainJob)}
    assert set(families()) <= fields
    with pytest.raises(
        ValueError, match=r"model='resnet': choose from gpt, mlp, cnn, moe; e.g. --model gpt"
    ):
        cli.parse(["train", "--model", "resnet"])


@pytest.mark.parametrize(
    ("family", "data", "field"),
    [
        ("gpt", DataSpec("classify", 16, None, 3, 8), "model"),
        ("gpt", DataSpec("lm", 16, 4096, 256), "data.seq_len"),
        ("mlp", DataSpec("lm", 16, 32, 256), "model"),
        ("mlp", DataSpec("classify", 16, None, 50, 7), "mlp.num_features"),
        ("cnn", DataSpec("lm", 16, 32, 256), "model"),
        ("cnn", DataSpec("classify", 16, None, 10, 784, (28, 28, 1)), "cnn.image_size"),
        ("cnn", DataSpec("classify", 16, None, 10, 50), "cnn.image_size"),
    ],
)
def test_each_family_says_what_data_it_cannot_train_on(family, data, field):
    problems = families()[family].default.check(data)
    assert problems and all(isinstance(p, Problem) for p in problems)
    assert problems[0].field == field and ";" in problems[0].message
