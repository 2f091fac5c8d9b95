"""A pytest plugin that records where the suite's time goes, test by test and fixture by fixture.

Loaded by `scripts/suite_profile.py` (``-p _suite_profile --suite-profile-dir DIR``); each
process (the controller and every xdist worker) appends one JSON line per test and per fixture
set-up to ``DIR/<worker>.jsonl``. A record holds the wall seconds, the CPU seconds of this
process and of the child processes it waited for (CLI runs, notebook kernels, the
multi-process tests), the seconds jax spent in XLA's backend compiles in this process, how
many programs XLA compiled and how many came from the persistent compilation cache, and the
seconds jax spent tracing programs to jaxprs and lowering jaxprs to StableHLO.
"""

import json
import os
import time

import pytest

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"


class _Counters:
    """Running totals of jax's compile events in this process."""

    def __init__(self):
        self.compile_s = 0.0
        self.events = 0
        self.hits = 0
        self.trace_s = 0.0
        self.lower_s = 0.0
        self.names: set[str] = set()

    def on_duration(self, event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            self.compile_s += duration
            self.events += 1
            self.names.add(str(kwargs.get("fun_name", "")))
        elif event == TRACE:
            self.trace_s += duration
        elif event == LOWER:
            self.lower_s += duration

    def on_event(self, event, **kwargs):
        if event == CACHE_HIT:
            self.hits += 1

    def snapshot(self):
        return (
            (self.compile_s, self.events, self.hits, self.trace_s, self.lower_s),
            time.perf_counter(),
            _cpu(),
        )


def _cpu():
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


def _delta(before, after):
    ((c0, e0, h0, t0, l0), w0, (s0, k0)), ((c1, e1, h1, t1, l1), w1, (s1, k1)) = before, after
    return {
        "wall_s": round(w1 - w0, 4),
        "cpu_s": round(s1 - s0, 4),
        "child_cpu_s": round(k1 - k0, 4),
        "compile_s": round(c1 - c0, 4),
        # A persistent-cache hit is reported as a backend compile too (it wraps the lookup).
        "compiled": (e1 - e0) - (h1 - h0),
        "cache_hits": h1 - h0,
        "trace_s": round(t1 - t0, 4),
        "lower_s": round(l1 - l0, 4),
    }


def pytest_addoption(parser):
    parser.addoption(
        "--suite-profile-dir",
        default=None,
        help="write one JSON line per test and fixture set-up to DIR/<worker>.jsonl",
    )


class SuiteProfile:
    """The hooks, active only with --suite-profile-dir."""

    def __init__(self, directory: str):
        import jax

        os.makedirs(directory, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self._file = open(os.path.join(directory, f"{worker}.jsonl"), "a")  # noqa: SIM115
        self._worker = worker
        self.counters = _Counters()
        jax.monitoring.register_event_duration_secs_listener(self.counters.on_duration)
        jax.monitoring.register_event_listener(self.counters.on_event)

    def _write(self, record):
        self._file.write(json.dumps({"worker": self._worker, **record}) + "\n")
        self._file.flush()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = self.counters.snapshot()
        outcome = yield
        del outcome
        record = {"kind": "test", "nodeid": item.nodeid, "file": item.location[0]}
        self._write({**record, **_delta(before, self.counters.snapshot())})

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        before = self.counters.snapshot()
        yield
        record = {
            "kind": "fixture",
            "fixture": fixturedef.argname,
            "scope": fixturedef.scope,
            "where": os.path.basename(str(fixturedef.baseid or "conftest")) or "conftest",
            "nodeid": request.node.nodeid,
        }
        self._write({**record, **_delta(before, self.counters.snapshot())})

    def pytest_unconfigure(self, config):
        self._file.close()


def pytest_configure(config):
    directory = config.getoption("--suite-profile-dir")
    if directory and os.environ.get("PYTEST_XDIST_WORKER") is not None:
        config.pluginmanager.register(SuiteProfile(directory), "suite-profile")
    elif directory and not config.getoption("numprocesses", None):
        config.pluginmanager.register(SuiteProfile(directory), "suite-profile")
