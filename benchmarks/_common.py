"""What the benchmark scripts share: their progress lines on stderr, the options most of them
take, the one JSON line each prints, the median time of a jitted call, and the simulated CPU
devices they run on without an accelerator.

A script run as ``python benchmarks/<name>.py`` finds this module beside it: Python puts the
script's folder first on ``sys.path`` (unless ``PYTHONSAFEPATH`` is set, as scripts/gpu_check.sh
does; the scripts it runs put their folder there themselves). It imports the standard library
only (meshtrain when devices are simulated), so the scripts run on the GPU image can use it too.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable


def logger(name: str) -> Callable[..., None]:
    """``log(*parts)``: one progress line on stderr, prefixed with ``[name]``."""

    def log(*parts) -> None:
        print(f"[{name}]", *parts, file=sys.stderr, flush=True)

    return log


def parser(
    description: str,
    *,
    quick: str = "",
    steps: int | None = None,
    steps_help: str = "train steps to time",
    devices: int | None = None,
    out: bool = False,
) -> argparse.ArgumentParser:
    """An argument parser with the options the scripts share, each only when asked for.

    Args:
        description: the script's one-line description.
        quick: the help of ``--quick`` (the script's smoke-test sizes); empty: no ``--quick``.
        steps: the default of ``--steps``; None: no ``--steps``.
        steps_help: the help of ``--steps``.
        devices: the default of ``--devices``, the simulated devices on the CPU platform (see
            `simulate_cpu_devices`); None: no ``--devices``.
        out: add ``--out PATH``, a file that also gets the JSON line (see `emit`).
    """
    p = argparse.ArgumentParser(description=description)
    if quick:
        p.add_argument("--quick", action="store_true", help=quick)
    if steps is not None:
        p.add_argument("--steps", type=int, default=steps, help=steps_help)
    if devices is not None:
        devices_help = "simulated devices when the platform is CPU"
        p.add_argument("--devices", type=int, default=devices, help=devices_help)
    if out:
        p.add_argument("--out", default="", help="also write the JSON line to this file")
    return p


def emit(record: dict, out: str = "") -> None:
    """Prints `record` as one JSON line on stdout; `out`, when given, gets the same line."""
    line = json.dumps(record)
    if out:
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(line + "\n")
    print(line, flush=True)


def median_seconds(fn, arg_sets, warmup: int, reps: int) -> float:
    """Median seconds of ``fn(*args)`` after warm-up, rotating through `arg_sets`."""
    import jax

    jax.block_until_ready(fn(*arg_sets[0]))  # compile
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    times = []
    for i in range(reps):
        args = arg_sets[i % len(arg_sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def simulate_cpu_devices(n: int) -> None:
    """`n` simulated devices when jax's platform is the CPU (``JAX_PLATFORMS`` unset or
    ``cpu``); on an accelerator, or with `n` 0, the devices are left as they are. Call it before
    jax starts its backend."""
    if n and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        from meshtrain.mesh import simulate_devices

        simulate_devices(n)
