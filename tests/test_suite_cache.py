"""The suite's compilation cache (`_compile_cache`): every process of a run shares it, a fresh
clone's empty one fills, and pruning keeps the newest entries."""

import json
import os
import subprocess
import sys

import _cache_guard
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
    monkeypatch.setenv(_compile_cache.VARIABLE, "run")  # a directory of the run's own
    assert _compile_cache.directory() == _compile_cache.RUNS / f"run-{os.getpid()}"
    monkeypatch.delenv(_compile_cache.VARIABLE)  # the one kept between runs
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    assert _compile_cache.directory() == tmp_path / "home" / "meshtrain" / "test-xla-cache"


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


def test_this_run_uses_the_directory_it_chose():
    """The suite's processes share one directory: the kept one, the one MESHTRAIN_TEST_CACHE
    names, or the run's own (never an ended run's)."""
    path = _compile_cache.directory()
    if path is None:  # MESHTRAIN_TEST_CACHE=off
        assert "JAX_COMPILATION_CACHE_DIR" not in os.environ
        return
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(path) and path.is_dir()
    if path.parent == _compile_cache.RUNS:  # the run's own: named after a running process
        assert _compile_cache._alive(int(path.name.removeprefix("run-")))


# A collective inside a conditional's branch (an all-reduce under `lax.cond`, as local SGD's
# synchronising step has), the same collective outside any branch, and a collective permute
# under `lax.cond` (as every pipeline schedule's sends are).
GUARDED = """
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jax._src.compiler as compiler
mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
rows = NamedSharding(mesh, P("d"))
x = jax.device_put(jnp.arange(8.0 * int(sys.argv[1])).reshape(8, -1), rows)
def branchy(x, flag):
    mean = lambda v: jax.sharding.reshard(jnp.broadcast_to(v.mean(0), v.shape), rows)
    return jax.lax.cond(flag > 0, mean, lambda v: v, x)
def plain(x, flag):
    return jax.sharding.reshard(jnp.broadcast_to(x.mean(0), x.shape), rows) * flag
def send(v, flag):
    shift = lambda u: jax.lax.ppermute(u, "d", [(i, (i + 1) % 8) for i in range(8)])
    return jax.lax.cond(flag > 0, shift, lambda u: u, v)
sends = jax.shard_map(send, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
outs = [jax.jit(f)(x, 1) for f in (branchy, plain, sends)]
print(json.dumps({"guarded": getattr(compiler._cache_write, "_meshtrain_guard", False),
                  "entries": sorted(os.listdir(jax.config.jax_compilation_cache_dir)),
                  "same": bool(jnp.allclose(outs[0], outs[1])),
                  "sent": bool((np.asarray(outs[2]) == np.roll(np.asarray(x), 1, axis=0)).all())}))
"""


def _guarded_child(n: int, cache, **env: str) -> dict:
    """Runs `GUARDED` in a fresh process of the run with its cache in `cache`."""
    proc = subprocess.run(
        [sys.executable, "-c", GUARDED, str(n)],
        env={**fresh_env(devices=8), "JAX_COMPILATION_CACHE_DIR": str(cache), **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_process_of_the_run_caches_what_jaxlib_cannot_read_back(tmp_path):
    """jaxlib 0.12's CPU client crashes running such programs read back from the cache
    (`_cache_guard`). A child process of the run writes the plain program and leaves the
    branchy one out, and writes the permute under `lax.cond` (those read back fine); one whose
    XLA flags leave the concurrency-optimised scheduler on writes none of the three (all hold
    collectives)."""
    n = int(np.random.default_rng().integers(2, 1000))
    child = _guarded_child(n, tmp_path / "suite")
    assert child["guarded"] and child["same"] and child["sent"]
    assert any(e.startswith("jit_plain") for e in child["entries"]), child["entries"]
    assert any(e.startswith("jit_send") for e in child["entries"]), child["entries"]
    assert not any(e.startswith("jit_branchy") for e in child["entries"]), child["entries"]

    flags = "--xla_force_host_platform_device_count=8"  # without the scheduler flag
    other = _guarded_child(n, tmp_path / "other", XLA_FLAGS=flags)
    assert not any(e.startswith(("jit_plain", "jit_branchy", "jit_send")) for e in other["entries"])
    assert any(e.startswith("jit_iota") for e in other["entries"])  # no collective: written


def test_the_guard_finds_a_collective_only_inside_a_branch():
    """The HLO check itself, on the text XLA prints: a collective reached through a fusion
    called from a branch counts, unless it is a collective permute; one in the entry
    computation does not."""
    hlo = """HloModule m
%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}
%inner (p: f32[4]) -> f32[4] {
  ROOT %r = f32[4] all-reduce(f32[4] %p), to_apply=%add
}
%taken (t: (f32[4])) -> f32[4] {
  ROOT %c = f32[4] call(f32[4] %x), to_apply=%inner
}
%skipped (t: (f32[4])) -> f32[4] {
  ROOT %y = f32[4] get-tuple-element((f32[4]) %t), index=0
}
ENTRY %main (p: f32[4], k: s32[]) -> f32[4] {
  %a = f32[4] all-reduce(f32[4] %p), to_apply=%add
  ROOT %o = f32[4] BRANCHES
}
"""
    branches = "conditional(s32[] %k, (f32[4]) %t, (f32[4]) %t), "
    hlo = hlo.replace("BRANCHES", branches + "branch_computations={%taken, %skipped}")
    assert _cache_guard.branch_collectives(hlo) == ["taken"]
    without = hlo.replace("all-reduce(f32[4] %p), to_apply=%add\n}", "negate(f32[4] %p)\n}", 1)
    assert _cache_guard.branch_collectives(without) == []
    permute = "collective-permute(f32[4] %p), source_target_pairs={{0,1},{1,0}}\n}"
    sends = hlo.replace("all-reduce(f32[4] %p), to_apply=%add\n}", permute, 1)
    assert "collective-permute" in sends and _cache_guard.branch_collectives(sends) == []
