"""`meshtrain bench` end to end at tiny, the FLOP counter against XLA's, and the hand-written
jax baseline against meshtrain's step."""

import datetime
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import load_benchmark
from flax import nnx

import meshtrain as mt
from meshtrain import bench, measure, metrics
from meshtrain.kernels import reference

ROOT = pathlib.Path(__file__).resolve().parents[1]

FIELDS = {  # every field of the bench's JSON line and a check of its value
    "benchmark": lambda v: v == "meshtrain_bench",
    "size": lambda v: v == "tiny",
    "platform": lambda v: v == "cpu",
    "device_kind": lambda v: isinstance(v, str) and v,
    "n_devices": lambda v: v == 8,
    "jax_version": lambda v: v == jax.__version__,
    "date": lambda v: datetime.datetime.fromisoformat(v).tzinfo is not None,
    "model": lambda v: v["d_model"] == bench.SIZES["tiny"]["d_model"],
    "params": lambda v: v > 0,
    "compile_s": lambda v: v > 0,
    "first_loss": lambda v: abs(v - math.log(256)) < 0.5,  # about ln(vocab) at init
    "step_time_s": lambda v: v > 0,
    "step_time_spread": lambda v: v["min"] <= v["p10"] <= v["p90"] <= v["max"] and v["n"] == 2,
    "step_time_back_to_back_s": lambda v: v > 0,
    "tokens_per_s": lambda v: v > 0,
    "tokens_per_step": lambda v: v == 64 * 8,
    "mfu_convention": lambda v: v == "causal",
    "flops_per_token": lambda v: v > 0,
    "flops_per_token_palm": lambda v: v > 0,
    "flops_per_step": lambda v: v > 0,
    "model_tflops_per_device": lambda v: v > 0,
    "model_tflops_per_device_palm": lambda v: v > 0,
    "mfu": lambda v: v is None,  # no datasheet peak for a CPU
    "mfu_palm": lambda v: v is None,
    "peak_tflops_datasheet": lambda v: v is None,
    "mfu_vs_measured_peak": lambda v: v > 0,
    "mfu_palm_vs_measured_peak": lambda v: v > 0,
    "peak_tflops_measured": lambda v: v > 0,
    "matmul_peak": lambda v: v["n"] == 512 and "shrunk" in v["note"] and v["tflops"] > 0,
    "peak_memory_bytes": lambda v: v > 0,
    "peak_memory_source": lambda v: "estimate" in v,
    "compiled_memory_bytes": lambda v: v["temp"] > 0,
    "note": lambda v: "smoke" in v,
    "command": lambda v: v.startswith("meshtrain bench --size tiny"),
}


@pytest.mark.slow
def test_bench_tiny_prints_every_field_and_writes_a_trace(tmp_path):
    trace = tmp_path / "trace"
    cmd = [sys.executable, "-m", "meshtrain.cli", "bench", "--size", "tiny", "--steps", "2"]
    cmd += ["--warmup", "1", "--profile", str(trace), "--profile-steps", "2"]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    out = json.loads(lines[0])
    for key, ok in FIELDS.items():
        assert key in out, f"missing {key!r}"
        assert ok(out[key]), f"{key} = {out[key]!r}"
    # The figures are each other's quotients, as their definitions say.
    assert out["tokens_per_s"] == pytest.approx(out["tokens_per_step"] / out["step_time_s"])
    tflops = out["flops_per_step"] / out["step_time_s"] / out["n_devices"] / 1e12
    assert out["model_tflops_per_device"] == pytest.approx(tflops)
    assert out["mfu_vs_measured_peak"] == pytest.approx(tflops / out["peak_tflops_measured"])
    palm_minus_causal = out["flops_per_token_palm"] - out["flops_per_token"]
    m = out["model"]
    assert palm_minus_causal == 6 * m["n_layers"] * m["n_heads"] * m["head_dim"] * m["seq_len"]
    # The trace: XProf/TensorBoard's xplane and Perfetto's JSON.
    files = [str(p) for p in trace.rglob("*") if p.is_file()]
    assert any(f.endswith(".xplane.pb") for f in files), files
    assert any(f.endswith("perfetto_trace.json.gz") for f in files), files
    assert sorted(out["profile_files"]) == sorted(
        str(pathlib.Path(f).relative_to(trace)) for f in files
    )


