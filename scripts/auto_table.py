"""Writes the table ``impl="auto"`` reads (kernels/auto_table.json) from kernel benchmark
records: ``benchmarks/kernels.py``'s JSON (one object per file, or one per line).

    python scripts/auto_table.py benchmarks/results/kernels_gpu.json [MORE...] [--date D]

Rows from every file are merged (a later file's row replaces an earlier one for the same device
kind, op and shape; --merge keeps the table's own rows and sources first). The table lists its
sources, so `tests/test_kernels_auto.py` can write it again and compare. The GPU check runs this
after its kernels stage into its output folder; commit that run's results under
benchmarks/results/ and run this with --merge on them to update the committed table. Prints one
JSON line: the rows per device kind.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernels"))  # autotable needs nothing of the package at import
import autotable  # noqa: E402


def records(path: pathlib.Path) -> list[dict]:
    """The JSON objects in `path`: a whole-file object, or one per line."""
    text = path.read_text()
    try:
        return [json.loads(text)]
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="kernel benchmark records (paths from the repo root)")
    p.add_argument("--date", default="", help="YYYY-MM-DD, for records that carry no date")
    p.add_argument("--out", type=pathlib.Path, default=autotable.TABLE, help="the table to write")
    p.add_argument("--merge", action="store_true", help="keep the rows --out already has")
    args = p.parse_args(argv)
    missing = [path for path in args.results if not pathlib.Path(path).is_file()]
    if missing:
        print(f"auto_table: no such results file: {', '.join(missing)}", file=sys.stderr)
        return 2
    old = json.loads(args.out.read_text()) if args.merge and args.out.exists() else {}
    merged = {_key(r): r for r in old.get("rows", [])}
    sources, measured = list(old.get("sources", [])), 0
    for path in args.results:
        rows = autotable.table_from(records(pathlib.Path(path)), date=args.date)
        merged.update({_key(row): row for row in rows})
        sources += [path] if rows and path not in sources else []
        measured += len(rows)
    if not measured:  # a CPU run (the GPU check's dry run): nothing measured, nothing written
        print(json.dumps({"auto_table": args.out.name, "rows": {}, "written": False}))
        return 0
    rows = [merged[k] for k in sorted(merged)]
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["device_kind"]] = kinds.get(r["device_kind"], 0) + 1
    table = {
        "what": "forward+backward milliseconds per implementation; impl='auto' runs the fastest",
        "written_by": "python scripts/auto_table.py SOURCES... --date " + (args.date or "''"),
        "sources": sources,
        "rows": rows,
    }
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(json.dumps({"auto_table": args.out.name, "rows": kinds, "written": True}))
    return 0


def _key(row: dict) -> tuple:
    return (row["device_kind"], row["op"], json.dumps(row["shape"], sort_keys=True))


if __name__ == "__main__":
    sys.exit(main())
