"""The suite's own measurements: `scripts/suite_profile.py` counts a file's compiles, its
programs and its child processes' CPU seconds, and compares with an earlier run;
`_suite_times` ranks the slowest files."""

import json
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import _compile_cache
import _suite_times
from _helpers import fresh_env

ROOT = Path(__file__).resolve().parents[1]

# Two programs, one of them run twice (compiled once); then a child process that burns CPU.
TINY = textwrap.dedent(
    """
    import subprocess, sys
    import jax, jax.numpy as jnp, numpy as np

    def test_compiles_two_programs():
        x = np.arange(8, dtype=np.float32)
        jax.jit(lambda x: jnp.sin(x) * {n})(x).block_until_ready()
        again = jax.jit(lambda x: jnp.cos(x) + {n})
        again(x).block_until_ready()
        again(x + 1).block_until_ready()  # the same shapes: the same executable

    def test_waits_for_a_busy_child():
        subprocess.run([sys.executable, "-c", "sum(i * i for i in range(10**7))"], check=True)
    """
)


def test_the_profile_counts_a_files_programs_and_its_childrens_cpu(tmp_path):
    target = tmp_path / "test_tiny.py"
    target.write_text(TINY.format(n=tmp_path.stat().st_ino % 1000 + 2))  # this run's programs
    env = fresh_env() | {"MESHTRAIN_TEST_CACHE": "off", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    proc = subprocess.run(
        [sys.executable, "scripts/suite_profile.py", "--dir", str(tmp_path / "records"),
         "--json", str(tmp_path / "after.json"), "--",
         str(target), "-n", "0", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = json.loads((tmp_path / "after.json").read_text())
    assert after["totals"]["tests"] == 2
    ((name, row),) = after["files"].items()
    assert Path(name).name == "test_tiny.py" and row["n"] == 2
    assert row["compiled"] == 2 and row["cache_hits"] == 0 and row["compile_s"] > 0
    assert row["trace_s"] > 0 and row["lower_s"] > 0  # each program was traced and lowered
    assert after["cache"] == "off" and after["jax"] == version("jax") and after["date"]
    assert row["child_cpu_s"] > 0.2  # the child's loop, counted for the test that waited
    # against an earlier run of 100 CPU-s: the ratio of the two
    before = tmp_path / "before.json"
    before.write_text(json.dumps({"files": {name: {"cpu_s": 100.0, "child_cpu_s": 0.0}}}))
    report = subprocess.run(
        [sys.executable, "scripts/suite_profile.py", "--report", str(tmp_path / "records"),
         "--compare", str(before)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr[-3000:]
    compared = report.stdout.split("CPU seconds per file")[1].splitlines()
    (line,) = [x for x in compared if x.startswith(name + " ")]
    then, now, ratio = line.split()[-3:]
    assert then == "100" and now == f"{row['cpu_s'] + row['child_cpu_s']:.0f}"
    assert ratio == f"{(row['cpu_s'] + row['child_cpu_s']) / 100:.2f}", line


def test_the_run_summary_names_the_slowest_files_first():
    times = {f"tests/test_{i}.py": float(i) for i in range(14)}
    s = _suite_times.summary(times, wall=50.0)
    assert s["test_seconds"] == sum(range(14)) and s["files"] == 14
    assert [name for name, _ in s["slowest_files"]] == [
        f"tests/test_{i}.py" for i in range(13, 3, -1)
    ]
    assert "tests/test_13.py" in _suite_times.render(s)
    assert "compilation cache" not in _suite_times.render(s)  # a run without one
    warm = _suite_times.summary(times, wall=50.0, cache={"programs": 7, "bytes": 3 << 20})
    assert "compilation cache at the start: 7 programs, 3 MiB" in _suite_times.render(warm)


def test_the_cache_contents_count_programs_and_bytes(tmp_path):
    for i, size in enumerate([10, 20, 30]):
        (tmp_path / f"jit_f{i}-{i:064x}-cache").write_bytes(b"x" * size)
    (tmp_path / "jit_f0-atime").write_bytes(b"x")  # not a program
    assert _compile_cache.contents(tmp_path) == {"programs": 3, "bytes": 60}


def test_a_bad_compare_file_is_one_line_before_anything_runs(tmp_path):
    (tmp_path / "not.json").write_text("{")
    (tmp_path / "no_files.json").write_text('{"totals": {}}')
    for name, says in [
        ("missing.json", "no such file"),
        ("not.json", "not JSON"),
        ("no_files.json", "no per-file table"),
    ]:
        proc = subprocess.run(
            [sys.executable, "scripts/suite_profile.py", "--dir", str(tmp_path / "records"),
             "--compare", str(tmp_path / name)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"suite_profile: --compare {tmp_path / name}: {says}"), line
        assert "--json FILE" in line
    assert not (tmp_path / "records").exists()  # the suite did not start
