"""Precision policies: the policy itself, float16's dynamic loss scaling, fp8 matmuls with
current scaling, and each precision under sharded layouts against its own one-device run.

Tolerances, per precision (two SGD steps of lr 0.1 on a tiny GPT or MoE, as the composition
tests). float16 rounds each product to 2⁻¹¹ relative, and a layout that sums in another order
moves the losses by ~1e-5 and each leaf's update by ~0.1% (measured): held to 1e-4 and 1% in
relative Frobenius norm. fp8 rounds each gradient to e5m2 (2⁻³ relative), and a layout that
sums in another order moves some entries across a rounding boundary of that coarse grid: the
losses move by ~1e-4 and a leaf's update by up to ~7% (measured): held to 1e-3 and 12%.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import model_from, token_batches
from flax import nnx

from meshtrain.check import check_run
from meshtrain.checkpoint import CheckpointManager, restore
from meshtrain.layout import batch_shardings, rules_for, shard_batch
from meshtrain.lower import init_train_state, jit_train_step
from meshtrain.mesh import make_mesh, mesh_sizes
from meshtrain.models import CNNConfig, DataSpec, GPTConfig, MLPConfig, MoEConfig, build_model
from meshtrain.optim import OptimConfig
from meshtrain.pipeline import PipelineConfig
from meshtrain.precision import POLICIES, Precision, fp8, loss_scale, with_loss_scale
from meshtrain.problem import RunCheckError
from meshtrain.run import RunSpec, TrainConfig
from meshtrain.state import abstract_target

B, T = 16, 16
OPTIM = OptimConfig(
    optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=0.0, clip_norm=0.0, warmup_steps=0
)
GPT = GPTConfig(
    n_layers=4, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=T, vocab_size=64,
    vocab_multiple=16,
)  # fmt: skip
MOE = MoEConfig(
    d_model=32, n_heads=2, n_experts=4, top_k=2, d_expert=16, n_layers=2, vocab_size=64,
    vocab_multiple=16, max_seq_len=T, capacity_factor=4.0,
)  # fmt: skip
TOL = {"fp16": (1e-4, 1e-2), "fp8": (1e-3, 0.12)}  # (loss atol, update relative Frobenius)
SCALE = 2.0**10  # float16 runs below: a scale that does not overflow this model


# ---- the policy -----------------------------------------------------------------------------


def test_each_policy_sets_the_model_dtypes_and_says_so():
    for name, (compute, uses_fp8, scaled) in POLICIES.items():
        p = Precision(policy=name)
        cfg = p.applied(GPT)
        assert (cfg.dtype, cfg.fp8) == (compute, uses_fp8)
        assert p.loss_scaling(GPT) is scaled
        line = p.describe(GPT)
        assert line.startswith(f"precision {name} · float32 params · {compute} compute")
        assert ("dynamic loss scale from 32768" in line) is scaled
        assert ("fp8 dense matmuls" in line) is uses_fp8
    # auto reads the model's own fields: the older --gpt.dtype spelling keeps working
    auto = Precision()
    assert auto.resolved(GPT) == "fp32"
    assert auto.resolved(dataclasses.replace(GPT, dtype="bfloat16")) == "bf16"
    assert auto.resolved(dataclasses.replace(GPT, dtype="float16")) == "fp16"
    assert auto.resolved(dataclasses.replace(GPT, fp8=True)) == "fp8"
    assert Precision(policy="fp16", loss_scale="off").loss_scaling(GPT) is False


def _problems(precision: Precision, model) -> list[str]:
    run = RunSpec(
        model=model,
        data=DataSpec("lm", B, T, 64),
        mesh={"data": 1},
        precision=precision,
        train=TrainConfig(run_dir=""),
    )
    return [str(p) for p in check_run(run)]


@pytest.mark.parametrize(
    "make, field, words",
    [
        (lambda: Precision(policy="fp9"), "precision='fp9'", "choose from auto, fp32"),
        (lambda: Precision(policy="bf16", loss_scale="dynamic"), "loss_scale='dynamic'",
         "loss scaling is for fp16"),
        (lambda: Precision(loss_scale_init=1000.0), "loss_scale_init=1000.0", "power of two"),
        (lambda: Precision(loss_scale_period=0), "loss_scale_period=0", "positive integer"),
        (lambda: Precision(matmul_precision="tf32"), "matmul_precision='tf32'", "choose from"),
    ],
)  # fmt: skip
def test_bad_settings_are_one_line_naming_the_field(make, field, words):
    with pytest.raises(RunCheckError) as e:
        make()
    lines = str(e.value).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(field) and words in lines[0], lines


def test_a_policy_the_model_cannot_take_is_refused_by_the_run_check():
    cnn = CNNConfig()
    images = RunSpec(
        model=cnn,
        data=DataSpec("classify", 16, None, 10, num_features=64, image_shape=(8, 8, 1)),
        mesh={"data": 1},
        precision=Precision(policy="fp8"),
        train=TrainConfig(run_dir=""),
    )
    (line,) = [str(p) for p in check_run(images)]
    assert line.startswith("precision='fp8'") and "no fp8-capable layers" in line
    assert "use --precision bf16" in line
    (line,) = _problems(Precision(policy="fp16"), dataclasses.replace(GPT, dtype="bfloat16"))
    assert line.startswith("gpt.dtype='bfloat16'") and "drop --gpt.dtype" in line
    (line,) = _problems(Precision(policy="bf16"), dataclasses.replace(GPT, fp8=True))
    assert line.startswith("gpt.fp8=True") and "--precision fp8" in line
    # loss scaling asked for under auto on a bfloat16 model
    (line,) = _problems(Precision(loss_scale="dynamic"), dataclasses.replace(GPT, dtype="bfloat16"))
    assert line.startswith("loss_scale='dynamic'") and "precision bf16" in line
    assert _problems(Precision(policy="fp8"), MOE) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--precision", "fp9"], "precision='fp9': choose from auto, fp32, bf16, fp16, fp8"),
        (["--precision", "fp8", "--model", "cnn", "--data.source", "digits"],
         "no fp8-capable layers"),
        (["--precision", "bf16", "--loss-scale", "dynamic"], "loss scaling is for fp16"),
        (["--precision", "fp16", "--gpt.dtype", "bfloat16"], "drop --gpt.dtype"),
        (["--precision", "fp16", "--sync-every", "2", "--strategy", "dp"],
         "fp16 loss scaling with local SGD"),
        (["--precision", "fp16", "--gpt.attention-impl", "pallas", "--gpt.d-model", "128",
          "--gpt.n-heads", "2", "--gpt.n-kv-heads", "1"], "fp16 with the Pallas or cuDNN kernels"),
    ],
)  # fmt: skip
def test_the_cli_refuses_bad_precision_in_one_line(capsys, tmp_path, argv, message):
    from meshtrain import cli

    code = cli.main(["train", *argv, "--run-dir", str(tmp_path / "run"), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in out + err


# ---- training under a policy ------------------------------------------------------------------

_INIT: dict = {}


def _initial(cfg):
    """The model's initial float32 parameters on the host (the same for every layout)."""
    key = dataclasses.replace(cfg, dtype="float32", fp8=False)
    if key not in _INIT:
        state = jax.jit(lambda: nnx.to_pure_dict(nnx.state(build_model(key))))()
        _INIT[key] = jax.tree.map(np.asarray, state)
    return _INIT[key]


