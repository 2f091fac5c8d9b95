"""The GPU kit on CPU: scripts/gpu_check.sh, the wheel bundle and the lowest-version pins.

Tests marked ``kit`` run `gpu_check.sh --dry-run` end to end. `make test-lowest` runs them in
an image-like venv (the lowest versions pyproject.toml allows, jax 0.11.2, with every package
the GPU image lacks removed) against the real bundle, with MESHTRAIN_KIT_PYTHON and
MESHTRAIN_KIT_WHEELS set; `make test` leaves them to that stage (``-m "not kit"``).
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_bundle  # noqa: E402
from lowest_versions import lower_bounds  # noqa: E402

SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
STAGES = (
    "install", "env", "import", "recipe_1.3b", "recipe_1.3b_fp8", "kernels", "flash_sweep",
    "auto_table",
    "xla_flags", "gpu_tests", "bench_125m", "bench_1.3b", "precision_350m_bf16",
    "precision_350m_fp8",
)  # fmt: skip


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env.pop("JAX_PLATFORMS", None)
    return env


def _run_check(out: pathlib.Path, *args, python=None, wheels=None, timeout=1500):
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args]
    cmd += ["--python", python or sys.executable, "--wheels", str(wheels or out / "no-wheels")]
    env = _env() | {"OUT": str(out / "OUT")}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _records(out: pathlib.Path) -> list[dict]:
    lines = (out / "OUT" / "results.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _status(records) -> dict:
    return {r["stage"]: r["status"] for r in records if "status" in r and "seconds" in r}


def _check_files_come_back(out: pathlib.Path) -> None:
    """The kit leaves at most 8 files, 2 folders deep, with plain names, to copy back."""
    files = [p for p in (out / "OUT").rglob("*") if p.is_file()]
    assert 3 <= len(files) <= 8, files
    for f in files:
        rel = f.relative_to(out / "OUT")
        assert len(rel.parts) <= 3, rel
        assert all(SAFE_NAME.match(part) for part in rel.parts), rel
        assert f.stat().st_size < 16 * 2**20, rel


def test_lowest_pins_are_pyproject_lower_bounds():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "lowest_versions.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    pins = dict(line.split("==") for line in out)
    assert pins["jax"] == pins["jaxlib"] == "0.11.2"  # the GPU image's jax
    for req in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower()
        assert f">={pins[name]}" in req.replace(" ", ""), (req, pins[name])
    with pytest.raises(ValueError, match="lower bound"):
        lower_bounds(["jax<0.13"])


def test_bundle_leaves_image_packages_and_refuses_the_accelerator_stack(tmp_path):
    names = ["grain-0.2.18-cp312.whl", "numpy-2.5.5-cp312.whl", "tyro-1.0.17-py3.whl"]
    wheels = [tmp_path / n for n in names]
    carried, dropped = gpu_bundle.select(wheels, {"numpy", "absl-py"})
    assert [w.name for w in carried] == [names[0], names[2]]
    assert [w.name for w in dropped] == [names[1]]
    gpu_bundle.check(carried)
    for bad in (["jax-0.11.2-py3.whl"], ["jax_cuda13_plugin-0.11.2-cp312.whl"]):
        with pytest.raises(SystemExit, match="refusing"):
            gpu_bundle.check([tmp_path / b for b in bad])
    with pytest.raises(SystemExit, match="two versions of tyro"):
        gpu_bundle.check([tmp_path / "tyro-1.0.17-py3.whl", tmp_path / "tyro-0.9.9-py3.whl"])
    image = gpu_bundle.image_packages(ROOT / "scripts" / "gpu_image_packages.txt")
    assert {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "pytest"} <= image
    assert not {"grain", "tyro"} & image


def test_a_spent_budget_skips_every_stage_and_still_reports(tmp_path):
    proc = _run_check(tmp_path, "--dry-run", "--budget", "12", timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]  # import never ran: the kit is unproven
    status = _status(_records(tmp_path))
    assert status.pop("install") == "ok"
    assert status and all(s == "skipped: budget" for s in status.values()), status
    assert proc.stdout.strip().splitlines()[-1].startswith("elapsed ")
    _check_files_come_back(tmp_path)


def test_unknown_arguments_are_refused(tmp_path):
    proc = _run_check(tmp_path, "--budgte", "5", timeout=60)
    assert proc.returncode == 2 and "unknown argument --budgte" in proc.stderr


@pytest.mark.kit
@pytest.mark.slow
def test_dry_run_passes_every_stage(tmp_path):
    """gpu_check.sh --dry-run: every stage passes, every e2e line has its figures, the files
    are few enough to copy back, and the summary comes last. With the bundle (in
    `make test-lowest`) meshtrain, grain and tyro import from the installed site, and jax is
    the environment's own."""
    python = os.environ.get("MESHTRAIN_KIT_PYTHON") or sys.executable
    wheels = os.environ.get("MESHTRAIN_KIT_WHEELS") or None
    proc = _run_check(tmp_path, "--dry-run", python=python, wheels=wheels)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _records(tmp_path)
    status = _status(records)
    for stage in (*STAGES, "bench_1.3b_pallas"):
        assert status.get(stage) == "ok", (stage, status)
    e2e = [r for r in records if r.get("benchmark") == "e2e"]
    assert len(e2e) == 3
    for r in e2e:
        assert r["tokens_per_s"] > 0 and r["mfu_convention"] == "causal"
    jax_base = [r for r in e2e if r["jax_baseline"]["status"] == "ok"]
    assert len(jax_base) == 2
    for r in jax_base:
        assert r["ratio_vs_jax"] > 0 and r["first_loss_rel_diff"] < 1e-5
    assert any(r["model"]["attention_impl"] == "pallas" for r in e2e)
    imported = next(r for r in records if r.get("stage") == "import" and "jax" in r)
    env = next(r for r in records if r.get("stage") == "env" and "packages" in r)
    assert imported["jax"] == env["packages"]["jax"]
    if wheels:
        for key in ("meshtrain_file", "grain_file", "tyro_file"):
            assert "gpu_check." in imported[key] and "/site/" in imported[key], imported
        assert "/site/" not in imported["jax_file"]
    kernels = next(r for r in records if r.get("benchmark") == "kernels")
    assert kernels["rows"] and kernels["gpu_figures"] == "unmeasured"
    recipe = [r for r in records if r.get("benchmark") == "meshtrain_bench" and r.get("packed")]
    assert {r["precision"] for r in recipe} >= {"bf16", "fp8"}
    assert all(r["kernels"].startswith("kernels: attention ") for r in recipe)
    sweep = next(r for r in records if r.get("benchmark") == "flash_sweep")
    assert sweep["rows"] and all("config" in r for r in sweep["rows"])
    table = next(r for r in records if "auto_table" in r)
    assert table["written"] is False  # a CPU run measures nothing for the table
    flags = next(r for r in records if r.get("benchmark") == "xla_flags_summary")
    assert set(flags["vs_none"]) == {
        "none",
        "latency_hiding_scheduler",
        "no_triton_gemm",
        "maxtext",
    }
    trace = tmp_path / "OUT" / "trace_1.3b.xplane.pb"
    assert trace.exists() and trace.stat().st_size > 0
    last = proc.stdout.strip().splitlines()
    assert last[-1].startswith("elapsed ") and any(line.startswith("size ") for line in last)
    _check_files_come_back(tmp_path)


