"""Where the suite's time goes: runs pytest as `make test` does, with a recording plugin, and
prints a table per file and per fixture.

    .venv/bin/python scripts/suite_profile.py                 # the whole suite, as make test
    .venv/bin/python scripts/suite_profile.py -- tests/test_moe.py -n 0
    .venv/bin/python scripts/suite_profile.py --report build/suite_profile   # tables only

Columns: wall seconds (summed over the tests of a file, whichever worker ran them), CPU seconds
of the pytest process and of the child processes it waited for (CLI runs, notebook kernels,
multi-process tests), the seconds XLA spent compiling in the pytest process (jax reports them;
a child process's compiles count in its CPU seconds only), the programs XLA compiled and those
the persistent compilation cache returned instead, and the seconds jax spent tracing functions
to jaxprs and lowering those to StableHLO (in the pytest process too). Fixture rows are
inclusive: a fixture's set-up counts the fixtures it requests. ``--markdown`` prints the
tables for the docs; ``--json FILE`` writes the totals and rows; ``--compare FILE`` adds a
table of each file's CPU seconds (its own and its children's) beside those of an earlier
run's ``--json``.

    .venv/bin/python scripts/suite_profile.py --report build/suite_profile \
        --compare benchmarks/results/2026-11-27-cpu-suite-profile-before.json --markdown
"""

import argparse
import collections
import datetime
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAKE_TEST_ARGS = ["-n", "2", "--dist", "loadgroup", "-q", "-m", "not kit and not lowest"]
FIELDS = ("wall_s", "cpu_s", "child_cpu_s", "compile_s", "compiled", "cache_hits")
FIELDS += ("trace_s", "lower_s")


def run_suite(directory: pathlib.Path, pytest_args: list[str]) -> tuple[int, float]:
    """Runs pytest with the recording plugin; returns its exit code and wall seconds."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", *MAKE_TEST_ARGS, *pytest_args]
    cmd += ["-p", "_suite_profile", f"--suite-profile-dir={directory}"]
    print("suite_profile:", " ".join(cmd[2:]), flush=True)
    start = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    return rc, time.perf_counter() - start


def load(directory: pathlib.Path) -> list[dict]:
    """Every record the plugin wrote under `directory`."""
    records = []
    for path in sorted(directory.glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


def table(records: list[dict], key) -> list[tuple[str, dict]]:
    """Sums the fields of `records` grouped by `key`, largest CPU time first."""
    rows: dict[str, dict] = collections.defaultdict(lambda: {f: 0.0 for f in FIELDS} | {"n": 0})
    for r in records:
        row = rows[key(r)]
        row["n"] += 1
        for f in FIELDS:
            row[f] += r.get(f, 0.0)  # records of older runs lack trace_s, lower_s
    return sorted(rows.items(), key=lambda kv: -(kv[1]["cpu_s"] + kv[1]["child_cpu_s"]))


def layout(title: str, head: list[str], body: list[list[str]], markdown: bool) -> str:
    """A table with its title, as aligned text or Markdown (numbers right-aligned)."""
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return f"{title}\n\n" + "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([title, fmt.format(*head), *(fmt.format(*row) for row in body)])


def render(title: str, label: str, rows, limit: int, markdown: bool) -> str:
    """One table of `rows` (see `table`)."""
    head = [label, "n", "wall s", "CPU s", "child CPU s", "compile s", "compiled", "cache hits"]
    head += ["trace s", "lower s"]
    body = [
        [name, f"{r['n']}", f"{r['wall_s']:.0f}", f"{r['cpu_s']:.0f}", f"{r['child_cpu_s']:.0f}"]
        + [f"{r['compile_s']:.0f}", f"{r['compiled']:.0f}", f"{r['cache_hits']:.0f}"]
        + [f"{r['trace_s']:.0f}", f"{r['lower_s']:.0f}"]
        for name, r in rows[:limit]
    ]
    return layout(title, head, body, markdown)


def compare(before: dict, by_file, limit: int, markdown: bool) -> str:
    """Each file's CPU seconds (its own and its children's) then and now, the largest first."""
    then = {name: r["cpu_s"] + r["child_cpu_s"] for name, r in before["files"].items()}
    now = {name: r["cpu_s"] + r["child_cpu_s"] for name, r in by_file}
    names = sorted(then.keys() | now.keys(), key=lambda n: -max(then.get(n, 0), now.get(n, 0)))
    head = ["file", "CPU s before", "CPU s after", "after/before"]
    body = [
        [name, *(f"{run[name]:.0f}" if name in run else "-" for run in (then, now))]
        + [f"{now[name] / then[name]:.2f}" if then.get(name) and name in now else "-"]
        for name in names[:limit]
    ]
    body.append(["all files", f"{sum(then.values()):.0f}", f"{sum(now.values()):.0f}"])
    body[-1].append(f"{sum(now.values()) / max(sum(then.values()), 1e-9):.2f}")
    title = "CPU seconds per file (the test's own and its child processes')"
    return layout(title, head, body, markdown)


def earlier_run(path: str) -> dict | str:
    """An earlier run's ``--json``, or what is wrong with `path` (one line, with the fix)."""
    file = pathlib.Path(path)
    if not file.is_file():
        return "no such file; pass the FILE an earlier run wrote with --json FILE"
    try:
        data = json.loads(file.read_text())
    except ValueError as e:
        return f"not JSON ({e}); pass the FILE an earlier run wrote with --json FILE"
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        return "no per-file table ('files'); pass the FILE an earlier run wrote with --json FILE"
    return data