def _batches(n, vocab, seed=0):
    return token_batches(n, vocab, B, T, seed)


def _setup(
    model, precision, mesh_str="data=1", strategy="dp", *, devices=None, wrap=None, **run_kw
):
    """State, jitted step (taking host batches) and run of `model` under `precision` (one
    device unless `mesh_str` says otherwise)."""
    if devices is None and mesh_str == "data=1":
        devices = jax.devices()[:1]
    mesh = make_mesh(mesh_str, devices=devices)
    rules = rules_for(strategy, mesh, context_parallel=run_kw.pop("context", "ring"))
    run = RunSpec(
        model=model,
        data=DataSpec("lm", B, T, model.vocab_size),
        mesh=mesh,
        rules=rules,
        optim=OPTIM,
        precision=precision,
        train=TrainConfig(run_dir="", **run_kw.pop("train", {})),
        **run_kw,
    )
    assert check_run(run.replace(mesh=mesh_sizes(mesh))) == []
    cfg, values = run.model_config, _initial(model)

    tx = run.optimizer(10) if wrap is None else wrap(run.optimizer(10))
    graphdef, state, shardings = init_train_state(model_from(cfg, values), tx, mesh, rules)
    example = _batches(1, model.vocab_size)[0]
    step = jit_train_step(run, graphdef, tx, shardings, batch_shardings(example, mesh, rules))
    return state, shardings, (lambda s, b: step(s, shard_batch(b, mesh, rules))), run


def _train(state, step, batches):
    losses, metrics = [], []
    for b in batches:
        state, m = step(state, b)
        metrics.append(jax.device_get(m))
        losses.append(float(m["loss"]))
    return np.array(losses), metrics, state


