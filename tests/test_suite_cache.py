"""The suite's compilation cache (`_compile_cache`): every process of a run shares it, a fresh
clone's empty one fills, and pruning keeps the newest entries."""

import json
import os
import subprocess
import sys

import _compile_cache
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import fresh_env

# Compiled here and again in a child; `n` makes the program this test run's own.
PROGRAM = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
)
n = int(sys.argv[1])
out = jax.jit(lambda x: jnp.sin(x) * n + x.sum())(np.arange(n, dtype=np.float32))
print(json.dumps({"hits": len(hits), "out": np.asarray(out).tolist(),
                  "dir": jax.config.jax_compilation_cache_dir}))
"""


def _child(n: int, **env: str) -> dict:
    """Runs `PROGRAM` in a fresh process (the suite's environment, plus `env`)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(n)],
        env={**fresh_env(devices=8), **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_compile_cache.directory() is None, reason="MESHTRAIN_TEST_CACHE=off")
def test_a_child_process_reads_what_this_process_compiled(tmp_path):
    n = int(np.random.default_rng().integers(1000, 100_000))  # a program no earlier run compiled
    here = jax.jit(lambda x: jnp.sin(x) * n + x.sum())(np.arange(n, dtype=np.float32))

    # a fresh clone: an empty cache compiles, writes, and gives the same numbers
    empty = tmp_path / "empty"
    first = _child(n, JAX_COMPILATION_CACHE_DIR=str(empty))
    assert first["dir"] == str(empty) and first["hits"] == 0
    assert any(p.name.startswith("jit__lambda") for p in empty.iterdir())
    assert _child(n, JAX_COMPILATION_CACHE_DIR=str(empty))["hits"] == 1

    # the suite's own cache: the child reads the program this process compiled
    shared = _child(n)
    assert (
        shared["dir"] == os.environ["JAX_COMPILATION_CACHE_DIR"] == str(_compile_cache.directory())
    )
    assert shared["hits"] == 1, "the child compiled again what this process had cached"
    np.testing.assert_array_equal(np.asarray(shared["out"], np.float32), np.asarray(here))
    np.testing.assert_array_equal(np.asarray(first["out"], np.float32), np.asarray(here))


def test_prune_keeps_the_newest_entries_under_the_cap(tmp_path):
    for i in range(10):
        entry = tmp_path / f"key{i}-cache"
        entry.write_bytes(b"x" * 100)
        os.utime(entry, (1000 + i, 1000 + i))  # key0 is the oldest
    assert _compile_cache.prune(tmp_path, max_bytes=2000) == 0  # under the cap: untouched
    assert len(list(tmp_path.iterdir())) == 10
    deleted = _compile_cache.prune(tmp_path, max_bytes=900)  # over: down to KEEP of the cap
    left = sorted(p.name for p in tmp_path.iterdir())
    assert deleted == 100 * (10 - len(left)) and len(left) * 100 <= _compile_cache.KEEP * 900
    assert left == [f"key{i}-cache" for i in range(10 - len(left), 10)]


def test_the_cache_can_be_moved_or_switched_off(monkeypatch, tmp_path):
    monkeypatch.setenv(_compile_cache.VARIABLE, "off")
    assert _compile_cache.directory() is None
    monkeypatch.setenv(_compile_cache.VARIABLE, str(tmp_path / "c"))
    assert _compile_cache.directory() == tmp_path / "c"
    monkeypatch.delenv(_compile_cache.VARIABLE)  # a run's first process: a directory of its own
    assert _compile_cache.directory() == _compile_cache.RUNS / f"run-{os.getpid()}"


def test_a_run_removes_what_ended_runs_left_and_keeps_a_running_ones(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    for name in (f"run-{ended.stdout.strip()}", f"run-{os.getpid()}", "old-layout"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "jit_f-cache").write_bytes(b"x")
    (tmp_path / "key-cache").write_bytes(b"x")  # an entry of a cache kept between runs
    removed = _compile_cache.remove_ended_runs(tmp_path)
    assert sorted(p.name for p in removed) == sorted(
        [f"run-{ended.stdout.strip()}", "old-layout", "key-cache"]
    )
    assert [p.name for p in tmp_path.iterdir()] == [f"run-{os.getpid()}"]


def test_this_run_has_its_own_cache_directory():
    """The suite's processes share the run's directory (or the one MESHTRAIN_TEST_CACHE names),
    never an earlier run's."""
    path = _compile_cache.directory()
    if path is None:  # MESHTRAIN_TEST_CACHE=off
        assert "JAX_COMPILATION_CACHE_DIR" not in os.environ
        return
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(path) and path.is_dir()
    if path.parent == _compile_cache.RUNS:  # the run's own: named after a running process
        assert _compile_cache._alive(int(path.name.removeprefix("run-")))
