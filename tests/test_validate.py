"""The validation vocabulary: the helpers' wording, every config's `problems()`, the pair table."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import numpy as np
import pytest

import meshtrain
from meshtrain import validate
from meshtrain.check import check_run
from meshtrain.composition import REFUSALS, model_name, pair_problems
from meshtrain.problem import Problem, RunCheckError
from meshtrain.run import RunSpec

# ---- the helpers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("problems", "line"),
    [
        (
            validate.positive("steps", 0, example=300),
            "steps=0: must be a positive integer; e.g. --steps 300",
        ),
        (
            validate.positive("gpt.n_heads", 2.0, note="query heads"),
            "gpt.n_heads=2.0: must be a positive integer (query heads)",
        ),
        (validate.positive("steps", True), "steps=True: must be a positive integer"),
        (
            validate.non_negative("eval_every", -1, example=100),
            "eval_every=-1: must be an integer ≥ 0; e.g. --eval-every 100",
        ),
        (
            validate.at_least("dist.process_id", -2, -1, example=0),
            "dist.process_id=-2: must be an integer ≥ -1; e.g. --dist.process-id 0",
        ),
        (
            validate.at_least("eps", float("nan"), 0, integer=False),
            "eps=nan: must be a number ≥ 0",
        ),
        (
            validate.above("lr", 0.0, 0, example="3e-3"),
            "lr=0.0: must be a number > 0; e.g. --lr 3e-3",
        ),
        (
            validate.in_range("b1", 1.0, 0, 1, closed="[)"),
            "b1=1.0: must be a number in [0, 1)",
        ),
        (
            validate.in_range("data.seed", 2**32, 0, 2**32, closed="[)", integer=True),
            f"data.seed={2**32}: must be an integer in [0, {2**32})",
        ),
        (
            validate.one_of("loss", "l1", ("cross_entropy", "mse")),
            "loss='l1': choose from cross_entropy, mse; e.g. --loss cross_entropy",
        ),
        (
            validate.one_of("mesh.data", 0, (1, 2), flag="--mesh", example="data=2"),
            "mesh.data=0: choose from 1, 2; e.g. --mesh data=2",
        ),
        (
            validate.divides("gpt.d_model", 130, 4, what="n_heads"),
            "gpt.d_model=130: not divisible by n_heads = 4; use a multiple of 4",
        ),
        (
            validate.require(False, "data.path", 3, "must be a string"),
            "data.path=3: must be a string",
        ),
    ],
)
def test_each_helper_writes_one_line_naming_field_value_and_fix(problems, line):
    assert [str(p) for p in problems] == [line]
    assert all(isinstance(p, Problem) for p in problems)


@pytest.mark.parametrize(
    "problems",
    [
        validate.positive("steps", 1),
        validate.positive("steps", np.int64(3)),
        validate.non_negative("eval_every", 0),
        validate.at_least("dist.process_id", -1, -1),
        validate.non_negative("eps", 0.0, integer=False),
        validate.above("lr", 1e-9, 0),
        validate.in_range("b1", 0, 0, 1, closed="[)"),
        validate.in_range("min_lr_ratio", 1, 0, 1),
        validate.in_range("x", 0.5, 0, 1, closed="()"),
        validate.one_of("loss", "mse", ("cross_entropy", "mse")),
        validate.divides("gpt.d_model", 128, 4),
        validate.divides("gpt.d_model", 0.5, 4),  # not an integer: another helper says so
        validate.require(True, "data.path", "", "must be a string"),
    ],
)
def test_helpers_accept_boundary_values(problems):
    assert problems == []


@pytest.mark.parametrize(
    ("problems", "field"),
    [
        (validate.positive("x", -1), "x"),
        (validate.non_negative("x", -1e-9, integer=False), "x"),
        (validate.above("x", 0, 0), "x"),
        (validate.in_range("x", 0, 0, 1, closed="(]"), "x"),
        (validate.in_range("x", 1, 0, 1, closed="[)"), "x"),
        (validate.in_range("x", "0.5", 0, 1), "x"),
        (validate.non_negative("x", 1.0), "x"),  # integer=True: floats are refused
    ],
)
def test_helpers_refuse_values_just_outside(problems, field):
    assert [p.field for p in problems] == [field]


def test_check_turns_a_raising_check_into_a_problem_without_repeating_the_field():
    def raises(value):
        raise ValueError(f"gpt remat={value!r}: unknown policy")

    assert validate.check("gpt.remat", "x", raises, "x") == [
        Problem("gpt.remat", "x", "unknown policy")
    ]
    assert validate.check("gpt.remat", "full", lambda v: None, "full") == []


def test_reject_raises_a_value_error_listing_every_problem():
    @dataclasses.dataclass(frozen=True)
    class Two:
        a: int = 0
        b: int = 0

        def problems(self):
            return validate.positive("a", self.a) + validate.positive("b", self.b)

    with pytest.raises(ValueError) as err:  # the CLI and tyro catch ValueError
        validate.reject(Two())
    assert isinstance(err.value, RunCheckError)
    assert [p.field for p in err.value.problems] == ["a", "b"]
    assert str(err.value).splitlines() == [
        "a=0: must be a positive integer",
        "b=0: must be a positive integer",
    ]
    validate.reject(Two(1, 1))  # nothing wrong: no error


# ---- every config class ---------------------------------------------------------------------

# One bad value per config class: (field to set, value, the field its Problem names).
BAD = {
    "meshtrain.mesh.MeshConfig": ("data", 0, "mesh.data"),
    "meshtrain.layout.rules.Rules": ("params", {"embed": "model"}, "rules.params['embed']"),
    "meshtrain.run.TrainConfig": ("steps", 0, "steps"),
    "meshtrain.optim.OptimConfig": ("lr", 0.0, "lr"),
    "meshtrain.pipeline.config.PipelineConfig": ("repeats", 0, "repeats"),
    "meshtrain.replicas.config.SyncConfig": ("staleness", -1, "staleness"),
    "meshtrain.replicas.codecs.Codec": ("block", 0, "block"),
    "meshtrain.checkpoint.manager.CheckpointConfig": ("keep_last", 0, "keep_last"),
    "meshtrain.data.config.DataConfig": ("batch_size", 0, "data.batch_size"),
    "meshtrain.distributed.DistributedConfig": ("init_timeout_s", 0, "dist.init_timeout_s"),
    "meshtrain.models.gpt_config.GPTConfig": ("n_layers", 0, "gpt.n_layers"),
    "meshtrain.models.moe_config.MoEConfig": ("top_k", 0, "moe.top_k"),
    "meshtrain.models.mlp.MLPConfig": ("d_hidden", 0, "mlp.d_hidden"),
    "meshtrain.models.cnn_config.CNNConfig": ("groups", 0, "cnn.groups"),
    "meshtrain.cli.train.TrainJob": ("devices", -1, "devices"),
    "meshtrain.cli.train.PrecisionFlags": ("loss_scale_period", 0, "loss_scale_period"),
    "meshtrain.precision.policy.Precision": ("policy", "fp9", "precision"),
    "meshtrain.offload.config.Offload": ("memory_kind", "device", "offload.memory_kind"),
    "meshtrain.cli.train.OffloadFlags": ("offload", "all", "offload"),
    "meshtrain.run.RunSpec": ("mesh", "data=8", "run.mesh"),
    "meshtrain.cli.inspect.InspectJob": ("sample_tokens", -1, "sample_tokens"),
    "meshtrain.cli.bench.BenchSettings": ("steps", 0, "steps"),
    "meshtrain.cli.prepare.PrepareSettings": ("workers", -1, "workers"),
    "meshtrain.cli.plan.PlanSettings": ("client_fraction", float("inf"), "client_fraction"),
}
REQUIRED = {
    "Rules": {"params": {}, "activations": {}},
    "PrepareSettings": {"inputs": ("notes",), "out": "corpus"},
}  # fields without defaults


def _config_classes() -> dict[str, type]:
    """Every dataclass in meshtrain's modules with a ``problems()`` method."""
    found = {}
    for info in pkgutil.walk_packages(meshtrain.__path__, "meshtrain."):
        if info.name.startswith("meshtrain.kernels") or info.name.endswith("__main__"):
            continue  # kernels' configs are checked by the kernels; __main__ runs the CLI
        module = importlib.import_module(info.name)
        for cls in vars(module).values():
            if (
                isinstance(cls, type)
                and dataclasses.is_dataclass(cls)
                and cls.__module__ == info.name
                and callable(getattr(cls, "problems", None))
            ):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


