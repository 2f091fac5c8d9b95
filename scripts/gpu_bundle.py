"""Builds ``.whl/``: the wheels a GPU machine needs and its image lacks (`make gpu-bundle`).

The GPU image (Python 3.12, jax 0.11.2 with the CUDA plugin, flax, optax, orbax-checkpoint,
pytest, torch, ...; the names are in scripts/gpu_image_packages.txt) has no package index.
This downloads, for CPython 3.12 on manylinux x86-64, binary wheels only:

- ``.whl/*.whl``: every package in meshtrain's dependency tree that the image lacks (today
  grain and tyro at the versions this venv runs, and what they and the fallbacks below need:
  array-record, nest-asyncio, ...), resolved once for jax 0.11.2; one version of each.
  `scripts/gpu_check.sh` installs them all with ``pip install --no-index --no-deps
  --target``, so the image's jax, jaxlib and numpy stay.
- ``.whl/build/``: setuptools, so that meshtrain itself builds from the checkout there with
  ``pip install --no-index --find-links .whl/build`` (build isolation, nothing else needed).
- ``.whl/fallback/``: flax, optax and orbax-checkpoint at the lowest versions pyproject.toml
  allows (the versions the lowest-versions CI stage tests on jax 0.11.2). gpu_check.sh
  installs one only if the image's own version is outside pyproject's range.

It refuses a bundle that holds jax, jaxlib, a jax plugin, torch or numpy, two versions of one
package, or more than --max-mib MiB (it travels with the checkout to the GPU machine, 64 MiB in
all), and writes .whl/MANIFEST.json.

    .venv/bin/python scripts/gpu_bundle.py            # what `make gpu-bundle` runs
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLATFORM_ARGS = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    *[
        arg
        for plat in (
            "manylinux_2_28_x86_64",
            "manylinux_2_27_x86_64",
            "manylinux_2_24_x86_64",
            "manylinux_2_17_x86_64",
            "manylinux2014_x86_64",
            "manylinux_2_12_x86_64",
            "manylinux2010_x86_64",
            "manylinux1_x86_64",
        )
        for arg in ("--platform", plat)
    ],
]
# Never carried: the image's own accelerator stack and what is compiled against it.
FORBIDDEN = re.compile(r"^(jax|jaxlib|jax[-_]cuda.*|nvidia[-_].*|torch|triton|numpy)$")
FALLBACK = ("flax", "optax", "orbax-checkpoint")


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: pathlib.Path) -> tuple[str, str]:
    """(normalized project name, version) of a wheel file."""
    name, version = path.name.split("-")[:2]
    return normalize(name), version


def image_packages(path: pathlib.Path) -> set[str]:
    lines = path.read_text().splitlines()
    return {normalize(x) for x in lines if x.strip() and not x.startswith("#")}


def requirement_names(reqs: list[str]) -> list[str]:
    return [normalize(re.match(r"^\s*([A-Za-z0-9_.\-]+)", r).group(1)) for r in reqs]


def select(wheels: list[pathlib.Path], image: set[str]) -> tuple[list, list]:
    """Splits downloaded wheels into (carried, left to the image)."""
    carried, dropped = [], []
    for w in sorted(wheels):
        (dropped if wheel_name(w)[0] in image else carried).append(w)
    return carried, dropped


def check(bundle: list[pathlib.Path]) -> None:
    """One version per project, and nothing from the image's accelerator stack."""
    seen: dict[str, str] = {}
    for w in bundle:
        name, version = wheel_name(w)
        if FORBIDDEN.match(name):
            raise SystemExit(f"gpu_bundle: refusing to carry {w.name}: the image's own {name}")
        if name in seen and seen[name] != version:
            raise SystemExit(f"gpu_bundle: two versions of {name}: {seen[name]} and {version}")
        seen[name] = version


def download(specs: list[str], dest: pathlib.Path, *, deps: bool) -> list[pathlib.Path]:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-cache-dir", *PLATFORM_ARGS]
    cmd += ([] if deps else ["--no-deps"]) + ["-d", str(dest), *specs]
    print("gpu_bundle:", "pip download", " ".join(specs), flush=True)
    subprocess.run(cmd, check=True)
    return sorted(dest.glob("*.whl"))


def resolve(specs: list[str]) -> dict[str, str]:
    """{name: version} of the whole dependency tree of `specs` for the target platform, as pip
    resolves it (metadata only: `pip install --dry-run --report`, nothing installed)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed"]
        cmd += [*PLATFORM_ARGS, "--target", str(pathlib.Path(tmp) / "t"), "--report", str(report)]
        print("gpu_bundle: resolving", " ".join(specs), flush=True)
        subprocess.run([*cmd, *specs], check=True)
        items = json.loads(report.read_text())["install"]
    return {normalize(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / ".whl"), help="the bundle directory")
    p.add_argument("--image", default=str(ROOT / "scripts" / "gpu_image_packages.txt"))
    p.add_argument("--max-mib", type=float, default=48.0, help="refuse a larger bundle")
    args = p.parse_args(argv)

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    image = image_packages(pathlib.Path(args.image))
    needed = [n for n in requirement_names(project["dependencies"]) if n not in image]
    pins = [f"{n}=={md.version(n)}" for n in needed]  # the versions this venv runs and tests
    sys.path.insert(0, str(ROOT / "scripts"))
    from lowest_versions import lower_bounds

    low = lower_bounds(project["dependencies"])
    fallback = [f"{n}=={low[n]}" for n in FALLBACK]

    # Resolve as the GPU machine will run it: the image's jax, the lowest flax/optax/orbax (the
    # fallbacks), and the carried packages at this venv's versions; carry what the image lacks.
    others = [
        f"{n}=={md.version(n)}"
        for n in requirement_names(project["dependencies"])
        if n not in needed and n not in FALLBACK and n != "jax"
    ]
    resolved = resolve([f"jax=={low['jax']}", *fallback, *pins, *others])
    out = pathlib.Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        lacking = [f"{n}=={v}" for n, v in sorted(resolved.items()) if n not in image]
        carried, dropped = select(download(lacking, tmp / "main", deps=False), image)
        dropped = sorted(n for n in resolved if n in image)
        build = download(["setuptools>=69"], tmp / "build", deps=False)
        fall = download(fallback, tmp / "fallback", deps=False)
        check(carried)
        check(fall)
        if out.exists():
            shutil.rmtree(out)
        for sub, files in (("", carried), ("build", build), ("fallback", fall)):
            (out / sub).mkdir(parents=True, exist_ok=True)
            for f in files:
                shutil.copy2(f, out / sub / f.name)

    files = sorted(out.rglob("*.whl"))
    total = sum(f.stat().st_size for f in files)
    manifest = {
        "python": "3.12",
        "platform": "manylinux x86_64",
        "pins": pins,
        "fallback": fallback,
        "left_to_the_image": dropped,
        "total_bytes": total,
        "wheels": [
            {
                "file": str(f.relative_to(out)),
                "bytes": f.stat().st_size,
                "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
            }
            for f in files
        ],
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for f in files:
        print(f"  {f.relative_to(out)}  {f.stat().st_size / 2**20:.2f} MiB")
    print(
        f"gpu_bundle: {len(files)} wheels, {total / 2**20:.1f} MiB in {out} "
        f"(left to the image: {', '.join(manifest['left_to_the_image']) or 'nothing'})"
    )
    if total > args.max_mib * 2**20:
        raise SystemExit(f"gpu_bundle: {total / 2**20:.1f} MiB > --max-mib {args.max_mib}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
