"""``impl="auto"`` follows the measured table (kernels/auto_table.json): on a GPU the fastest
implementation measured for the call's device kind and shape, the safe default where nothing
was measured, XLA's ops off a GPU; the run summary names what each setting resolved to."""

import json
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import pytest

from meshtrain import GPTConfig, RunSpec
from meshtrain.kernels import _common, autotable, select
from meshtrain.kernels import grouped_matmul as gmm
from meshtrain.models import DataSpec, MoEConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
KIND = "Test GPU"


def _row(op, shape, ms, kind=KIND):
    return {"platform": "gpu", "device_kind": kind, "op": op, "shape": shape, "ms": ms,
            "jax": "0.0", "date": "2026-01-02"}  # fmt: skip


ROWS = [
    _row("attention", {"seq": 1024, "head_dim": 64, "causal": True},
         {"pallas": 1.0, "cudnn": 2.0, "xla": 3.0}),
    _row("attention", {"seq": 8192, "head_dim": 64, "causal": True},
         {"pallas": 9.0, "cudnn": 4.0, "xla": 30.0}),
    _row("rms_norm", {"tokens": 8192, "features": 2048}, {"pallas": 0.2, "xla": 0.3}),
    _row("cross_entropy", {"tokens": 8192, "vocab": 32768}, {"pallas": 2.0, "xla": 1.0}),
    _row("grouped_matmul", {"rows": 4096}, {"tiled": 1.0, "xla": 2.0}),
    _row("attention", {"seq": 2048, "head_dim": 64, "causal": True}, {"xla": 0.1}, kind="Other"),
]  # fmt: skip


@pytest.fixture
def gpu_table(monkeypatch, tmp_path):
    """A GPU of kind `KIND` with the table `ROWS`."""
    table = tmp_path / "auto_table.json"
    table.write_text(json.dumps({"rows": ROWS}))
    monkeypatch.setattr(autotable, "TABLE", table)
    monkeypatch.setattr(autotable, "device_kind", lambda: KIND)
    monkeypatch.setattr(_common, "on_gpu", lambda: True)
    autotable.rows.cache_clear()
    yield
    autotable.rows.cache_clear()


def _attention(seq, head_dim=64, dtype=jnp.bfloat16, **call):
    return select.attention_choice("auto", head_dim=head_dim, dtype=dtype, seq=seq, **call)


@pytest.mark.usefixtures("gpu_table")
def test_auto_runs_the_fastest_measured_and_the_safe_default_elsewhere():
    assert _attention(1024).impl == "pallas"  # pallas measured fastest at 1k
    assert _attention(2048).impl == "pallas"  # 1k and 8k rows both within 4×: the nearer
    assert _attention(6000).impl == "cudnn"  # nearer 8k, where cuDNN won
    assert _attention(8192, packed=True).impl == "pallas"  # cuDNN cannot take the documents
    assert _attention(8192, context=True).impl == "pallas"  # nor a context-parallel block
    assert _attention(1024, head_dim=96).impl == "xla"  # the kernels' head widths only
    assert _attention(1024, dtype=jnp.float16).impl == "xla"  # and their dtypes
    assert _attention(8192, dtype=jnp.float32).impl == "pallas"  # cuDNN: bfloat16 only
    assert _attention(1 << 16) == ("cudnn", "not measured on this GPU: the safe default")
    assert _attention(1 << 16, packed=True).impl == "xla"  # nothing unmeasured, ever
    assert _attention(1024, causal=False).impl == "cudnn"  # a causal row is not a full one
    choice = _attention(1024)
    assert choice.why == "fastest measured at seq 1024 (2026-01-02)"
    assert _common.resolve_impl("auto", kernel="rms_norm", shape={"features": 4096}) == "pallas"
    assert _common.resolve_impl("auto", kernel="rms_norm", shape={"features": 64}) == "xla"
    assert _common.resolve_impl("auto", kernel="layer_norm", shape={"features": 2048}) == "xla"
    ce = {"vocab": 50304}
    assert _common.resolve_impl("auto", kernel="token_cross_entropy", shape=ce) == "xla"
    assert _common.resolve_impl("auto", kernel="relu") == "xla"  # never measured
    assert gmm.auto_impl(8192) == "tiled"
    assert gmm.auto_impl(1 << 20) == "xla"  # the safe default off the measured sizes
    assert _common.resolve_impl("pallas", kernel="rms_norm") == "pallas"  # a set impl stays


def test_off_a_gpu_auto_is_xla_whatever_the_table_says(monkeypatch):
    monkeypatch.setattr(autotable, "device_kind", lambda: "NVIDIA H200")
    assert _attention(1024) == ("xla", "off a GPU")
    assert _common.resolve_impl("auto", kernel="rms_norm", shape={"features": 2048}) == "xla"
    assert gmm.auto_impl(16384) == "tiled"  # XLA's CPU ragged_dot is a dense product


MEASURED = "(auto: fastest measured at seq 8192 (2026-01-02))"


