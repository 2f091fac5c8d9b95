"""Smoke test of benchmarks/overhead.py: `--quick` runs and prints one well-formed JSON line."""

import math
import pathlib

import pytest
from _helpers import one_json_line

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "overhead.py"

STEP_KEYS = ("meshtrain_step_ms", "baseline_step_ms", "baseline_constrained_step_ms")
COMPILE_KEYS = ("compile_s_depth4", "compile_s_depth32")
OTHER_KEYS = (
    "platform",
    "device_kind",
    "jax_version",
    "mesh",
    "strategy",
    "model",
    "rounds",
    "baseline",
    "note",
    "overhead_ratio",
    "median_round_ratio",
    "overhead_ratio_vs_constrained",
    "compile_ratio_32_over_4",
)


def _positive_finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_overhead_quick_prints_one_json_line():
    out = one_json_line(SCRIPT, "--quick", devices=8)

    for key in (*STEP_KEYS, *COMPILE_KEYS, *OTHER_KEYS):
        assert key in out, f"missing {key!r}"
    for key in (*STEP_KEYS, *COMPILE_KEYS):
        assert _positive_finite(out[key]), f"{key} = {out[key]!r}"
    for key in ("overhead_ratio", "median_round_ratio", "compile_ratio_32_over_4"):
        assert _positive_finite(out[key]), f"{key} = {out[key]!r}"

    # Ratios are the quotients of the reported figures (which are rounded to 4 decimals).
    def quotient(a, b):
        return out[a] / out[b]

    assert out["overhead_ratio"] == pytest.approx(
        quotient("meshtrain_step_ms", "baseline_step_ms"), abs=1e-4
    )
    assert out["overhead_ratio_vs_constrained"] == pytest.approx(
        quotient("meshtrain_step_ms", "baseline_constrained_step_ms"), abs=1e-4
    )
    assert out["compile_ratio_32_over_4"] == pytest.approx(
        quotient("compile_s_depth32", "compile_s_depth4"), abs=1e-4
    )

    assert out["platform"] == "cpu"
    assert out["n_devices"] == 8
    assert out["rounds"] >= 1
    assert out["model"]["n_layers"] >= 1
    assert out["same_state_layout"] is True
    # All contenders start from the same parameters and batch, so the first loss agrees.
    losses = list(out["first_loss"].values())
    assert all(loss == pytest.approx(losses[0], rel=1e-5) for loss in losses)


@pytest.mark.slow
def test_pipeline_memory_quick_counts_permutes_and_memory():
    """`--quick` prints one JSON line: every schedule's compiled permutes are the table's stage
    pairs and send exactly the useful bytes it implies, its counted bubble is the closed form,
    and 1F1B's temporary memory is below gpipe's."""
    # Compile-only figures (HLO permutes, buffer sizes): LLVM -O0 leaves them as they are.
    out = one_json_line(
        ROOT / "benchmarks" / "pipeline_memory.py", "--quick", devices=8, timeout=600
    )
    for schedule in ("gpipe", "1f1b", "circular", "interleaved-1f1b", "zb-h1"):
        fig = out[schedule]
        assert _positive_finite(fig["temp_bytes"])
        assert fig["pairs_match_the_table"], schedule
        assert fig["permute_bytes_per_device"] <= 1.1 * fig["permute_bytes_useful"], fig
        assert fig["permute_bytes_per_device"] >= fig["permute_bytes_useful"], fig
        assert fig["bubble_counted"] == pytest.approx(fig["bubble_closed_form"]), fig
    assert out["1f1b"]["temp_bytes"] < out["gpipe"]["temp_bytes"]


@pytest.mark.slow
def test_save_overhead_quick_prints_one_json_line():
    out = one_json_line(ROOT / "benchmarks" / "save_overhead.py", "--quick")
    assert out["platform"] == "cpu" and out["devices"] == 8 and out["saves"] == 8
    assert _positive_finite(out["step_ms_no_checkpoints"]) and _positive_finite(out["state_mib"])
    for mode in ("async", "sync"):
        assert math.isfinite(out[f"{mode}_overhead_ms_per_step"]), out
    ratio = out["async_overhead_ms_per_step"] / out["sync_overhead_ms_per_step"]
    assert out["async_over_sync"] == pytest.approx(ratio)
