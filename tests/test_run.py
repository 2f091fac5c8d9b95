"""Tests for meshtrain.run: one `RunSpec` read by the check, the compiler, the inspector, the
step and the `Trainer`; the removed older spellings raise `TypeError`; and no public function
threads ten settings by hand.
"""

import ast
import dataclasses
import pathlib
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

import meshtrain as mt
from meshtrain.check import check_run
from meshtrain.comm import compile_step, inspect_compiled
from meshtrain.comm.expect import Traffic, expected, param_layouts
from meshtrain.data import DataConfig, make_dataset
from meshtrain.layout import shard_batch
from meshtrain.lower import init_train_state, jit_train_step, make_optimizer, train_step
from meshtrain.mesh import AXES, make_mesh
from meshtrain.models import GPTConfig, MLPConfig
from meshtrain.models.base import DataSpec
from meshtrain.run import RunSpec
from meshtrain.state import abstract_model
from meshtrain.train import OptimConfig, TrainConfig, Trainer

T, B = 16, 16
GPT = GPTConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=T, vocab_size=64)
SPEC = DataSpec("lm", B, T, 64, None)
TX = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 10)


@pytest.fixture(scope="module")
def hybrid():
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    return mesh, mt.rules_for("fsdp+tp", mesh)


def test_the_step_reports_the_learning_rate_under_local_sgd_too():
    """``lr`` is the schedule at the step's own index on every sync path (local SGD's included)."""
    cfg = MLPConfig(num_features=8, num_classes=4, d_model=16, d_hidden=16, n_layers=1)
    mesh = make_mesh("data=8")
    run = RunSpec(mesh=mesh, rules=mt.rules_for("dp", mesh), sync=mt.SyncConfig(sync_every=2))
    optim = OptimConfig(lr=1e-2, warmup_steps=3)
    tx, schedule = make_optimizer(optim, 10), mt.lower.make_schedule(optim, 10)
    ctor = lambda: cfg.build(rngs=nnx.Rngs(params=0))  # noqa: E731
    graphdef, state, shardings = init_train_state(ctor, tx, mesh, run.rules)
    state, shardings = mt.lower.with_sync(run.sync, tx, state, shardings, mesh, run.rules)
    rng = np.random.default_rng(2)
    batch = {"inputs": rng.normal(size=(16, 8)).astype(np.float32)}
    batch["targets"] = rng.integers(0, 4, 16).astype(np.int32)
    batch = shard_batch(batch, mesh, run.rules)
    step = jit_train_step(
        run, graphdef, tx, shardings, {k: v.sharding for k, v in batch.items()}, schedule=schedule
    )
    for i in range(2):
        state, metrics = step(state, batch)
        np.testing.assert_allclose(metrics["lr"], schedule(i), rtol=1e-6)  # jit vs eager
        assert int(metrics["synced"]) == i


def test_check_run_finds_the_problems_of_a_run_spec():
    """A run that cannot work: every problem, from the `RunSpec`."""
    sizes = {a: 1 for a in AXES} | {"data": 4, "tensor": 2}
    data = DataSpec("lm", 12, T, 300, None)  # 12 rows over 4 ways × 2 microbatches; vocab 300
    rules = mt.rules_for("dp+tp", sizes)
    new = check_run(
        RunSpec(
            model=GPT,
            data=data,
            mesh=sizes,
            rules=rules,
            train=TrainConfig(accum_steps=2, run_dir=""),
        )
    )
    assert len(new) >= 2
    assert {p.field for p in new} >= {"data.batch_size", "gpt.vocab_size"}


def test_inspect_and_expected_read_the_run_spec(hybrid):
    mesh, rules = hybrid
    new = mt.inspect(RunSpec(model=GPT, data=SPEC, mesh=mesh, rules=rules))
    assert any(r.kind == "all-gather" for r in new.rows)  # fsdp gathers: a real layout
    # expected(): the run, its Traffic and a Traffic written out by hand agree
    graphdef, state = abstract_model(lambda: GPT.build(rngs=nnx.Rngs(params=0)))
    params = param_layouts(
        nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)[1], rules, new.mesh
    )
    run = RunSpec(model=GPT, data=SPEC, mesh=mesh, rules=rules)
    axes = rules.batch_axes(new.mesh)
    by_hand = expected(params, Traffic(new.mesh, axes, tokens=B * T, d_model=32, batch=B))
    assert expected(params, run) == by_hand == expected(params, Traffic.of(run)) == new.expectation
    with pytest.raises(TypeError, match=r"expected\(\) takes a RunSpec or a Traffic as run"):
        expected(params, new.mesh)


