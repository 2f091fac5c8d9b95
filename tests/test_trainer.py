"""Tests for meshtrain.train.trainer: the fit loop, its metrics, equivalence across meshes,
validation before compiling, user-provided models and sampling."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtrain import metrics as mx
from meshtrain.data import DataConfig, make_arrays_dataset, make_dataset
from meshtrain.layout import rules_for
from meshtrain.mesh import make_mesh
from meshtrain.models import GPTConfig, MLPConfig
from meshtrain.optim import OptimConfig
from meshtrain.run import RunSpec
from meshtrain.train import trainer as trainer_mod
from meshtrain.train.trainer import TrainConfig, Trainer

HYBRID = "data=2,fsdp=2,tensor=2"
GPT = GPTConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
SEQ, BATCH = 32, 16
OPTIM = OptimConfig(lr=1e-2, warmup_steps=2)
# Rates are recorded from the second logged step on: the first step's time is mostly compiling.
RATE_KEYS = ("step_time", "tokens_per_s", "tflops_per_device", "mfu")


def _lm_data(**kw):
    """Synthetic byte-level LM data, small enough for CPU tests."""
    return make_dataset(DataConfig(source="synthetic", seq_len=SEQ, batch_size=BATCH, **kw))


def _loop(run_dir="", **kw):
    """A quiet TrainConfig that logs every step."""
    kw = {"eval_every": 0, "log_every": 1, **kw}
    return TrainConfig(run_dir=str(run_dir), progress=False, **kw)


def _trainer(model=GPT, data=None, mesh=HYBRID, strategy="fsdp+tp", optim=OPTIM, **kw):
    """A Trainer on a named mesh with preset rules; `kw` go to TrainConfig (or the Trainer)."""
    mesh = make_mesh(mesh) if isinstance(mesh, str) else mesh
    extra = {k: kw.pop(k) for k in ("flops_per_token",) if k in kw}
    run = RunSpec(
        model=model,
        data=_lm_data() if data is None else data,
        mesh=mesh,
        rules=rules_for(strategy, mesh),
        optim=optim,
        train=_loop(**kw),
    )
    return Trainer(run=run, **extra)


def _losses(history):
    """The training losses of a history, in step order."""
    return [e["loss"] for e in history]


def test_fit_hybrid_mesh_logs_metrics_and_learns(tmp_path):
    steps = 24
    # A stale file from an earlier run: a new run (from step 0) starts it afresh.
    (tmp_path / "metrics.jsonl").write_text('{"step": 999, "split": "train", "loss": 9.0}\n')
    trainer = _trainer(run_dir=tmp_path, steps=steps)
    history = trainer.fit()

    # One entry per step (log_every=1), steps 1..steps in order.
    assert [e["step"] for e in history] == list(range(1, steps + 1))
    losses = _losses(history)
    assert all(math.isfinite(x) for x in losses)
    # Loss of a byte model starts near ln(256) = 5.55 and must fall clearly.
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)
    assert np.mean(losses[-3:]) < losses[0] - 1.0, losses
    for e in history:
        assert {"loss", "grad_norm", "lr"} <= e.keys(), e
        assert e["grad_norm"] > 0 and e["lr"] >= 0
    for e in history[1:]:
        assert set(RATE_KEYS) <= e.keys(), e
        assert e["step_time"] > 0 and e["tokens_per_s"] > 0 and e["tflops_per_device"] > 0
        assert e["mfu"] is None  # no known peak FLOP/s for a CPU
    # The learning rate warms up (lr/2, then exactly lr over warmup_steps=2), then decays to
    # exactly lr · min_lr_ratio at the last step.
    lrs = [e["lr"] for e in history]
    assert lrs[0] == pytest.approx(OPTIM.lr / 2, rel=1e-6)
    assert lrs[1] == max(lrs) == np.float32(OPTIM.lr)
    assert all(a > b for a, b in zip(lrs[1:], lrs[2:], strict=False))
    assert lrs[-1] == np.float32(OPTIM.lr * OPTIM.min_lr_ratio)
    # Evaluation at the end (eval_every=0) only.
    assert "eval_loss" in history[-1] and math.isfinite(history[-1]["eval_loss"])
    assert all("eval_loss" not in e for e in history[:-1])
    assert history[-1]["eval_loss"] < losses[0] - 1.0

    lines = mx.read_jsonl(tmp_path / "metrics.jsonl")
    train = [r for r in lines if r["split"] == "train"]
    evals = [r for r in lines if r["split"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert [r["loss"] for r in train] == pytest.approx(losses, rel=1e-6)
    assert [r["step"] for r in evals] == [steps]
    assert evals[0]["loss"] == pytest.approx(history[-1]["eval_loss"], rel=1e-6)
    assert int(jax.device_get(trainer.state.step)) == steps


def test_throughput_and_tflops_are_consistent():
    trainer = _trainer(steps=6, eval_every=2)
    history = trainer.fit()
    assert [e["step"] for e in history if "eval_loss" in e] == [2, 4, 6]
    # No rate for the first step (compiling), nor for a step that ran while the host was
    # evaluating (its time would include the evaluation).
    assert [e["step"] for e in history if "step_time" in e] == [2, 4, 6]
    n_devices = trainer.mesh.devices.size
    assert n_devices == 8
    assert trainer.tokens_per_step == BATCH * SEQ
    flops_per_token = GPT.flops_per_token(SEQ)
    assert trainer.flops_per_token == flops_per_token
    for e in history[1::2]:
        dt = e["step_time"]
        assert e["tokens_per_s"] == pytest.approx(BATCH * SEQ / dt, rel=1e-9)
        want = flops_per_token * BATCH * SEQ / dt / n_devices / 1e12
        assert e["tflops_per_device"] == pytest.approx(want, rel=1e-9)


def test_mlp_classifier_trains_on_arrays():
    rng = np.random.default_rng(0)
    n, features, classes = 768, 16, 4
    x = rng.normal(size=(n, features)).astype(np.float32)
    w = rng.normal(size=(features, classes))
    y = np.argmax(x @ w, axis=1)  # linearly separable by construction
    data = make_arrays_dataset(x, y, batch_size=32, seed=0, val_fraction=0.125)
    assert data.kind == "classify" and data.vocab_size == classes
    cfg = MLPConfig(num_features=features, num_classes=classes, d_model=32, d_hidden=64)
    trainer = _trainer(cfg, data, steps=30, optim=OptimConfig(lr=1e-2, warmup_steps=2))
    history = trainer.fit()
    losses = _losses(history)
    assert losses[0] == pytest.approx(math.log(classes), abs=0.2)
    assert np.mean(losses[-3:]) < 0.6 * losses[0], losses
    assert history[-1]["eval_loss"] < 0.6 * losses[0]
    # Examples, not tokens, for a classifier.
    assert trainer.tokens_per_step == 32
    assert trainer.flops_per_token == cfg.flops_per_token()


@pytest.mark.slow
def test_loss_sequence_same_on_dp_and_hybrid_meshes():
    """Same seed and data: pure data parallel on data=8 and fsdp+tp on 2×2×2 agree.

    Tolerance: float32 with a different reduction order: 5e-6 relative on the losses and
    1e-5 on the gradient norms after 8 AdamW steps (observed: ~1e-7).
    """
    steps = 8
    data = _lm_data(val_fraction=0)  # no held-out data: no evaluation to compile
    dp = _trainer(data=data, mesh="data=8", strategy="dp", steps=steps).fit()
    hybrid = _trainer(data=data, mesh=HYBRID, strategy="fsdp+tp", steps=steps).fit()
    assert len(dp) == len(hybrid) == steps
    np.testing.assert_allclose(_losses(dp), _losses(hybrid), rtol=5e-6, atol=0)
    np.testing.assert_allclose(
        [e["grad_norm"] for e in dp], [e["grad_norm"] for e in hybrid], rtol=1e-5
    )
    # Training actually moved the parameters (the comparison is not of two idle runs).
    assert _losses(dp)[-1] < _losses(dp)[0] - 0.3


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: TrainConfig(steps=0), "steps=0"),
        (lambda: TrainConfig(steps=-1), "steps=-1"),
        (lambda: OptimConfig(lr=0), "lr=0"),
        (lambda: OptimConfig(lr=-1e-3), "lr=-0.001"),
    ],
)
def test_bad_config_values_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _classify_data():
    """A small classification dataset."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    return make_arrays_dataset(x, rng.integers(0, 3, 64), batch_size=16)


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("batch_not_divisible", r"batch_size=6: .*data × fsdp = 4"),
        ("batch_not_divisible_by_accum", r"batch_size=16: .*accum_steps=8"),
        ("pipe_without_gpt", r"pipe=2: .*cannot be pipelined.*set pipe=1"),
        ("pipe_layers", r"layers=2: not divisible by pipe × repeats = 4"),
        ("expert", r"expert=2: .*set expert=1"),
        ("gpt_on_classify_data", r"gpt needs token data.*'classify'"),
        ("seq_len_too_long", r"seq_len=64: exceeds .*max_seq_len=32"),
    ],
)
def test_bad_combinations_raise_before_compiling(monkeypatch, case, match):
    def compiled(*args, **kwargs):
        raise AssertionError("the Trainer began building/compiling before validating")

    monkeypatch.setattr(trainer_mod, "init_train_state", compiled)
    monkeypatch.setattr(trainer_mod, "jit_train_step", compiled)
    kw = {}
    if case == "batch_not_divisible":
        kw["data"] = make_dataset(DataConfig(source="synthetic", seq_len=SEQ, batch_size=6))
    elif case == "batch_not_divisible_by_accum":
        kw["accum_steps"] = 8
    elif case == "pipe_without_gpt":
        kw.update(mesh="pipe=2,data=4", strategy="fsdp", data=_classify_data())
        kw["model"] = MLPConfig(num_features=8, num_classes=3)
    elif case == "pipe_layers":
        kw.update(mesh="pipe=4,data=2", strategy="fsdp")
    elif case == "expert":
        kw["mesh"] = "expert=2,data=4"
        kw["strategy"] = "fsdp"
    elif case == "gpt_on_classify_data":
        kw["data"] = _classify_data()
    elif case == "seq_len_too_long":
        kw["data"] = make_dataset(DataConfig(source="synthetic", seq_len=64, batch_size=BATCH))
    with pytest.raises(ValueError, match=match):
        _trainer(steps=2, **kw)