@pytest.mark.usefixtures("gpu_table")
@pytest.mark.parametrize(
    ("mesh", "packed", "attention"),
    [({"data": 8}, False, "cudnn"), ({"data": 8}, True, "pallas"),
     ({"data": 4, "seq": 2}, False, "pallas")],
    ids=["plain", "packed", "context-parallel"],
)  # fmt: skip
def test_the_run_summary_names_what_auto_resolved_to_in_each_layout(mesh, packed, attention):
    gpt = GPTConfig(
        d_model=2048,
        n_heads=32,
        max_seq_len=8192,
        attention_impl="auto",
        norm_impl="auto",
        dtype="bfloat16",
    )
    data = DataSpec("lm", 8, 8192, gpt.vocab_size, packed=packed)
    assert RunSpec(model=gpt, data=data, mesh=mesh).kernels() == (
        f"kernels: attention {attention} {MEASURED} · norm pallas (auto: fastest measured at "
        "features 2048 (2026-01-02)) · loss xla"
    )


@pytest.mark.usefixtures("gpu_table")
def test_the_summary_of_a_moe_and_of_a_long_sequence_falls_back_safely():
    moe = MoEConfig(d_model=128, n_heads=2, attention_impl="auto", dtype="bfloat16")
    data = DataSpec("lm", 8, 1 << 16, moe.vocab_size, packed=False)
    assert RunSpec(model=moe, data=data, mesh={"data": 8}).kernels() == (
        "kernels: attention cudnn (auto: not measured on this GPU: the safe default) · norm xla"
        " · loss xla"
    )


def test_the_committed_table_is_what_the_generator_writes(tmp_path):
    """Nobody edits the table by hand: writing it again from the results it names (committed
    under benchmarks/results/) gives it, byte for byte."""
    committed = json.loads(autotable.TABLE.read_text())
    assert committed["sources"] and all(
        s.startswith("benchmarks/results/") for s in committed["sources"]
    )
    out = tmp_path / "auto_table.json"
    date = committed["written_by"].rsplit(" ", 1)[-1]  # for the records that carry no date
    cmd = [sys.executable, "scripts/auto_table.py", *committed["sources"], "--date", date,
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["written"] is True
    assert out.read_text() == autotable.TABLE.read_text()


def test_a_run_without_gpu_records_writes_nothing(tmp_path):
    cpu = tmp_path / "cpu.jsonl"
    cpu.write_text(json.dumps({"benchmark": "kernels", "platform": "cpu", "rows": []}) + "\n")
    out = tmp_path / "auto_table.json"
    cmd = [sys.executable, "scripts/auto_table.py", str(cpu), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and json.loads(proc.stdout)["written"] is False
    assert not out.exists()
    cmd[2] = str(tmp_path / "missing.jsonl")  # a results file that is not there: one line
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().endswith("missing.jsonl")
    assert len(proc.stderr.strip().splitlines()) == 1


def _sweep_row(seq, impl, ms, config=None):
    shape = {"batch": 16384 // seq, "seq": seq, "heads": 16, "head_dim": 128, "causal": True}
    row = {"kernel": "attention", "shape": shape, "pass": "fwd+bwd", "impl": impl, "ms": ms}
    return row | ({"config": config} if config else {})


def test_the_sweep_becomes_a_tuned_configuration_and_an_attention_timing():
    slow, fast = ({"block_q": b, "block_k": 64, "warps": 8, "stages": 3} for b in (64, 128))
    sweep = {"benchmark": "flash_sweep", "platform": "gpu", "device_kind": KIND,
             "date": "2026-02-03T00:00:00", "rows": [
                 _sweep_row(4096, "cudnn", 2.0), _sweep_row(4096, "pallas", 3.0, slow),
                 _sweep_row(4096, "pallas", 2.5, fast),
                 {**_sweep_row(4096, "pallas", 0.0, slow), "error": "Triton refused"}]}  # fmt: skip
    del sweep["rows"][-1]["ms"]  # a configuration that failed is no timing
    rows = {r["op"]: r for r in autotable.table_from([sweep])}
    assert rows["flash_config"]["config"] == fast and rows["flash_config"]["ms"] == {"pallas": 2.5}
    assert rows["attention"]["ms"] == {"cudnn": 2.0, "pallas": 2.5}
    assert rows["attention"]["date"] == "2026-02-03"


@pytest.mark.usefixtures("gpu_table")
def test_the_kernel_tiles_with_the_configuration_tuned_for_the_shape(monkeypatch, tmp_path):
    from meshtrain.kernels._flash_checks import tiling

    tuned = {"block_q": 128, "block_k": 32, "warps": 8, "stages": 3}
    row = _row("flash_config", {"seq": 4096, "head_dim": 128, "causal": True}, {"pallas": 1.0})
    table = tmp_path / "tuned.json"
    table.write_text(json.dumps({"rows": [*ROWS, {**row, "config": tuned}]}))
    monkeypatch.setattr(autotable, "TABLE", table)
    autotable.rows.cache_clear()

    def tiles(seq, head_dim=128, **given):
        q = jnp.zeros((1, seq, 2, head_dim), jnp.bfloat16)
        t = tiling(q, q, True, None, **given)
        return t.bq, t.bk, t.warps, t.stages

    assert tiles(4096) == (128, 32, 8, 3)
    assert tiles(8192) == (128, 32, 8, 3)  # within a factor of four: the nearest row serves
    assert tiles(4096, block_q=64, warps=4) == (64, 32, 4, 3)  # what is given wins
    assert tiles(4096, head_dim=64) == (64, 64, 0, 2)  # not tuned: the defaults
    assert tiles(1 << 16) == (64, 64, 0, 2)
    with pytest.raises(ValueError, match=r"warps=3 must be a power of two"):
        tiles(4096, warps=3)
    with pytest.raises(ValueError, match=r"stages=0 must be ≥ 1"):
        tiles(4096, stages=0)
