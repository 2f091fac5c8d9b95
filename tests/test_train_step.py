"""Tests for meshtrain.train.step and .optim: every layout against a single-device reference,
gradient accumulation, mixed precision, and config validation.

All runs are float32 unless stated. Inputs are fresh random batches from seeded numpy.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import model_from
from flax import nnx

from meshtrain import layout as S
from meshtrain.data import DataConfig, make_dataset
from meshtrain.layout import batch_shardings
from meshtrain.lower import (
    RunSpec,
    cross_entropy,
    init_train_state,
    jit_train_step,
    make_optimizer,
)
from meshtrain.mesh import make_mesh
from meshtrain.models import GPTConfig, MLPConfig, build_model
from meshtrain.train import OptimConfig, TrainConfig

B, T, STEPS = 16, 16, 3
LR = 1e-3
TX = make_optimizer(OptimConfig(lr=LR, warmup_steps=0), 10)  # AdamW, clipping at 1.0

MODELS = {
    # MHA (4 kv heads): splits over tensor=4
    "gpt2": GPTConfig(style="gpt2", n_layers=2, d_model=64, n_heads=4, max_seq_len=T),
    # GQA with 2 kv heads: splits over tensor=2
    "llama": GPTConfig(
        style="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, max_seq_len=T
    ),
    "mlp": MLPConfig(num_features=16, num_classes=10, d_model=64, d_hidden=128, n_layers=2),
    # Uneven under tensor=4: GPT-2's vocabulary (50257, padded to 50304 rows), tied as GPT-2
    # is; small elsewhere, since the vocabulary is what matters.
    "gpt2-vocab50257": GPTConfig(
        style="gpt2", vocab_size=50257, n_layers=1, d_model=32, n_heads=4, max_seq_len=T,
        tie_embeddings=True,
    ),
    # 8 query heads, 2 kv heads (replicated over tensor=4); an odd vocabulary (1000 → 1024), untied.
    "llama-8q-2kv": GPTConfig(
        style="llama", vocab_size=1000, n_layers=2, d_model=64, n_heads=8, n_kv_heads=2,
        max_seq_len=T,
    ),
}  # fmt: skip

# Tolerances for the fp32 equivalence runs (3 AdamW steps at lr=1e-3, max over all layouts):
LOSS_ATOL = 1e-5  # measured ≤ 1.9e-6 (4 ulps) on losses ≈ 5.5: sums in another order
GRAD_NORM_RTOL = 1e-5  # measured ≤ 1e-7 relative; a gradient scaled by (n-1)/n fails it
# Adam divides by √v, so an element whose gradient is nearly 0 turns rounding noise into a
# visible step; measured ≤ 8.3e-6 (llama, tp). A wrong update (e.g. a missing shard's
# gradient) moves elements by up to lr = 1e-3 per step; 5e-5 is 5% of one step.
PARAM_ATOL = 5e-5


@dataclasses.dataclass
class Run:
    """What a short training run leaves behind, as host numpy."""

    params0: dict
    params: dict
    loss: np.ndarray
    grad_norm: np.ndarray
    steps: int


def flat(tree) -> dict[str, np.ndarray]:
    """{'a/b/c': numpy leaf} for a nested dict of arrays."""
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


@functools.cache
def initial_values(config) -> dict:
    """The model's seed-0 initial variables, as a nested dict of numpy arrays (computed once)."""
    state = jax.jit(lambda: nnx.to_pure_dict(nnx.state(build_model(config))))()
    return jax.tree.map(np.asarray, state)


def start_from(config):
    """A constructor for `config` whose parameters are `initial_values(config)`.

    Every run in this file starts from these values without re-running the random initialisers
    under each layout (that costs a compile per layout; test_sharding checks that sharded
    initialisation reproduces them).
    """
    values = initial_values(dataclasses.replace(config, dtype="float32"))

    return model_from(config, values)