def test_bench_refuses_bad_flags(capsys):
    from meshtrain.cli import main

    for argv, needle in (
        (["--steps", "0"], "steps=0: must be a positive integer; e.g. --steps 10"),
        (["--size", "7b"], "--size 7b: choose from tiny, 125m, 350m, 1.3b"),
        (["--batch", "-1"], "batch=-1: must be an integer ≥ 0; e.g. --batch 0"),
    ):
        assert main(["bench", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("meshtrain bench: error: ") and needle in err[0]


def test_throughput_arithmetic_and_both_conventions():
    cfg = mt.GPTConfig(d_model=256, n_layers=3, n_heads=4, max_seq_len=128)
    shape = bench.Shape(config=cfg, seq_len=128, batch=16)
    out = bench.throughput(
        step_time=0.5, shape=shape, n_devices=2, peak_datasheet=1e12, peak_measured=5e11
    )
    causal = 6 * cfg.matmul_params() + 6 * 3 * 4 * 64 * 128
    assert out["flops_per_token"] == causal
    assert out["flops_per_token_palm"] == cfg.flops_per_token(128)  # the Trainer's count
    assert out["mfu"] == pytest.approx(causal * 2048 / 0.5 / 2 / 1e12)
    assert out["mfu_vs_measured_peak"] == pytest.approx(2 * out["mfu"])
    assert out["mfu_palm"] > out["mfu"]
    with pytest.raises(ValueError, match="convention"):
        metrics.attention_flops_per_token(
            n_layers=1, n_heads=1, head_dim=1, seq_len=1, convention="megatron"
        )


def test_spread_orders_its_statistics():
    s = measure.spread([3.0, 1.0, 2.0, 10.0, 2.5])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 10.0
    assert s["p10"] == 1.0 and s["p90"] == 10.0 and s["n"] == 5


# --- FLOPs against XLA's count ------------------------------------------------------------------


def _xla_flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def test_flop_counter_agrees_with_xla_on_the_matmul_part():
    """A GPT whose attention is negligible (T = 8 against d = 256): the counter's 6·N per
    token is within 10% of what XLA counts for loss + gradient. One layer, because XLA's cost
    analysis counts a loop body once, and the layers run in a scan. Leaving out the output
    head, or counting only the forward, misses by far more than 10%: the check can fail."""
    cfg = mt.GPTConfig(d_model=256, n_layers=1, n_heads=4, vocab_size=2048, max_seq_len=8)
    B, T = 4, 8
    graphdef, params, rest = nnx.split(mt.lower.build_model(cfg), nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 2048, (B, T + 1)), jnp.int32)

    def loss(p):
        logits = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    xla = _xla_flops(jax.value_and_grad(loss), params)
    counted = metrics.gpt_flops_per_token(cfg, T, "palm") * B * T
    assert counted / xla == pytest.approx(1, abs=0.10), (counted, xla)
    no_head = counted - 6 * cfg.d_model * cfg.vocab_size * B * T
    forward_only = counted / 3
    for wrong in (no_head, forward_only):
        assert abs(wrong / xla - 1) > 0.10, (wrong, xla)


def test_attention_flops_agree_with_xla():
    """The jnp attention (which computes every query-key pair) forward + backward against the
    PaLM convention's 12·H·K·T per token and layer; causal is half of it by definition."""
    B, T, H, K = 2, 256, 4, 64
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(kk, (B, T, H, K)) for kk in ks)
    # value_and_grad, as in a train step: with grad alone the forward's p·v is dead code.
    # A random cotangent g: with sum() alone XLA may turn dO·Vᵀ into a reduction.
    xla = _xla_flops(
        jax.value_and_grad(lambda q, k, v, g: (reference.attention(q, k, v) * g).sum(), (0, 1, 2)),
        q,
        k,
        v,
        g,
    )
    kw = dict(n_layers=1, n_heads=H, head_dim=K, seq_len=T)
    palm = metrics.attention_flops_per_token(**kw, convention="palm") * B * T
    assert palm / xla == pytest.approx(1, abs=0.10), (palm, xla)
    assert metrics.attention_flops_per_token(**kw, convention="causal") * B * T == palm / 2


# --- the hand-written jax baseline -----------------------------------------------------------


@pytest.mark.parametrize(
    "style,dtype,rtol",
    [("llama", "float32", 2e-6), ("gpt2", "float32", 2e-6), ("llama", "bfloat16", 2e-3)],
)
def test_jax_baseline_computes_meshtrain_losses(style, dtype, rtol):
    """Same initial weights, same three batches, three steps each: meshtrain's train step on
    data=2,fsdp=2,tensor=2 and the hand-written step on plain data parallelism give the same
    losses. The later losses differ from the first by far more than the tolerance, so the
    optimizers' updates (clipping, AdamW, schedule, decay mask) are compared too."""
    B = load_benchmark("baseline_jax")
    cfg = mt.GPTConfig(
        style=style, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, dtype=dtype
    )
    mesh = mt.make_mesh("data=2,fsdp=2,tensor=2")
    rules = mt.rules_for("fsdp+tp", mesh)
    tx = mt.lower.make_optimizer(mt.OptimConfig(warmup_steps=1), total_steps=10)
    graphdef, state, shardings = mt.lower.init_train_state(
        lambda: mt.lower.build_model(cfg, seed=3), tx, mesh, rules
    )
    params0 = jax.device_get(state.params)  # before the donated step consumes them
    rng = np.random.default_rng(1)
    host = []
    for _ in range(3):
        t = rng.integers(0, cfg.vocab_size, (8, 17), dtype=np.int32)
        host.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    batches = [mt.lower.shard_batch(b, mesh, rules) for b in host]
    step = mt.lower.jit_train_step(
        mt.RunSpec(mesh=mesh, rules=rules),
        graphdef,
        tx,
        shardings,
        {k: v.sharding for k, v in batches[0].items()},
    )
    mesh_losses = []
    for b in batches:
        state, m = step(state, b)
        mesh_losses.append(float(m["loss"]))

    bcfg = B.Config(
        style=style,
        vocab_size=cfg.vocab_size,
        max_seq_len=cfg.max_seq_len,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.kv_heads,
        d_ff=cfg.ff_dim,
        dtype=dtype,
    )
    btx = B.optimizer(B.OptConfig(warmup_steps=1, total_steps=10))
    bstate, bbatches = B.data_parallel(params0, btx, host)
    bstep = B.make_step(bcfg, btx)
    base_losses = []
    for b in bbatches:
        bstate, loss = bstep(bstate, b)
        base_losses.append(float(loss))

    np.testing.assert_allclose(base_losses, mesh_losses, rtol=rtol)
    if dtype == "float32":  # the updates moved the loss far past the tolerance
        assert abs(mesh_losses[2] - mesh_losses[0]) > 100 * rtol * abs(mesh_losses[0])