def _host(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(tree))


def test_float16_trains_with_a_scaled_backward_equal_to_the_unscaled_math():
    """The scale changes no gradient: float32 compute with loss scaling (the scale in the
    optimizer state, as `meshtrain.precision.with_loss_scale` puts it there; the policy
    refuses it for fp32) gives the same parameters as without it (scales are powers of two:
    exact up to float32 rounding of the scaled backward)."""
    base = dataclasses.replace(GPT, n_layers=2)
    batches = _batches(2, base.vocab_size)
    plain, _, step = _setup(base, Precision(policy="fp32"))[:3]
    scaled, _, step_s = _setup(
        base, Precision(policy="fp32"), wrap=lambda tx: with_loss_scale(tx, SCALE)
    )[:3]
    assert loss_scale.state_of(scaled.opt_state) is not None
    want_loss, _, want = _train(plain, step, batches)
    got_loss, metrics, got = _train(scaled, step_s, batches)
    np.testing.assert_array_equal(got_loss, want_loss)
    for a, b in zip(jax.tree.leaves(_host(got.params)), jax.tree.leaves(_host(want.params)),
                    strict=True):  # fmt: skip
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)
    assert [int(m["overflow"]) for m in metrics] == [0, 0]
    assert float(metrics[-1]["loss_scale"]) == SCALE


def test_settle_halves_on_overflow_doubles_after_the_period_and_ignores_a_bad_step():
    """`loss_scale.settle`, the step's whole loss-scale bookkeeping, on each kind of step;
    the wrapped optimizer's state comes back as it went in."""
    inner = {"mu": jnp.arange(3.0)}
    state = loss_scale.LossScaleState(jnp.float32(1024), jnp.int32(2), inner)
    cases = {  # (loss, grad_norm) -> (overflow, scale, good_steps), with period 3
        "good, the third in a row": ((1.0, 2.0), (False, 2048, 0)),
        "overflow": ((1.0, np.inf), (True, 512, 0)),
        "bad step": ((np.nan, np.nan), (False, 1024, 2)),
        "bad loss only": ((np.inf, 2.0), (False, 1024, 2)),
    }
    for name, ((loss, norm), (want_overflow, want_scale, want_good)) in cases.items():
        got, overflow = loss_scale.settle(state, jnp.float32(loss), jnp.float32(norm), 3)
        assert bool(overflow) is want_overflow, name
        assert (float(got.scale), int(got.good_steps)) == (want_scale, want_good), name
        assert got.inner is inner, name
    floor = loss_scale.LossScaleState(jnp.float32(1), jnp.int32(0), inner)
    assert float(loss_scale.settle(floor, jnp.float32(1), jnp.float32(np.inf), 3)[0].scale) == 1


def test_overflow_skips_exactly_that_step_halves_the_scale_and_is_no_bad_step():
    """A scale of 2²⁴ overflows float16's backward (max 65504): each such step leaves the
    parameters and moments as they were, halves the scale and reports ``overflow`` (not
    ``skipped``); the first step that fits applies its update."""
    cfg = dataclasses.replace(GPT, n_layers=2)
    precision = Precision(policy="fp16", loss_scale_init=2.0**24, loss_scale_period=3)
    state, _, step, _ = _setup(cfg, precision)
    batches = _batches(24, cfg.vocab_size, seed=1)
    before = _host(state.params)
    scales, overflows, first_update = [], [], None
    for i, b in enumerate(batches):
        prev = _host(state.params)
        state, m = step(state, b)
        m = jax.device_get(m)
        assert int(m["skipped"]) == 0  # never counted as a bad step
        overflows.append(int(m["overflow"]))
        scales.append(float(m["loss_scale"]))
        moved = any(
            not np.array_equal(a, b)
            for a, b in zip(
                jax.tree.leaves(prev), jax.tree.leaves(_host(state.params)), strict=True
            )
        )
        assert moved != bool(m["overflow"]), f"step {i}: overflow={m['overflow']} moved={moved}"
        if not m["overflow"] and first_update is None:
            first_update = i
    assert first_update is not None and first_update >= 1, overflows
    # every overflow halved the scale; 3 good steps in a row doubled it
    scale = 2.0**24
    good = 0
    for over, got in zip(overflows, scales, strict=True):
        if over:
            scale, good = scale / 2, 0
        else:
            good += 1
            if good == 3:
                scale, good = scale * 2, 0
        assert got == scale
    assert sum(overflows) >= first_update
    assert not all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(before), jax.tree.leaves(_host(state.params)), strict=True))  # fmt: skip


