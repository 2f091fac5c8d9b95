"""Prints the lowest versions pyproject.toml allows, one ``name==version`` a line.

Each runtime dependency's ``>=`` bound becomes an ``==`` pin, and jaxlib is pinned to jax's
bound (jax needs the matching jaxlib). `make test-lowest` installs these into a second venv.

    python scripts/lowest_versions.py            # runtime dependencies
    python scripts/lowest_versions.py --dev      # also the [dev] extra's lower bounds
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
_REQ = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*(.*)$")


def lower_bounds(requirements: list[str]) -> dict[str, str]:
    """{name: lowest version} from requirement strings; every one must have a ``>=`` bound."""
    pins = {}
    for req in requirements:
        m = _REQ.match(req)
        if not m:
            raise ValueError(f"cannot read requirement {req!r}")
        name, spec = m.group(1).lower(), m.group(2)
        low = [s.strip()[2:].strip() for s in spec.split(",") if s.strip().startswith(">=")]
        if len(low) != 1:
            raise ValueError(f"requirement {req!r} needs exactly one '>=' lower bound")
        pins[name] = low[0]
    return pins


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dev", action="store_true", help="also the [dev] extra")
    args = p.parse_args(argv)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    if args.dev:
        reqs += project["optional-dependencies"]["dev"]
    pins = lower_bounds(reqs)
    if "jax" in pins:
        pins.setdefault("jaxlib", pins["jax"])
    sys.stdout.write("".join(f"{name}=={version}\n" for name, version in pins.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
