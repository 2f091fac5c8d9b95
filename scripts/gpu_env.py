"""Helpers of scripts/gpu_check.sh that need Python: versions, requirement checks, summary.

    python scripts/gpu_env.py versions             # one JSON line: packages, devices
    python scripts/gpu_env.py unmet [NAMES...]     # meshtrain's requirements the env misses
    python scripts/gpu_env.py summary RESULTS      # the table gpu_check.sh prints last

Standard library only (plus `packaging`, or pip's vendored copy), because it runs before the
carried wheels are installed.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHOWN = (
    "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax",
    "orbax-checkpoint", "grain", "tyro", "numpy", "torch", "triton", "pytest", "meshtrain",
)  # fmt: skip

try:
    from packaging.requirements import Requirement
except ImportError:  # pragma: no cover - pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement


def version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def versions() -> dict:
    """Package versions, the devices jax sees, and nvidia-smi's list."""
    out: dict = {"stage": "env", "python": sys.version.split()[0], "executable": sys.executable}
    out["packages"] = {n: version(n) for n in SHOWN}
    try:
        import jax

        out["jax_file"] = jax.__file__
        out["default_backend"] = jax.default_backend()
        out["devices"] = [f"{d.platform}:{d.device_kind}" for d in jax.devices()]
    except Exception as e:  # noqa: BLE001 - a broken jax is what this should show
        out["jax_error"] = f"{type(e).__name__}: {e}"
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = smi.stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        out["nvidia_smi"] = None
    return out


def unmet(names: list[str]) -> list[str]:
    """meshtrain's runtime requirements (pyproject.toml) this environment does not satisfy;
    only those named in `names` when given. Each as "name (have X, need SPEC)"."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bad = []
    for text in project["dependencies"]:
        req = Requirement(text)
        if names and req.name not in names:
            continue
        have = version(req.name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            bad.append(f"{req.name} (have {have}, need {req.specifier})")
    return bad


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def summary(path: str) -> str:
    """A table of the stage records and the e2e figures in a results.jsonl."""
    rows, figures = [], []
    for line in pathlib.Path(path).read_text().splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if "status" in r and "stage" in r and "seconds" in r:
            rows.append(f"{r['stage']:<20} {r['status']:<28} {r['seconds']:>6.0f} s")
        if r.get("benchmark") == "e2e":
            jb, tb = r.get("jax_baseline", {}), r.get("torch_baseline", {})
            mem = r.get("peak_memory_bytes")
            figures.append(
                f"{r['size']:<6} {r['device_kind'][:22]:<22} {r['model']['dtype']:<8} "
                f"{_fmt(r['tokens_per_s'], '>10.0f')} {_fmt(r.get('mfu'), '>6.3f')} "
                f"{_fmt(r.get('mfu_palm'), '>6.3f')} "
                f"{_fmt(r.get('mfu_vs_measured_peak'), '>6.3f')} "
                f"{_fmt(r.get('ratio_vs_jax'), '>6.3f')} {_fmt(r.get('ratio_vs_torch'), '>6.3f')} "
                f"{_fmt(None if mem is None else mem / 2**30, '>6.1f')} "
                f"{_fmt(r['compile_s'], '>6.1f')}  jax:{jb.get('status', '-')[:12]} "
                f"torch:{tb.get('status', '-')[:12]}"
            )
        if r.get("benchmark") == "kernels" and "rows" in r:
            figures.append(f"kernels: {len(r['rows'])} rows, gpu_figures={r.get('gpu_figures')}")
        if r.get("benchmark") == "meshtrain_bench" and r.get("packed"):
            figures.append(
                f"recipe {r['size']} packed {r['precision']}: "
                f"{_fmt(r.get('tokens_per_s'), '.0f')} tokens/s, mfu {_fmt(r.get('mfu'), '.3f')}"
                f" · {r.get('kernels', '')}"
            )
        if r.get("benchmark") == "xla_flags_summary":
            ratios = ", ".join(f"{k} {v:.3f}" for k, v in r["vs_none"].items())
            figures.append(f"xla flags ({r['size']}), tokens/s over none: {ratios}")
        if "auto_table" in r:
            measured = r["rows"] or "nothing measured"
            figures.append(f"auto table: {measured} (written: {r['written']})")
    head = (
        "size   device                 dtype    tokens/s    mfu   mfu_p  mfu_m  vsjax vstrch"
        "  memGB  compS"
    )
    out = ["stage                status                       time"] + rows
    if figures:
        out += ["", "mfu: causal FLOPs / datasheet peak; mfu_p: PaLM FLOPs; mfu_m: causal / "
                "measured matmul peak; vsjax, vstrch: meshtrain tokens/s over the baseline's",
                head] + figures  # fmt: skip
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "versions":
        print(json.dumps(versions()), flush=True)
    elif cmd == "unmet":
        print("\n".join(unmet([re.sub(r"[-_.]+", "-", n).lower() for n in rest])))
    elif cmd == "summary":
        print(summary(rest[0]))
    else:
        print(f"gpu_env: unknown command {cmd!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