def cache_at_start() -> str:
    """The compilation cache the run will use (`tests/_compile_cache.py`) and what it holds."""
    sys.path.insert(0, str(ROOT / "tests"))
    import _compile_cache

    path = _compile_cache.directory()
    if path is None:
        return "off"
    if path.parent == _compile_cache.RUNS:
        return "the run's own, empty at the start"
    held = _compile_cache.contents(path)  # nothing when the directory does not exist yet
    where = str(path).replace(str(pathlib.Path.home()), "~", 1)
    return f"{where}, {held['programs']} programs ({held['bytes'] / 2**20:.0f} MiB) at the start"


def totals(tests: list[dict]) -> dict:
    """The sums over every test."""
    return {f: round(sum(r.get(f, 0.0) for r in tests), 1) for f in FIELDS} | {"tests": len(tests)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="build/suite_profile", help="where the records go")
    p.add_argument("--report", metavar="DIR", help="only print the tables of an earlier run")
    p.add_argument("--top", type=int, default=40, help="rows per table")
    p.add_argument("--markdown", action="store_true", help="Markdown tables (for the docs)")
    p.add_argument("--json", metavar="FILE", help="also write totals and rows as JSON")
    p.add_argument("--compare", metavar="FILE", help="an earlier run's --json to compare with")
    p.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = p.parse_args()
    before = earlier_run(args.compare) if args.compare else None
    if isinstance(before, str):
        print(f"suite_profile: --compare {args.compare}: {before}", file=sys.stderr)
        return 2

    rc, wall, cache = 0, None, None
    directory = ROOT / (args.report or args.dir)
    if not args.report:
        cache = cache_at_start()
        rc, wall = run_suite(directory, args.pytest_args)
    records = load(directory)
    if not records:
        print(f"suite_profile: no records under {directory}", file=sys.stderr)
        return rc or 2
    tests = [r for r in records if r["kind"] == "test"]
    fixtures = [r for r in records if r["kind"] == "fixture"]
    by_file = table(tests, lambda r: r["file"])
    by_fixture = table(fixtures, lambda r: f"{r['fixture']} ({r['scope']}, {r['where']})")
    by_fixture = [kv for kv in by_fixture if kv[1]["wall_s"] >= 1.0]
    total = totals(tests) | ({"pytest_wall_s": round(wall, 1)} if wall is not None else {})
    print()
    print("suite_profile: totals", json.dumps(total))
    print(render("Per file", "file", by_file, args.top, args.markdown))
    print()
    print(
        render(
            "Per fixture (set-ups of 1 s or more)", "fixture", by_fixture, args.top, args.markdown
        )
    )
    if before is not None:
        print()
        print(compare(before, by_file, args.top, args.markdown))
    if args.json:
        out = {
            "machine": f"{os.cpu_count()} CPU cores, pytest {' '.join(MAKE_TEST_ARGS[:2])}",
            "jax": importlib.metadata.version("jax"),
            "date": datetime.date.today().isoformat(),
            "command": " ".join(["scripts/suite_profile.py", *sys.argv[1:]]),
            **({"cache": cache} if cache is not None else {}),
            "totals": total,
            "files": dict(by_file),
            "fixtures": dict(by_fixture),
            "tests": sorted(tests, key=lambda r: -r["cpu_s"] - r["child_cpu_s"])[:50],
        }
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
