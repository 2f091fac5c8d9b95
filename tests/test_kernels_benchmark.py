"""benchmarks/kernels.py: on CPU it prints one JSON line saying GPU figures are unmeasured
(with an interpret-mode correctness smoke), and its timing table code runs (--selftest)."""

import json
import math
import pathlib

import pytest
from _helpers import one_json_line

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "kernels.py"
KERNELS = ("attention", "rms_norm", "layer_norm", "cross_entropy", "matmul")


def _run(*args) -> dict:
    return one_json_line(SCRIPT, *args)


@pytest.mark.slow
def test_cpu_run_says_unmeasured_and_checks_correctness(tmp_path):
    out_file = tmp_path / "k.json"
    out = _run("--out", str(out_file))
    assert out["platform"] == "cpu" and out["gpu_figures"] == "unmeasured"
    assert "rows" not in out  # no timings pretended
    assert set(out["smoke_rel_err"]) == {"flash_attention", *KERNELS[1:]}
    for name, err in out["smoke_rel_err"].items():
        assert 0 <= err < 1e-5, (name, err)
    assert json.loads(out_file.read_text()) == out


@pytest.mark.slow
def test_selftest_builds_the_table():
    """The timing path on tiny shapes; attention (the most involved table) and one row-wise
    kernel keep it cheap."""
    out = _run("--selftest", "--only", "attention,rms_norm")
    assert out["gpu_figures"] == "unmeasured" and "not performance figures" in out["note"]
    rows = out["rows"]
    assert {r["kernel"] for r in rows} == {"attention", "rms_norm"}
    for kernel in ("attention", "rms_norm"):
        for pass_ in ("fwd", "fwd+bwd"):
            mine = [
                r for r in rows if (r["kernel"], r["pass"], r["impl"]) == (kernel, pass_, "pallas")
            ]
            assert mine, (kernel, pass_)
            for r in mine:
                assert r["ms"] > 0 and r["floor_ms"] > 0 and math.isfinite(r["roofline_ratio"])
                assert r["rel_err"] < 2e-2, r  # bf16 against the reference
                peer = next(
                    p
                    for p in rows
                    if (p["kernel"], p["shape"], p["pass"], p["impl"])
                    == (kernel, r["shape"], pass_, "xla")
                )
                assert r["vs_xla"] == pytest.approx(peer["ms"] / r["ms"], rel=1e-2, abs=1e-3)
