"""The run check's memory check (`meshtrain.fit`): a run that cannot fit its devices is refused
with the estimate and the capacity before anything is allocated; a run that fits starts; the
estimate stays within a stated factor of the compiled step's memory on CPU."""

import logging
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from _helpers import count_compiles, fresh_env
from flax import nnx

import meshtrain as mt
from meshtrain import fit
from meshtrain._units import fmt_bytes
from meshtrain.check import check_run
from meshtrain.comm.compile import compile_step
from meshtrain.comm.inspector import compiled_memory
from meshtrain.models.base import DataSpec
from meshtrain.state import abstract_model

# The estimate over the compiled step's peak (argument + output + temp − alias) on CPU: 0.53
# to 0.77 for these tiny models, 0.71 to 1.18 for the 125m model of the memory guide.
FACTOR = (0.4, 1.5)


def _run(mesh: str = "data=8", strategy: str = "dp", *, batch=16, d_model=64, remat="none", **kw):
    """A tiny GPT run on the 8 simulated devices, and its abstract model."""
    cfg = mt.GPTConfig(d_model=d_model, n_layers=2, n_heads=4, max_seq_len=32, remat=remat)
    m = mt.make_mesh(mesh)
    run = mt.RunSpec(
        model=cfg,
        data=DataSpec("lm", batch, 32, 256, None),
        mesh=m,
        rules=mt.rules_for(strategy, m),
        train=mt.TrainConfig(steps=10, run_dir=""),
        **kw,
    ).resolved()
    return run, abstract_model(lambda: cfg.build(rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("mesh,strategy", [("data=8", "dp"), ("data=2,fsdp=2,tensor=2", "fsdp+tp")])
def test_a_run_ten_times_too_large_is_refused_with_the_estimate(monkeypatch, mesh, strategy):
    rng = np.random.default_rng()
    d_model = int(rng.choice([64, 128, 256]))
    run, abstract = _run(mesh, strategy, d_model=d_model)
    need = fit.estimate(run, abstract).peak
    monkeypatch.setenv(fit.ENV, str(int(need / 10)))
    with count_compiles() as compiles:
        problems = check_run(run, abstract=abstract)
    assert not compiles  # refused before anything compiles
    assert len(problems) == 1, problems
    line = str(problems[0])
    assert "\n" not in line
    assert f"needs about {fmt_bytes(need)} per device" in line, line
    assert f"a device holds {fmt_bytes(int(need / 10))} ({fit.ENV})" in line, line
    assert "use a smaller model or more devices" in line, line  # 10× too large: nothing helps


def test_the_refusal_names_a_setting_that_brings_the_run_under(monkeypatch):
    run, abstract = _run(batch=64)
    need = fit.estimate(run, abstract).peak
    saved = fit.estimate(run, abstract, remat="full").peak
    assert saved < need
    monkeypatch.setenv(fit.ENV, str(int((need + saved) / 2)))
    (problem,) = check_run(run, abstract=abstract)
    assert problem.field == "data.batch_size" and problem.value == 64  # activations dominate
    assert "brings it under: --gpt.remat full" in problem.message, problem.message


def test_a_run_that_fits_is_accepted_and_one_close_to_the_capacity_is_warned(monkeypatch, caplog):
    run, abstract = _run("fsdp=8", "fsdp")
    need = fit.estimate(run, abstract).peak
    monkeypatch.setenv(fit.ENV, str(int(need * 2)))
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        assert check_run(run, abstract=abstract) == []
    assert not caplog.records
    monkeypatch.setenv(fit.ENV, str(int(need / 0.9)))
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        assert check_run(run, abstract=abstract) == []
    assert [r.getMessage() for r in caplog.records if "memory:" in r.getMessage()], caplog.text
    assert check_run(run, abstract=abstract, memory=False) == []  # the inspector's compile


def test_the_default_run_fits_this_host_and_the_capacity_is_shared_by_its_devices(monkeypatch):
    monkeypatch.delenv(fit.ENV, raising=False)
    cfg = mt.GPTConfig()
    run = mt.RunSpec(
        model=cfg, data=DataSpec("lm", 32, 128, 256, None), train=mt.TrainConfig(run_dir="")
    ).resolved()
    assert check_run(run, abstract=abstract_model(lambda: cfg.build(rngs=nnx.Rngs(0)))) == []
    cap = fit.capacity(jax.devices())  # the default mesh's 8 devices
    assert cap is not None and cap.source.endswith("of host memory available / 8")
    with open("/proc/meminfo") as f:
        free = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    assert 0.5 < cap.bytes * 8 / free < 2  # the host's memory, moving while the suite runs


def test_a_capacity_that_is_not_a_size_is_one_line(monkeypatch):
    run, abstract = _run()
    monkeypatch.setenv(fit.ENV, "lots")
    (problem,) = check_run(run, abstract=abstract)
    assert problem.field == fit.ENV and "e.g. 16GB" in problem.message


LAYOUTS: list[tuple[str, str, dict]] = [
    ("data=8", "dp", {}),
    ("fsdp=8", "fsdp", {}),
    ("data=4,tensor=2", "dp+tp", {}),
]


@pytest.mark.parametrize("mesh,strategy,kw", LAYOUTS, ids=[m for m, _, _ in LAYOUTS])
def test_the_estimate_is_within_the_stated_factor_of_the_compiled_step(mesh, strategy, kw):
    run, abstract = _run(mesh, strategy, **kw)
    compiled, _ = compile_step(run)
    peak = compiled_memory(compiled)["peak"]
    ratio = fit.estimate(run, abstract).peak / peak
    assert FACTOR[0] <= ratio <= FACTOR[1], (ratio, peak)


def test_the_cli_refuses_a_model_too_wide_at_once(tmp_path):
    script = str(Path(sys.executable).parent / "meshtrain")
    argv = [script, "train", "--gpt.d-model", "262144", "--no-save"]
    t0 = time.perf_counter()
    proc = subprocess.run(
        argv, cwd=tmp_path, env=fresh_env(), capture_output=True, text=True, timeout=120
    )
    took = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("meshtrain train: error: gpt.d_model=262144: the run needs about ")
    assert " GB per device (parameters " in lines[0] and "a device holds " in lines[0]
    assert took < 20, took  # XLA took 28 s to run out of memory; this compiles nothing