def _named(names, std=0.02):
    """A normal initialiser carrying logical axis names."""
    return nnx.with_partitioning(nnx.initializers.normal(std), names)


class BigramLM(nnx.Module):
    """A user model: token embedding and output head, annotated with logical names; with
    `extra`, it also has a parameter without names."""

    def __init__(self, *, extra: bool = False, seed: int = 0):
        rngs = nnx.Rngs(params=seed)
        self.embed = nnx.Embed(256, 32, embedding_init=_named(("vocab", "embed")), rngs=rngs)
        self.head = nnx.Linear(
            32, 256, use_bias=False, kernel_init=_named(("embed", "vocab")), rngs=rngs
        )
        self.shift = nnx.Param(jnp.zeros((32,))) if extra else None

    def __call__(self, tokens_BT):
        x_BTD = self.embed(tokens_BT)
        if self.shift is not None:
            x_BTD = x_BTD + self.shift
        return self.head(x_BTD)


def _meshtrain_warnings(record):
    """The warnings meshtrain raised about parameters without logical names."""
    return [str(w.message) for w in record if "no logical axis names" in str(w.message)]


def test_user_model_trains():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        optim = OptimConfig(lr=0.1, warmup_steps=2)
        trainer = _trainer(BigramLM, steps=20, optim=optim, flops_per_token=None)
        history = trainer.fit()
    assert _meshtrain_warnings(record) == []
    losses = _losses(history)
    assert np.mean(losses[-3:]) < losses[0] - 1.0, losses
    assert trainer.flops_per_token is None
    for e in history[1:]:
        assert e["tokens_per_s"] > 0
        assert "tflops_per_device" not in e and "mfu" not in e
    # The annotated parameters are sharded by the rules (vocab over tensor, embed over fsdp).
    spec = trainer.state.params["head"]["kernel"].sharding.spec
    assert tuple(spec) == (("data", "fsdp"), "tensor")