@pytest.mark.kit
def test_the_bundle_holds_what_the_image_lacks_and_fits_a_call():
    wheels = os.environ.get("MESHTRAIN_KIT_WHEELS") or str(ROOT / ".whl")
    manifest = json.loads((pathlib.Path(wheels) / "MANIFEST.json").read_text())
    names = {gpu_bundle.wheel_name(pathlib.Path(w["file"]))[0] for w in manifest["wheels"]}
    assert {"grain", "tyro", "setuptools", "flax"} <= names
    assert "jax" in manifest["left_to_the_image"]
    assert not any(gpu_bundle.FORBIDDEN.match(n) for n in names)
    assert manifest["total_bytes"] < 48 * 2**20  # with the checkout, 64 MiB at most


def test_resume_skips_the_stages_an_earlier_run_finished(tmp_path):
    """--resume with an earlier run's results.jsonl: the stages that finished there are not run
    again, the others are."""
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text(
        '{"stage": "gpu_tests", "status": "ok", "seconds": 80}\n'
        '{"stage": "auto_table", "status": "timeout after 30 s", "seconds": 30}\n'
    )
    proc = _run_check(tmp_path, "--dry-run", "--stages", "gpu_tests,auto_table", "--resume",
                      str(earlier), timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = _status(_records(tmp_path))
    assert status["gpu_tests"] == "done earlier" and status["auto_table"] == "ok", status
    missing = _run_check(tmp_path, "--resume", str(tmp_path / "none.jsonl"), timeout=60)
    assert missing.returncode == 2 and "--resume" in missing.stderr


@pytest.mark.slow
def test_stages_selects_what_runs(tmp_path):
    """--stages runs the named stages (and install, env, import) only: a second device call
    picks up where a spent budget stopped the first."""
    proc = _run_check(tmp_path, "--dry-run", "--stages", "gpu_tests", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = _status(_records(tmp_path))
    assert status == {"install": "ok", "env": "ok", "import": "ok", "gpu_tests": "ok"}, status
