"""Communicating less, end to end on the char-LM: `benchmarks/sync.py --quick` trains a tiny
byte-level GPT on 8 simulated devices for 200 steps under fp32 (``none``) and int8 with error
feedback, from the same parameters on the same batches, and prints one JSON line per scheme.
One run (a module fixture) serves both tests: int8 + error feedback ends within 2% of the
uncompressed loss, and the lines carry the inspector's bytes (int8 at about a quarter of
fp32's). Top-k and sign are not run here, to keep the suite short: their figures after 250
steps are in benchmarks/results/2026-11-23-cpu-sync.jsonl (the Communicating less guide's
table), after 50 in notebook 09, whose check runs them."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

# One worker runs the module-scoped benchmark for both tests (under --dist loadgroup; split
# between workers, each would run it).
pytestmark = pytest.mark.xdist_group("communicating_less")

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = {"none", "int8+ef"}
KEYS = {
    "scheme",
    "settings",
    "steps",
    "bytes_per_step",
    "buffer_bytes_per_step",
    "ratio_to_fp32",
    "final_loss",
    "eval_loss",
    "cpu_step_s",
    "device",
    "jax_version",
    "date",
}


@pytest.fixture(scope="module")
def quick():
    """The quick benchmark's JSON lines, by scheme."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sync.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return {line["scheme"]: line for line in lines}


@pytest.mark.slow
def test_int8_with_error_feedback_converges_like_fp32(quick):
    none, int8 = quick["none"]["final_loss"], quick["int8+ef"]["final_loss"]
    # The run learned (a byte-level model starts at ln 256 ≈ 5.55 nats).
    assert none < 0.7 * math.log(256), none
    print(f"final losses after 200 steps: none={none:.4f}, int8+ef={int8:.4f}")
    assert abs(int8 - none) <= 0.02 * none, (int8, none)


@pytest.mark.slow
def test_quick_benchmark_prints_json_lines_with_the_inspected_bytes(quick):
    assert set(quick) == SCHEMES, sorted(quick)
    for line in quick.values():
        assert KEYS <= set(line), KEYS - set(line)
        assert line["steps"] == 200 and math.isfinite(line["final_loss"])
        assert "simulated cpu devices" in line["device"]
    assert quick["none"]["ratio_to_fp32"] == 1.0 and quick["none"]["settings"] == {}
    assert quick["int8+ef"]["settings"] == {"grad_compression": "int8"}
    # int8 payloads plus one fp32 scale per 256 values: a quarter of fp32's bytes on the wire.
    assert 0.225 <= quick["int8+ef"]["ratio_to_fp32"] <= 0.275, quick["int8+ef"]
