"""The suite's time budget at the end of every run: the seconds spent in tests, and the ten
files that took longest (set-up, call and tear-down of their tests, whichever worker ran them).

conftest.py imports these hooks. On the controller (or a run without workers) they add the
durations of every test report and, at the end, print the summary and write it as JSON to
``build/suite_times.json`` (``.ci/run`` prints it again after the lowest-versions stage, whose
runs write theirs elsewhere: ``MESHTRAIN_SUITE_TIMES``, set by ``scripts/ci_lowest.sh``).
"""

import collections
import json
import os
from pathlib import Path

import _compile_cache

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / os.environ.get("MESHTRAIN_SUITE_TIMES", "build/suite_times.json")
SLOWEST = 10
_by_file: dict[str, float] = collections.defaultdict(float)


def pytest_runtest_logreport(report):
    """Adds one phase of one test to its file's total (the controller sees every worker's)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    _by_file[report.nodeid.split("::")[0]] += report.duration


def summary(by_file: dict[str, float], wall: float, cache: dict | None = None) -> dict:
    """The total test seconds, the run's wall seconds, the slowest files and what the
    compilation cache held at the start (`cache`: programs and bytes, when there was one)."""
    slowest = sorted(by_file.items(), key=lambda kv: -kv[1])[:SLOWEST]
    return {
        "test_seconds": round(sum(by_file.values()), 1),
        "wall_seconds": round(wall, 1),
        "files": len(by_file),
        "slowest_files": [[name, round(s, 1)] for name, s in slowest],
        "cache_at_start": cache or None,
    }


def render(s: dict) -> str:
    """The summary as the lines a person reads at the end of the run."""
    lines = [
        f"suite: {s['test_seconds']:.0f} s in the tests of {s['files']} files "
        f"({s['wall_seconds']:.0f} s wall); the {len(s['slowest_files'])} slowest files:"
    ]
    lines += [f"  {sec:7.1f} s  {name}" for name, sec in s["slowest_files"]]
    if cache := s.get("cache_at_start"):
        lines.append(
            f"compilation cache at the start: {cache['programs']} programs, "
            f"{cache['bytes'] / 2**20:.0f} MiB (an empty one compiles everything)"
        )
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter):
    if "PYTEST_XDIST_WORKER" in os.environ or not _by_file:
        return
    start = getattr(terminalreporter, "_session_start", None)  # pytest's own clock
    wall = start.elapsed().seconds if hasattr(start, "elapsed") else 0.0
    s = summary(_by_file, wall, _compile_cache.AT_START)
    terminalreporter.write_line(render(s))
    if not os.environ.get("PYTEST_CURRENT_TEST"):  # not a pytest run inside a test
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(s, indent=1) + "\n")


if __name__ == "__main__":  # `.ci/run` prints the last run's summary again at its end
    import sys

    if not OUT.exists():
        sys.exit(f"no {OUT.name}: run the suite first")
    print(render(json.loads(OUT.read_text())))