CONFIGS = _config_classes()


def test_every_config_class_is_covered_here():
    """A new config with ``problems()`` needs a row in BAD; every row names a real class."""
    assert sorted(CONFIGS) == sorted(BAD)


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_config_refuses_a_bad_value_through_reject(name):
    cls = CONFIGS[name]
    required = REQUIRED.get(cls.__name__, {})
    assert cls(**required).problems() == []
    field, value, named = BAD[name]
    with pytest.raises(RunCheckError) as err:
        cls(**{**required, field: value})
    assert [(p.field, p.value) for p in err.value.problems][:1] == [
        (named, value if not isinstance(value, dict) else "model")
    ]
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_config_checks_itself_only_through_checked(name):
    """Every check lives in ``problems()``: no config makes its own ``__post_init__``."""
    cls = CONFIGS[name]
    assert issubclass(cls, validate.Checked)
    assert cls.__post_init__ is validate.Checked.__post_init__


# ---- the table of refused pairs -------------------------------------------------------------


def _check(settings: dict):
    """`check_run` on a run built from `settings` (RunSpec attributes)."""
    return check_run(RunSpec(**settings))


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: f"{r.first} + {r.second}")
def test_every_refused_pair_is_found_by_the_run_check_and_only_with_both(refusal):
    """Built from each row's example, so the table cannot drift from what the check does."""
    assert refusal.example is not None, "each row needs an example run"
    with_pair, without_pair = refusal.example()
    tag = f"{refusal.first} with {refusal.second}: {refusal.reason}"
    field = refusal.field.format(model=model_name(with_pair.get("model")))
    found = [p for p in _check(with_pair) if p.message.startswith(tag)]
    assert [p.field for p in found] == [field]
    assert "\n" not in str(found[0]) and found[0].message.endswith(
        refusal.fix.format(model=model_name(with_pair.get("model")))
    )
    assert not [p for p in _check(without_pair) if p.message.startswith(tag)]


def test_pair_problems_reads_the_table_in_order():
    with_pair, _ = REFUSALS[0].example()
    run = RunSpec(**with_pair)
    assert pair_problems(run) == [r.problem(run) for r in REFUSALS if r.applies(run)]
    assert pair_problems(run)[0].field == REFUSALS[0].field


def test_the_table_names_each_pair_once():
    pairs = [(r.first, r.second) for r in REFUSALS]
    assert len(pairs) == len(set(pairs))