def test_the_removed_keywords_and_positional_forms_raise_type_error(hybrid):
    """The older spellings of the check, the compiler, the inspector, the step and the `Trainer`
    are gone: each raises Python's own `TypeError`, before anything compiles."""
    mesh, rules = hybrid
    unexpected = "got an unexpected keyword argument"
    with pytest.raises(TypeError, match=rf"check_run\(\) {unexpected} 'mesh'"):
        check_run(mesh=mesh, rules=rules, data=SPEC)
    with pytest.raises(TypeError, match=rf"check_run\(\) {unexpected} 'accum_steps'"):
        check_run(RunSpec(data=SPEC), accum_steps=2)
    with pytest.raises(TypeError, match=rf"Trainer.__init__\(\) {unexpected} 'config'"):
        Trainer(GPT, mesh=mesh, config=TrainConfig())
    with pytest.raises(TypeError, match=r"inspect\(\) takes 1 positional argument but 4"):
        mt.inspect(GPT, SPEC, mesh, rules)
    with pytest.raises(TypeError, match=r"compile_step\(\) takes 1 positional argument but 4"):
        compile_step(GPT, SPEC, mesh, rules)
    with pytest.raises(TypeError, match=rf"inspect_compiled\(\) {unexpected} 'mesh'"):
        inspect_compiled(None, RunSpec(), param_vars=None, mesh=mesh)
    with pytest.raises(TypeError, match=rf"expected\(\) {unexpected} 'tokens'"):
        expected([], {"data": 8}, ("data",), tokens=B * T)
    with pytest.raises(TypeError, match=rf"train_step\(\) {unexpected} 'accum_steps'"):
        train_step(None, TX, None, {}, accum_steps=2)
    with pytest.raises(TypeError, match=r"jit_train_step\(\) takes 5 positional arguments but 6"):
        jit_train_step(None, TX, mesh, rules, None, {})


def test_a_run_spec_with_model_data_mesh_or_rules_is_refused_by_the_trainer(hybrid):
    mesh, _ = hybrid
    with pytest.raises(TypeError, match=r"Trainer\(\) got run= and model, mesh; give one") as err:
        Trainer(GPT, mesh=mesh, run=RunSpec(data=SPEC))
    assert "\n" not in str(err.value)


def test_the_simple_trainer_calls_do_not_warn_and_the_defaults_make_a_run(tmp_path, monkeypatch):
    """`Trainer(cfg, data)` (default mesh over all devices, rules "auto") and
    `Trainer(cfg, data, mesh=, rules=)` are not deprecated; the first one trains."""
    monkeypatch.chdir(tmp_path)  # the default run_dir, runs/default, lands here
    data = make_dataset(DataConfig(source="synthetic", seq_len=T, batch_size=B))
    gpt = dataclasses.replace(GPT, vocab_size=256)  # byte-level data
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        plain = Trainer(gpt, data)
        mesh = make_mesh("data=2,fsdp=2,tensor=2")
        Trainer(gpt, data, mesh=mesh, rules=mt.rules_for("fsdp", mesh))
    assert plain.mesh.devices.size == 8 and plain.run.mesh is plain.mesh
    assert plain.rules.name == mt.rules_for("auto", make_mesh()).name
    loop = TrainConfig(steps=2, eval_every=0, log_every=1, run_dir="", progress=False)
    history = Trainer(run=RunSpec(model=gpt, data=data, train=loop)).fit()
    assert [h["step"] for h in history] == [1, 2]
    assert all(np.isfinite(h["loss"]) for h in history)


def test_run_spec_is_frozen_and_replace_keeps_the_rest():
    run = RunSpec(model=GPT, data=SPEC, mesh={"data": 8})
    with pytest.raises(AttributeError):
        run.mesh = None
    other = run.replace(optim=OptimConfig(lr=1e-2))
    assert other.optim.lr == 1e-2 and other.model is GPT and other.mesh == {"data": 8}
    assert run.sizes == {"data": 8} and run.data_spec == SPEC
    assert run.resolved().rules.name == mt.rules_for("auto", {"data": 8}).name