def test_an_injected_overflow_skips_that_one_step(monkeypatch):
    """Gradients made infinite on one chosen batch (a loss whose backward overflows there):
    exactly that step is skipped and halves the scale; its neighbours train."""
    from meshtrain.loss import cross_entropy

    @jax.custom_vjp
    def blow_up(loss, flag):
        return loss

    blow_up.defvjp(
        lambda loss, flag: (loss, flag),
        lambda flag, g: (jnp.where(flag, jnp.inf, 1.0) * g, jnp.zeros_like(flag)),
    )

    def loss_fn(logits, targets):
        return blow_up(cross_entropy(logits, targets), (targets[0, 0] == 63).astype(jnp.float32))

    cfg = dataclasses.replace(GPT, n_layers=2)
    precision = Precision(policy="fp16", loss_scale_init=SCALE)
    state, _, step, _ = _setup(cfg, precision, loss_fn=loss_fn)
    batches = _batches(3, 60, seed=2)  # ids < 60: no batch is flagged by chance
    batches[1]["targets"][0, 0] = 63
    _, metrics, _ = _train(state, step, batches)
    assert [int(m["overflow"]) for m in metrics] == [0, 1, 0]
    assert [int(m["skipped"]) for m in metrics] == [0, 0, 0]
    assert [float(m["loss_scale"]) for m in metrics] == [SCALE, SCALE / 2, SCALE / 2]


def test_the_loss_scale_survives_a_checkpoint_bit_exact(tmp_path):
    cfg = dataclasses.replace(GPT, n_layers=2)
    precision = Precision(policy="fp16", loss_scale_init=2.0**4, loss_scale_period=2)
    state, shardings, step, _ = _setup(cfg, precision)
    _, _, state = _train(state, step, _batches(5, cfg.vocab_size, seed=3))
    saved = jax.device_get(state)
    scaler = loss_scale.state_of(saved.opt_state)
    assert (float(scaler.scale), int(scaler.good_steps)) == (2.0**6, 1)  # 5 good steps: ×2 twice
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(5, state)
    restored = restore(tmp_path / "ck", abstract_target(state, shardings)).state
    back = loss_scale.state_of(restored.opt_state)
    assert np.asarray(back.scale).tobytes() == np.asarray(scaler.scale).tobytes()
    assert int(back.good_steps) == int(scaler.good_steps)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- fp8 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "amax, fmt, scale",
    [
        (300.0, fp8.E4M3, 1.0),  # 300 / 1 ∈ (224, 448]
        (1000.0, fp8.E4M3, 4.0),  # 1000 / 4 = 250
        (448.0, fp8.E4M3, 1.0),
        (449.0, fp8.E4M3, 2.0),
        (0.01, fp8.E4M3, 2.0**-15),  # 0.01 · 2¹⁵ = 327.7
        (1.0, fp8.E5M2, 2.0**-15),  # 2¹⁵ ∈ (28672, 57344]
        (0.0, fp8.E4M3, 1.0),
        (float("inf"), fp8.E4M3, 1.0),
    ],
)
def test_the_scale_is_the_power_of_two_that_puts_amax_in_the_top_octave(amax, fmt, scale):
    assert float(fp8.scale_for(jnp.float32(amax), fmt)) == scale
    if 0 < amax < math.inf:  # the largest magnitude lands in (max/2, max] of the format
        top = float(jnp.finfo(fmt).max)
        assert top / 2 < amax / scale <= top


def _rounding_error(x: np.ndarray, fmt) -> np.ndarray:
    """The largest error fp8 rounding with current power-of-two scaling may make at each
    element of `x`: half a unit in the last place of the format (2^-(m+1) relative, m the
    mantissa bits) for normal values, half the subnormal spacing below the smallest normal."""
    info = jnp.finfo(fmt)
    scale = float(fp8.scale_for(jnp.float32(np.abs(x).max()), fmt))
    m = info.nmant
    relative = np.abs(x) * 2.0 ** -(m + 1)
    absolute = float(info.smallest_subnormal) / 2 * scale
    return np.maximum(relative, absolute)


@functools.partial(jax.jit, static_argnums=3)
def _fp8_layer(x, w, g, dims):
    """An fp8 dot's output and its two gradients for the incoming gradient `g` (one program)."""
    y, vjp = jax.vjp(lambda a, b: fp8.dot_general(a, b, dims), x, w)
    return y, *vjp(g)