@functools.cache
def batches(model: str, n: int = STEPS, seed: int = 0, rows: int = B) -> tuple[dict, ...]:
    """`n` fresh random batches for `model` from seeded numpy."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if model == "mlp":
            cfg = MODELS["mlp"]
            inputs = rng.normal(size=(rows, cfg.num_features)).astype(np.float32)
            out.append(
                {"inputs": inputs, "targets": rng.integers(0, cfg.num_classes, rows, np.int32)}
            )
        else:
            tokens = rng.integers(0, MODELS[model].vocab_size, (rows, T + 1), np.int32)
            out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return tuple(out)


def run(model, mesh_str, strategy, data, *, tx=TX, accum=1, devices=None) -> Run:
    """Trains `model` one step per batch of `data` under a layout; returns host copies."""
    mesh = make_mesh(mesh_str, devices=devices)
    rules = S.rules_for(strategy, mesh)
    graphdef, state, shardings = init_train_state(start_from(MODELS[model]), tx, mesh, rules)
    params0 = flat(state.params)
    step = jit_train_step(
        RunSpec(mesh=mesh, rules=rules, train=TrainConfig(accum_steps=accum)),
        graphdef,
        tx,
        shardings,
        batch_shardings(data[0], mesh, rules),
    )
    metrics = []
    for batch in data:
        state, m = step(state, S.shard_batch(batch, mesh, rules))
        metrics.append(m)
    return Run(
        params0=params0,
        params=flat(state.params),
        loss=np.array([float(m["loss"]) for m in metrics]),
        grad_norm=np.array([float(m["grad_norm"]) for m in metrics]),
        steps=int(state.step),
    )


@functools.cache
def reference(model: str) -> Run:
    """The plain single-device run every layout is checked against."""
    return run(model, "data=1", "dp", batches(model), devices=jax.devices()[:1])


def assert_same_run(got: Run, want: Run, *, loss_atol, grad_norm_rtol, param_atol):
    assert got.steps == want.steps
    assert set(got.params) == set(want.params)
    for path in want.params0:  # same initialisation, sharded or not
        np.testing.assert_array_equal(got.params0[path], want.params0[path], err_msg=path)
    np.testing.assert_allclose(got.loss, want.loss, rtol=0, atol=loss_atol)
    np.testing.assert_allclose(got.grad_norm, want.grad_norm, rtol=grad_norm_rtol)
    for path in want.params:
        np.testing.assert_allclose(
            got.params[path], want.params[path], rtol=0, atol=param_atol, err_msg=path
        )


# --- equivalence --------------------------------------------------------------------------

slow = pytest.mark.slow
# Each strategy with GPT-2's parameters (biases, LayerNorm, MHA); the llama style (RMSNorm,
# GQA, no biases) where its own leaves split differently: fsdp and tp. The llama style under
# dp, zero1, fsdp+tp and hsdp+tp is proven by tests/test_composition_cover.py, whose GPT is
# a llama, beside more features.
EQUIVALENCE = [
    ("gpt2", "data=8", "dp"),
    ("gpt2", "fsdp=8", "fsdp"),
    ("llama", "data=8", "fsdp"),
    ("gpt2", "data=8", "zero1"),
    ("gpt2", "data=2,tensor=4", "tp"),
    ("llama", "data=4,tensor=2", "tp"),
    pytest.param("gpt2", "data=2,fsdp=2,tensor=2", "fsdp+tp", marks=slow),
    pytest.param("gpt2", "data=2,fsdp=2,tensor=2", "hsdp+tp", marks=slow),
    ("mlp", "data=8", "dp"),
    ("mlp", "data=2,fsdp=4", "fsdp"),
    ("mlp", "data=4,tensor=2", "zero1+tp"),
]


@pytest.mark.parametrize("model, mesh_str, strategy", EQUIVALENCE)
@pytest.mark.pair("dp", "tp")
@pytest.mark.pair("fsdp", "tp")
@pytest.mark.pair("hsdp", "tp")
@pytest.mark.pair("zero1", "tp")
def test_layout_matches_single_device(model, mesh_str, strategy):
    got = run(model, mesh_str, strategy, batches(model))
    assert_same_run(
        got,
        reference(model),
        loss_atol=LOSS_ATOL,
        grad_norm_rtol=GRAD_NORM_RTOL,
        param_atol=PARAM_ATOL,
    )


@pytest.mark.parametrize(
    "model, strategy", [("gpt2-vocab50257", "fsdp+tp"), ("llama-8q-2kv", "tp")]
)
def test_uneven_dimensions_on_tensor4_match_single_device(model, strategy):
    """A vocabulary that tensor=4 does not divide (padded) and fewer kv heads than tensor=4
    (replicated) train as on one device; the padded rows stay exactly zero in both runs."""
    got = run(model, "data=2,tensor=4", strategy, batches(model))
    want = reference(model)
    assert_same_run(
        got, want, loss_atol=LOSS_ATOL, grad_norm_rtol=GRAD_NORM_RTOL, param_atol=PARAM_ATOL
    )
    V = MODELS[model].vocab_size
    for r in (got, want):
        assert r.params["embed/embedding"].shape[0] == MODELS[model].padded_vocab
        assert np.all(r.params["embed/embedding"][V:] == 0)
        assert np.all(r.params.get("head/kernel", np.zeros((1, V + 1)))[:, V:] == 0)


@pytest.mark.parametrize("model", ["gpt2", "llama", "mlp", "gpt2-vocab50257", "llama-8q-2kv"])
def test_reference_moves_params_far_beyond_the_tolerance(model):
    """Guards the equivalence tests against passing vacuously."""
    ref = reference(model)
    moved = max(np.abs(ref.params[p] - ref.params0[p]).max() for p in ref.params)
    assert moved > 20 * PARAM_ATOL
    assert np.all(np.isfinite(ref.loss)) and ref.steps == STEPS


# --- gradient accumulation ----------------------------------------------------------------

# Plain SGD (no momentum, decay or clipping) makes the update exactly -lr · grad, so it is
# sensitive to the scale of the gradient (Adam would hide a sum-instead-of-mean).
ACC_LR = 1.0
ACC_TX = make_optimizer(
    OptimConfig(
        optimizer="sgd",
        lr=ACC_LR,
        momentum=0.0,
        weight_decay=0.0,
        clip_norm=0.0,
        warmup_steps=0,
    ),
    10,
)
ACC_MESH, ACC_STRATEGY = "data=2,fsdp=2,tensor=2", "fsdp+tp"  # 16 rows → 4 per batch shard
# fp32, on the parameter updates (up to 2.6e-2 per element): measured ≤ 7.5e-9 between
# k = 1, 2, 4 and ≤ 5.9e-8 against the single-device microbatch average.
ACC_ATOL = 1e-6
# Losses ≈ 5.5, where one fp32 ulp is 4.8e-7: measured ≤ 1 ulp (0 between k = 1, 2, 4).
ACC_LOSS_ATOL = 2e-6


@functools.cache
def accum_run(k: int) -> Run:
    return run("llama", ACC_MESH, ACC_STRATEGY, batches("llama", 1, seed=1), tx=ACC_TX, accum=k)


def update(r: Run, path: str) -> np.ndarray:
    return r.params[path] - r.params0[path]


@slow
@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_equals_one_full_batch_step(k):
    got, want = accum_run(k), accum_run(1)
    np.testing.assert_allclose(got.loss, want.loss, rtol=0, atol=ACC_LOSS_ATOL)
    np.testing.assert_allclose(got.grad_norm, want.grad_norm, rtol=1e-5)
    for path in want.params:
        np.testing.assert_allclose(update(got, path), update(want, path), atol=ACC_ATOL)


@functools.cache
def microbatch_grads(rows: int):
    """Single-device (loss, grads) of the llama model on each contiguous chunk of `rows`."""
    graphdef, params, rest = nnx.split(start_from(MODELS["llama"])(), nnx.Param, ...)

    @jax.jit
    def loss_and_grad(params, inputs, targets):
        def loss(p):
            return cross_entropy(nnx.merge(graphdef, p, rest)(inputs), targets)

        return jax.value_and_grad(loss)(params)

    (batch,) = batches("llama", 1, seed=1)
    out = []
    for start in range(0, B, rows):
        chunk = slice(start, start + rows)
        loss, grads = loss_and_grad(params, batch["inputs"][chunk], batch["targets"][chunk])
        out.append((float(loss), flat(nnx.to_pure_dict(grads))))
    return out


@slow
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.pair("fsdp", "accumulation")
@pytest.mark.pair("tp", "accumulation")
def test_accumulation_averages_the_microbatch_gradients(k):
    """The accumulated step applies the mean of the k microbatch gradients (and reports the mean
    loss), computed here independently, one chunk at a time on one device."""
    parts = microbatch_grads(B // k)
    assert len(parts) == k
    got = accum_run(k)
    np.testing.assert_allclose(
        got.loss[0], np.mean([loss for loss, _ in parts]), atol=ACC_LOSS_ATOL
    )
    for path in got.params:
        mean_grad = np.mean([grads[path] for _, grads in parts], axis=0)
        np.testing.assert_allclose(update(got, path), -ACC_LR * mean_grad, atol=ACC_ATOL)
    # a sum instead of a mean would be k times larger: far outside the tolerance
    biggest = max(np.abs(update(got, p)).max() for p in got.params)
    assert biggest > 100 * ACC_ATOL


@pytest.mark.parametrize(
    "k, match",
    [
        (3, r"batch\['inputs'\] has 16 rows, not divisible by accum_steps=3"),
        (0, r"accum_steps=0: must be"),  # refused by TrainConfig, before the step is built
    ],
)
def test_bad_accumulation_steps_are_rejected_while_tracing(k, match):
    mesh = make_mesh("data=8")
    rules = S.rules_for("dp", mesh)
    graphdef, state, shardings = init_train_state(start_from(MODELS["mlp"]), TX, mesh, rules)
    (batch,) = batches("mlp", 1)
    with pytest.raises(ValueError, match=match):
        step = jit_train_step(
            RunSpec(mesh=mesh, rules=rules, train=TrainConfig(accum_steps=k)),
            graphdef,
            TX,
            shardings,
            batch_shardings(batch, mesh, rules),
        )
        step.trace(state, S.shard_batch(batch, mesh, rules))


# --- mixed precision ----------------------------------------------------------------------

MP_STEPS, MP_LR = 50, 5e-3
# Final loss = mean of the last 10 steps (the same batches for both runs). Measured over data
# seeds 0, 1, 3: fp32 1.59-1.78 nats (from ≈5.55), |bf16 - fp32| ≤ 0.008 nats. (At lr=1e-2 the
# two trajectories drift apart chaotically, by up to 0.09 nats, so the test avoids it.)
MP_MARGIN = 0.05  # nats, ≈3% of the final loss


@functools.cache
def char_lm_batches() -> list[dict]:
    data = make_dataset(DataConfig(source="synthetic", seq_len=32, batch_size=16, seed=3))
    it = data.train_iter()
    return [next(it) for _ in range(MP_STEPS)]


def char_lm_setup(dtype: str):
    """(state, jitted step, mesh, rules) of a small char-LM computing in `dtype`, on one device:
    what is compared is the arithmetic, and each layout's bf16 step is checked against its
    one-device run in tests/test_precision.py (50 steps on 8 simulated devices cost 3× more)."""
    cfg = dataclasses.replace(MODELS["llama"], max_seq_len=32, dtype=dtype)
    tx = make_optimizer(OptimConfig(lr=MP_LR, warmup_steps=5), MP_STEPS)
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    rules = S.rules_for("dp", mesh)
    graphdef, state, shardings = init_train_state(start_from(cfg), tx, mesh, rules)
    batch_sh = batch_shardings(char_lm_batches()[0], mesh, rules)
    step = jit_train_step(RunSpec(mesh=mesh, rules=rules), graphdef, tx, shardings, batch_sh)
    return state, step, mesh, rules


def floating_dtypes(tree) -> set:
    return {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


@functools.cache
def char_lm_losses(dtype: str):
    """Per-step losses of MP_STEPS steps, and the dtypes of the trained params."""
    state, step, mesh, rules = char_lm_setup(dtype)
    losses = []
    for batch in char_lm_batches():
        state, metrics = step(state, S.shard_batch(batch, mesh, rules))
        losses.append(float(metrics["loss"]))
    return np.array(losses), floating_dtypes(state.params)


def test_bf16_compute_keeps_fp32_params_and_optimizer_state():
    batch = char_lm_batches()[0]
    hlo = {}
    for dtype in ("bfloat16", "float32"):
        state, step, mesh, rules = char_lm_setup(dtype)
        assert floating_dtypes(state.params) == {np.dtype("float32")}
        assert floating_dtypes(state.opt_state) == {np.dtype("float32")}
        hlo[dtype] = step.lower(state, S.shard_batch(batch, mesh, rules)).as_text()
    assert "bf16" in hlo["bfloat16"]  # the matmuls really run in bfloat16 ...
    assert "bf16" not in hlo["float32"]  # ... and only when asked


@slow
def test_bf16_trains_like_fp32():
    fp32, fp32_dtypes = char_lm_losses("float32")
    bf16, bf16_dtypes = char_lm_losses("bfloat16")
    assert fp32_dtypes == bf16_dtypes == {np.dtype("float32")}  # master weights stay fp32
    assert not np.array_equal(fp32, bf16)
    for losses in (fp32, bf16):
        assert np.all(np.isfinite(losses))
        assert losses[-10:].mean() < 0.4 * losses[0]  # ≈ 5.55 → ≈ 1.6 nats
    assert abs(bf16[-10:].mean() - fp32[-10:].mean()) < MP_MARGIN


# --- optimizer config validation ----------------------------------------------------------


@pytest.mark.parametrize("lr", [0, 0.0, -1e-3])
def test_non_positive_lr_is_rejected(lr):
    with pytest.raises(ValueError, match=rf"lr={lr}: must be a number > 0 \(the learning rate\)"):
        OptimConfig(lr=lr)


def test_unknown_optimizer_is_rejected():
    with pytest.raises(ValueError, match=r"optimizer='adam': choose from adamw, lamb"):
        OptimConfig(optimizer="adam")


@pytest.mark.parametrize("optimizer", ["adamw", "lamb", "lars", "sgd"])
def test_every_optimizer_updates_params(optimizer):
    tx = make_optimizer(OptimConfig(optimizer=optimizer, lr=0.1, warmup_steps=0), 10)
    params = {"w": {"kernel": np.ones((4, 4), np.float32)}, "b": {"bias": np.ones(4, np.float32)}}
    grads = jax.tree.map(np.ones_like, params)

    @jax.jit  # one program, not one per eager operation
    def updated(params, grads):
        return optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])

    new = updated(params, grads)
    # descends along the gradient (LARS scales its step by a 1e-3 trust coefficient)
    assert np.asarray(new["w"]["kernel"]).max() < 1 - 1e-5


def test_a_batch_that_does_not_divide_is_a_clear_error_in_the_lower_api():
    """Feeding the jitted step a batch of the wrong row count names the rows and the fix
    (jax alone raises its internal IndivisibleError)."""
    mesh = make_mesh("data=8")
    rules = S.rules_for("dp", mesh)
    graphdef, state, shardings = init_train_state(start_from(MODELS["mlp"]), TX, mesh, rules)
    (batch,) = batches("mlp", 1)
    batch_sh = batch_shardings(batch, mesh, rules)
    step = jit_train_step(RunSpec(mesh=mesh, rules=rules), graphdef, TX, shardings, batch_sh)
    short = {k: v[:12] for k, v in batch.items()}
    with pytest.raises(ValueError, match=r"batch\['inputs'\] has 12 rows, not divisible by the 8"):
        step(state, short)
    with pytest.raises(ValueError, match=r"batch has entries \['inputs'\] but the step was built"):
        step(state, {"inputs": batch["inputs"]})