def test_user_model_with_unnamed_parameter_warns_once():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = _trainer(lambda: BigramLM(extra=True), steps=2, flops_per_token=None)
    found = _meshtrain_warnings(record)
    assert len(found) == 1, found
    assert "shift" in found[0]
    assert "embed" not in found[0] and "head" not in found[0]
    # The unnamed parameter is replicated.
    assert trainer.state.params["shift"].sharding.is_fully_replicated


def test_generate_continues_the_prompt():
    trainer = _trainer(steps=1)
    prompt = "def "
    text = trainer.generate(prompt, n_new=8, seed=0)
    assert isinstance(text, str)
    assert text.startswith(prompt)
    assert len(text.encode("utf-8", errors="surrogatepass")) >= len(prompt)
    assert trainer.generate(prompt, n_new=8, seed=0) == text  # deterministic given the seed


def test_the_trainer_logs_the_run_summary_through_logging_and_can_be_silenced(caplog):
    import logging

    log = logging.getLogger("meshtrain")
    with caplog.at_level(logging.INFO, logger="meshtrain"):
        trainer = _trainer(steps=1, accum_steps=2)
    logged = [r.getMessage() for r in caplog.records if r.name == "meshtrain"]
    assert logged == trainer.summary, logged
    n_params = sum(x.size for x in jax.tree.leaves(trainer.state.params))
    assert logged == trainer.run.summary(n_params=n_params)
    assert logged[0].startswith("meshtrain · mesh data=2 × fsdp=2 × tensor=2")
    assert "strategy fsdp+tp" in logged[0]
    assert any(line.startswith("kernels: attention xla") for line in logged)
    assert any("gradient accumulation: 2 microbatches of 8 per step" in x for x in logged)
    caplog.clear()
    level = log.level
    try:
        log.setLevel(logging.WARNING)  # a library user silences it
        _trainer(steps=1)
    finally:
        log.setLevel(level)
    assert not [r for r in caplog.records if r.name == "meshtrain"]