def _param_counts():
    """(count, where) for every function in meshtrain/ (kernels/ apart): all parameters,
    *args and **kwargs one each, self and cls not counted."""
    root = pathlib.Path(mt.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                n -= bool(names) and names[0] in ("self", "cls")
                yield n, f"{path.relative_to(root.parent)}::{node.name}"


def test_at_most_two_functions_take_ten_or_more_parameters():
    wide = sorted(where for n, where in _param_counts() if n >= 10)
    assert len(wide) <= 2, wide
    run_readers = ("check_run", "compile_step", "inspect", "inspect_compiled", "train_step")
    run_readers += ("jit_train_step", "expected", "__init__")
    assert not [w for w in wide if w.rpartition("::")[2] in run_readers], wide


_ON_CPU = jax.default_backend() == "cpu"  # the GPU check runs this file with the GPU's default
_MOE_SUMMARY = dict(
    model=mt.models.MoEConfig(n_layers=2, d_model=32, n_heads=4, n_experts=4),
    mesh={"data": 4, "expert": 2},
)


@pytest.mark.parametrize(
    ("settings", "line", "says"),
    [
        pytest.param({}, "kernels:", "kernels: attention xla · norm xla · loss xla", id="kernels"),
        pytest.param(
            {"model": GPTConfig(attention_impl="auto")},
            "kernels:",
            "attention xla (auto: off a GPU)" if _ON_CPU else "(auto: ",
            id="attention-auto",
        ),
        pytest.param(
            {"precision": mt.Precision(policy="bf16")},
            "precision",
            "bfloat16 compute · float32 optimizer state",
            id="precision",
        ),
        pytest.param(
            {**_MOE_SUMMARY, "precision": mt.Precision(policy="bf16")},
            "precision",
            "experts float32 (on CPU, not bfloat16: XLA's CPU compiler aborts on the bfloat16 "
            "dispatch's backward)"
            if _ON_CPU
            else "experts bfloat16",
            id="moe-experts-on-cpu",
        ),
        pytest.param(
            {"model": GPTConfig(remat="save-dots")}, "memory:", "remat save-dots", id="remat"
        ),
        pytest.param(
            {"offload": mt.Offload(optimizer=True)},
            "memory:",
            "offload optimizer · the state in pinned_host memory",
            id="offload",
        ),
        pytest.param(
            {"data": DataSpec("lm", B, T, 64, packed=True)},
            "data",
            "packed documents",
            id="packing",
        ),
        pytest.param(
            {"train": TrainConfig(accum_steps=2)},
            "data",
            "gradient accumulation: 2 microbatches of 8 per step",
            id="accumulation",
        ),
        pytest.param(
            {"mesh": {"data": 4, "seq": 2}, "context_parallel": "ulysses"},
            "meshtrain ·",
            "strategy dp · context parallel ulysses over seq=2",
            id="context-parallel",
        ),
        pytest.param(
            {"mesh": {"pipe": 2, "data": 4}, "pipeline": mt.PipelineConfig(schedule="zb-h1")},
            "pipeline",
            "pipeline zb-h1 · 2 stages · 4 microbatches",
            id="pipeline",
        ),
        pytest.param(
            {"sync": mt.SyncConfig(sync_every=4)},
            "replicas:",
            "replicas: 8 over data · local SGD",
            id="local-sgd",
        ),
        pytest.param(
            {**_MOE_SUMMARY, "sync": mt.SyncConfig(sync_every=4)},
            "replicas:",
            "replicas: dense weights over 8 (data × expert), expert weights over 4 (data)",
            id="local-sgd-beside-experts",
        ),
        pytest.param(
            {**_MOE_SUMMARY, "sync": mt.SyncConfig(sync_every=4, client_fraction=0.5)},
            "replicas:",
            "replicas: 4 clients over data (each with its expert devices) · federated",
            id="federated-beside-experts",
        ),
    ],
)
def test_the_run_summary_names_what_each_part_resolves_to(settings, line, says):
    settings = {"model": GPT, "data": SPEC, "mesh": {"data": 8}, **settings}
    context = settings.pop("context_parallel", "ring")
    settings["rules"] = mt.rules_for("dp", settings["mesh"], context_parallel=context)
    lines = RunSpec(**settings).summary()
    found = [x for x in lines if x.startswith(line)]
    assert len(found) == 1 and says in found[0], "\n".join(lines)