def test_fp8_dense_layer_stays_within_the_formats_error_bound_forward_and_backward():
    """y = x·W with x, W rounded to e4m3 and dy to e5m2. With e_x, e_w, e_g the per-element
    rounding bounds (`_rounding_error`), |Δy| ≤ |e_x|·|W| + |x|·|e_w| + |e_x|·|e_w|, and so on
    for dx = dy·Wᵀ and dW = xᵀ·dy, plus bfloat16's rounding of each result (2⁻⁹ relative)
    and float32 accumulation (negligible here)."""
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(k1, (48, 96), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k2, (96, 40), jnp.float32) * 0.05).astype(jnp.bfloat16)
    g = (jax.random.normal(k3, (48, 40), jnp.float32) * 1e-3).astype(jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    y, dx, dw = _fp8_layer(x, w, g, dims)
    X, W, G = (np.asarray(a, np.float64) for a in (x, w, g))
    ex, ew = _rounding_error(X, fp8.E4M3), _rounding_error(W, fp8.E4M3)
    eg = _rounding_error(G, fp8.E5M2)
    bf16 = 2.0**-9
    aX, aW, aG = np.abs(X), np.abs(W), np.abs(G)
    checks = {  # name: (fp8 result, exact result, bound, the sum of magnitudes)
        "y": (y, X @ W, ex @ aW + aX @ ew + ex @ ew, aX @ aW),
        "dx": (dx, G @ W.T, eg @ aW.T + aG @ ew.T + eg @ ew.T, aG @ aW.T),
        "dw": (dw, X.T @ G, ex.T @ aG + aX.T @ eg + ex.T @ eg, aX.T @ aG),
    }
    for name, (got, exact, bound, size) in checks.items():
        got = np.asarray(got, np.float64)
        err = np.abs(got - exact)
        limit = bound + bf16 * np.abs(exact) + 1e-12
        assert np.all(err <= limit), f"{name}: worst excess {np.max(err - limit):.3e}"
        # the rounding is real: errors beyond what bfloat16 alone makes
        assert np.mean(err) > 2 * bf16 * np.mean(np.abs(exact)), name
        # and the bound is the formats' own: about 2⁻⁴ (+ 2⁻³ for e5m2) of the magnitudes
        assert np.median(bound / size) < (0.14 if name == "y" else 0.2), name
    # the residuals the backward keeps are fp8, a byte each
    jaxpr = jax.make_jaxpr(lambda a, b: jax.vjp(lambda p, q: fp8.dot_general(p, q, dims), a, b))(
        x, w
    )
    assert "f8_e4m3fn" in str(jaxpr)


DOTS = [  # (lhs shape, rhs shape, dimension numbers): every way a dot's axes can sit
    ((6, 8), (8, 5), (((1,), (0,)), ((), ()))),
    ((3, 6, 8), (8, 5), (((2,), (0,)), ((), ()))),
    ((4, 6, 8), (4, 8, 5), (((2,), (1,)), ((0,), (0,)))),
    ((8, 6, 3), (5, 3, 8), (((0, 2), (2, 1)), ((), ()))),
    ((2, 8, 6, 3), (3, 5, 2, 8), (((1, 3), (3, 0)), ((0,), (2,)))),
]


@functools.partial(jax.jit, static_argnums=range(4))
def _fp8_and_rounded_dots(seed, lhs_shape, rhs_shape, dims):
    """For random x, w and incoming gradient g (one program): the fp8 dot's y, dx, dw; plain
    float32 dots of x, w rounded to e4m3 and g to e5m2; and plain dx of the unrounded g."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, lhs_shape, jnp.float32)
    w = jax.random.normal(k2, rhs_shape, jnp.float32) * 3.0
    y, vjp = jax.vjp(lambda a, b: fp8.dot_general(a, b, dims), x, w)
    g = jax.random.normal(k3, y.shape, jnp.float32) * 1e-2
    rx, rw = fp8.round_trip(x, fp8.E4M3), fp8.round_trip(w, fp8.E4M3)
    want_y, ref_vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims), rx, rw)
    return (y, *vjp(g)), (want_y, *ref_vjp(fp8.round_trip(g, fp8.E5M2))), ref_vjp(g)[0]


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", DOTS)
def test_the_fp8_dot_multiplies_fp8_operands_forward_and_backward(lhs_shape, rhs_shape, dims):
    """All three products of an fp8 dot (y, dlhs, drhs) take fp8 operands, for any layout of
    contracting and batch axes, and equal plain float32 dots of the rounded operands exactly
    (the products of fp8 values and their power-of-two scales are exact in float32)."""
    seed = len(lhs_shape) + len(dims[0][0])
    (y, dx, dw), (want_y, want_dx, want_dw), unrounded_dx = _fp8_and_rounded_dots(
        seed, lhs_shape, rhs_shape, dims
    )
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-9)
    assert not np.allclose(np.asarray(dx), np.asarray(unrounded_dx), rtol=1e-3)  # it rounds

    def operand_types(jaxpr):
        return [
            tuple(str(v.aval.dtype) for v in eqn.invars)
            for eqn in _all_eqns(jaxpr.jaxpr)
            if eqn.primitive.name == "dot_general"
        ]

    def forward(a, b):
        return fp8.dot_general(a, b, dims)

    def backward(a, b, g):  # the forward, then the two products of its vjp
        return jax.vjp(forward, a, b)[1](g)

    x, w, g = (jax.ShapeDtypeStruct(s, jnp.float32) for s in (lhs_shape, rhs_shape, y.shape))
    e4m3, e5m2 = "float8_e4m3fn", "float8_e5m2"
    assert operand_types(jax.make_jaxpr(forward)(x, w)) == [(e4m3, e4m3)]
    both = operand_types(jax.make_jaxpr(backward)(x, w, g))
    assert sorted(both) == sorted([(e4m3, e4m3)] + [(e5m2, e4m3)] * 2), both


def _all_eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _all_eqns(inner)


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=["e4m3", "e5m2"])
def test_round_trip_rounds_bit_for_bit_as_fp8_without_an_fp8_array(fmt):
    """`round_trip` (the MoE's fp8 products) equals converting to fp8 and back, bit for bit,
    on every fp8 value, every midpoint between two (the ties), subnormals and random
    magnitudes, in float32 and bfloat16; its program holds no fp8 array for a compiler to
    simplify away."""
    every = np.asarray(jnp.arange(256, dtype=jnp.uint8).view(fmt).astype(jnp.float32), np.float64)
    every = np.unique(every[np.isfinite(every)])
    rng = np.random.default_rng(3)
    inputs = [
        np.concatenate([every, (every[1:] + every[:-1]) / 2]),
        rng.normal(size=4096) * np.exp(rng.uniform(-30, 10, size=4096)),
        rng.standard_cauchy(size=4096),
    ]
    round_trip = jax.jit(lambda x: fp8.round_trip(x, fmt))
    through_fp8 = jax.jit(lambda x: fp8.dequantize(*fp8.quantize(x, fmt), x.dtype))
    for dtype in (jnp.float32, jnp.bfloat16):
        for values in inputs:
            x = jnp.asarray(values, dtype)
            got = np.asarray(round_trip(x), np.float64)
            want = np.asarray(through_fp8(x), np.float64)
            np.testing.assert_array_equal(got, want)
            assert np.mean(got != np.asarray(x, np.float64)) > 0.3  # it does round
    text = str(jax.make_jaxpr(lambda a: fp8.round_trip(a, fmt))(jnp.ones((8,), jnp.float32)))
    assert "f8" not in text


def _count_fp8(text: str) -> tuple[int, int]:
    return text.count("f8E4M3FN"), text.count("f8E5M2")


def test_the_fp8_train_step_lowers_for_an_h100_with_every_dense_projection_in_fp8():
    """Exported for ``cuda`` on an abstract H100 (the field notes' recipe), the fp8 GPT's step
    rounds two operands to e4m3 per projection and each projection's gradient to e5m2: 7
    projections per block (q, k, v, o, gate, up, down), the blocks scanned (one body)."""
    from jax import export
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    cfg = Precision(policy="fp8").applied(dataclasses.replace(GPT, n_layers=2))
    graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param)
    batch = _batches(1, cfg.vocab_size)[0]

    def grads(params, inputs, targets):
        from meshtrain.loss import cross_entropy

        def loss(p):
            return cross_entropy(nnx.merge(graphdef, p)(inputs), targets)

        return jax.grad(loss)(params)

    dev = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh):
        exported = export.export(jax.jit(grads), platforms=["cuda"])(
            params, batch["inputs"], batch["targets"]
        )
    text = exported.mlir_module()
    e4m3, e5m2 = _count_fp8(text)
    # converts to fp8 per operand: at least one per projection operand and gradient
    assert e4m3 >= 2 * 7 and e5m2 >= 7, (e4m3, e5m2)
    # and every projection's three products multiply fp8 operands (the blocks are one scan body)
    fp8_dots = [
        line for line in text.splitlines()
        if "stablehlo.dot_general" in line and line.split("->")[0].count("f8E") == 2
    ]  # fmt: skip
    assert len(fp8_dots) >= 3 * 7, len(fp8_dots)
    plain = dataclasses.replace(cfg, fp8=False)
    graphdef0, params0 = nnx.split(nnx.eval_shape(lambda: build_model(plain)), nnx.Param)
    text0 = jax.jit(lambda p: nnx.merge(graphdef0, p)(batch["inputs"])).lower(params0).as_text()
    assert _count_fp8(text0) == (0, 0)


# ---- each precision under the layouts ---------------------------------------------------------

# The two layouts of the precision issue, each with one of the two precisions: fp16's loss
# scale through the 1F1B pipeline, fp8's scaled matmuls under fsdp and tensor. Each pair of
# fp16 or fp8 with another feature (these layouts' features included) is proven, or refused, in
# tests/test_composition_cover.py, the composition matrix's cells.
CASES = [
    pytest.param(
        "fp16", GPT, "pipe=2,data=2,tensor=2", "dp+tp",
        {"pipeline": PipelineConfig(schedule="1f1b", microbatches=2)}, id="1f1b-fp16",
    ),
    pytest.param("fp8", GPT, "data=2,fsdp=2,tensor=2", "fsdp+tp", {}, id="fsdp+tp-fp8"),
]  # fmt: skip


@pytest.mark.parametrize("policy, model, mesh, strategy, extra", CASES)
def test_each_precision_under_a_layout_equals_its_one_device_run(
    policy, model, mesh, strategy, extra
):
    scaled = {"loss_scale_init": SCALE} if policy == "fp16" else {}  # else it has no effect
    precision = Precision(policy=policy, **scaled)
    batches = _batches(2, model.vocab_size, seed=4)
    # one device: no pipeline, so its settings would have no effect
    one = {k: v for k, v in extra.items() if k != "pipeline"}
    ref, _, ref_step, _ = _setup(model, precision, devices=jax.devices()[:1], **one)
    start = _host(ref.params)
    want_loss, want_m, ref = _train(ref, ref_step, batches)
    state, _, step, _ = _setup(model, precision, mesh, strategy, **dict(extra))
    loss, got_m, state = _train(state, step, batches)
    for m in want_m + got_m:
        assert int(m["skipped"]) == 0 and int(m.get("overflow", 0)) == 0
    loss_atol, update_rtol = TOL[policy]
    np.testing.assert_allclose(loss, want_loss, rtol=0, atol=loss_atol)
    paths = jax.tree_util.tree_leaves_with_path(start)
    got, want = jax.tree.leaves(_host(state.params)), jax.tree.leaves(_host(ref.params))
    norms = [float(np.linalg.norm(w - s)) for (_, s), w in zip(paths, want, strict=True)]
    for (path, s), g, w, n in zip(paths, got, want, norms, strict=True):
        err = float(np.linalg.norm((g - s) - (w - s)))
        bound = update_rtol * max(n, 0.02 * max(norms))
        assert err <= bound, f"{jax.tree_util.keystr(path)}: {err:.2e} > {bound:.2e}"
    assert max(norms) > 1e-3  # it trained


# ---- convergence ------------------------------------------------------------------------------


def _fp8_products(compiled: str) -> int:
    """Matrix products of two fp8 operands in a compiled GPU program: cuBLASLt's fp8 GEMMs and
    dots (inside Triton GEMM fusions) whose operands are fp8 instructions."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", compiled))
    dots = re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", compiled)
    fused = sum(
        types.get(a, "").startswith("f8") and types.get(b, "").startswith("f8") for a, b in dots
    )
    return fused + compiled.count('"__cublas$lt$matmul$f8"')


@pytest.mark.gpu
def test_the_compiled_fp8_layer_runs_fp8_gemms_on_a_gpu():
    """On a GPU (Hopper or later) all three products of an fp8 dense layer (forward, and both
    of the backward, with a random incoming gradient) run with fp8 operands."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (256, 512), jnp.bfloat16)
    w = jax.random.normal(k2, (512, 256), jnp.bfloat16) * 0.05
    g = jax.random.normal(k3, (256, 256), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))

    def layer(a, b, dy):
        y, vjp = jax.vjp(lambda p, q: fp8.dot_general(p, q, dims), a, b)
        return y, *vjp(dy)

    text = jax.jit(layer).lower(x, w, g).compile().as_text()
    assert _fp8_products(text) >= 3, text[-6000:]


def test_resuming_across_loss_scaling_names_the_precision():
    """A checkpoint without a loss scale restored into an fp16 run (and back) is refused in
    one line that names the precision that resumes it."""
    from meshtrain.checkpoint.targets import layout_mismatch

    cfg = dataclasses.replace(GPT, n_layers=2)
    plain = _setup(cfg, Precision(policy="bf16"))[0]
    scaled = _setup(cfg, Precision(policy="fp16"))[0]
    line = layout_mismatch(plain._asdict(), scaled)
    assert line.startswith("no loss scaling, and this run has one") and "fp32, bf16 or fp8" in line
    line = layout_mismatch(scaled._asdict(), plain)
    assert line.startswith("loss scaling, and this run has none") and "--precision fp16" in line
    assert layout_mismatch(plain._asdict(), _setup(cfg, Precision(policy="fp8"))[0]) is None


# ---- the settings reach the program ---------------------------------------------------------


@pytest.mark.parametrize("setting", ["default", "highest"])
def test_matmul_precision_reaches_every_float32_dot_of_the_step(setting):
    """--matmul-precision is in force while the step traces: under ``highest`` every dot of
    the lowered float32 step (forward and backward) asks for HIGHEST, under ``default`` none."""
    precision = Precision(policy="fp32", matmul_precision=setting)
    cfg = dataclasses.replace(GPT, n_layers=2)
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    rules = rules_for("dp", mesh)
    run = RunSpec(model=cfg, mesh=mesh, rules=rules, optim=OPTIM, precision=precision,
                  train=TrainConfig(run_dir=""))  # fmt: skip
    tx = run.optimizer(10)
    graphdef, state, shardings = init_train_state(lambda: build_model(cfg), tx, mesh, rules)
    batch = shard_batch(_batches(1, cfg.vocab_size)[0], mesh, rules)
    step = jit_train_step(run, graphdef, tx, shardings, batch_shardings(batch, mesh, rules))
    dots = [line for line in step.lower(state, batch).as_text().splitlines()
            if "stablehlo.dot_general" in line]  # fmt: skip
    highest = [line for line in dots if "precision = [HIGHEST, HIGHEST]" in line]
    assert len(dots) >= 3 * 7  # 7 projections a block, each with a forward and two backward dots
    assert len(highest) == (len(dots) if setting == "highest" else 0), (len(highest), len(dots))


def test_the_mlp_classifier_runs_every_dense_layer_in_fp8():
    """``MLPConfig(fp8=True)``: each dense layer (input, two per block, head) rounds both
    operands to e4m3 in the forward and its gradient to e5m2 in the backward; the logits stay
    within fp8's rounding of the bfloat16 model's (same parameters)."""
    cfg = MLPConfig(num_features=16, num_classes=8, d_model=32, d_hidden=64, n_layers=2,
                    dtype="bfloat16")  # fmt: skip
    dense = 1 + 2 * cfg.n_layers + 1
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param)
    params = jax.jit(lambda: nnx.state(build_model(cfg), nnx.Param))()
    fp8_cfg = dataclasses.replace(cfg, fp8=True)
    graphdef8, _ = nnx.split(nnx.eval_shape(lambda: build_model(fp8_cfg)), nnx.Param)
    x = jax.random.normal(jax.random.key(3), (32, cfg.num_features), jnp.float32)

    def loss(g, p):
        return jnp.sum(nnx.merge(g, p)(x).astype(jnp.float32) ** 2)

    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: loss(graphdef8, p)))(params))
    assert jaxpr.count("new_dtype=float8_e4m3fn") >= 2 * dense, jaxpr[-3000:]
    assert jaxpr.count("new_dtype=float8_e5m2") >= dense
    plain = str(jax.make_jaxpr(jax.grad(lambda p: loss(graphdef, p)))(params))
    assert "float8" not in plain
    y8, y = jax.jit(lambda p: [nnx.merge(g, p)(x) for g in (graphdef8, graphdef)])(params)
    y8, y = np.asarray(y8, np.float64), np.asarray(y, np.float64)
    rel = np.linalg.norm(y8 - y) / np.linalg.norm(y)
    assert 2.0**-9 < rel < 0.1, rel  # fp8's rounding, more than bfloat16's, within its bound


def test_bench_compile_only_reports_the_compiled_step_under_a_policy(capsys):
    """``meshtrain bench --precision fp8 --compile-only``: one JSON line with the policy,
    the compiled memory, FLOPs and compile time, and nothing timed."""
    from meshtrain.cli import main

    assert main(["bench", "--size", "tiny", "--precision", "fp8", "--compile-only"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, lines
    out = json.loads(lines[0])
    assert out["precision"] == "fp8" and out["compile_s"] > 0 and out["compiled_flops"] > 0
    assert out["compiled_memory_bytes"]["temp"] > 0 and "compiled only" in out["note"]
    assert "step_time_s" not in out and out["command"].startswith("meshtrain bench --size tiny")
