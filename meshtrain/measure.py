"""Measuring a compiled step on a device: waiting for results, timing with spread, the device's
matmul peak, peak memory, the environment of the run, and profiler traces. Used by
`meshtrain.bench` and the scripts under ``benchmarks/``."""

from __future__ import annotations

import datetime
import os
import pathlib
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def block(tree: Any) -> Any:
    """Waits for every array in `tree`."""
    import jax

    return jax.block_until_ready(tree)


def spread(times: Sequence[float]) -> dict:
    """Median and spread of step times (seconds)."""
    ordered = sorted(times)
    n = len(ordered)

    def pct(q: float) -> float:
        return ordered[min(n - 1, max(0, round(q * (n - 1))))]

    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "p10": pct(0.1),
        "p90": pct(0.9),
        "iqr_over_median": (pct(0.75) - pct(0.25)) / statistics.median(ordered),
        "n": n,
    }


def time_steps(step: Callable, state: Any, batches: Sequence[Any], warmup: int, steps: int):
    """Runs `warmup` untimed steps, `steps` steps each waited for, then `steps` back to back.

    `step(state, batch) -> (state, aux)`; the state is donated, so the newest one is threaded.

    Returns:
        ``(state, synced_times, back_to_back_mean)``, in seconds.
    """
    n = len(batches)
    for i in range(warmup):
        state, aux = step(state, batches[i % n])
    block(state)
    synced = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, aux = step(state, batches[i % n])
        block((state, aux))
        synced.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(steps):
        state, aux = step(state, batches[i % n])
    block((state, aux))
    return state, synced, (time.perf_counter() - t0) / steps


def matmul_peak(n: int, reps: int, warmup: int = 3) -> dict:
    """Median TFLOP/s of a bf16 n×n×n `jnp.dot` (float32 accumulation, bf16 out) over `reps`
    calls, rotating three random input sets (never zeros, which can run faster)."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(1), 6)
    sets = [
        (
            jax.random.normal(keys[i], (n, n), jnp.bfloat16),
            jax.random.normal(keys[i + 3], (n, n), jnp.bfloat16),
        )
        for i in range(3)
    ]
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
    for i in range(warmup + 1):
        block(dot(*sets[i % 3]))
    times = []
    for i in range(max(reps, 1)):
        t0 = time.perf_counter()
        block(dot(*sets[i % 3]))
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {
        "n": n,
        "dtype": "bfloat16",
        "reps": len(times),
        "seconds": t,
        "tflops": 2 * n**3 / t / 1e12,
    }


def memory_figures(device: Any, compiled: Any) -> dict:
    """Peak device memory: the allocator's peak where jax keeps one (GPU), else the compiled
    step's own estimate (arguments + outputs + temporaries − aliased)."""
    out: dict[str, Any] = {}
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        ma = None
    if ma is not None:
        est = (
            ma.argument_size_in_bytes
            + ma.output_size_in_bytes
            + ma.temp_size_in_bytes
            - ma.alias_size_in_bytes
        )
        out["compiled_memory_bytes"] = {
            "argument": int(ma.argument_size_in_bytes),
            "output": int(ma.output_size_in_bytes),
            "temp": int(ma.temp_size_in_bytes),
            "alias": int(ma.alias_size_in_bytes),
            "estimate": int(est),
        }
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "peak_bytes_in_use" in stats:
        out["peak_memory_bytes"] = int(stats["peak_bytes_in_use"])
        out["peak_memory_source"] = "device.memory_stats()['peak_bytes_in_use']"
        if "bytes_limit" in stats:
            out["memory_limit_bytes"] = int(stats["bytes_limit"])
    elif "compiled_memory_bytes" in out:
        out["peak_memory_bytes"] = out["compiled_memory_bytes"]["estimate"]
        out["peak_memory_source"] = (
            "compiled.memory_analysis() estimate (this backend keeps no allocator statistics)"
        )
    else:
        out["peak_memory_bytes"] = None
        out["peak_memory_source"] = "unavailable"
    return out


def environment() -> dict:
    """Device, versions and date of this run."""
    import flax
    import jax
    import jaxlib
    import optax

    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "n_devices": jax.device_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "flax_version": flax.__version__,
        "optax_version": optax.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def profile(step: Callable, state: Any, batches: Sequence[Any], directory: str, n: int):
    """Traces `n` steps with `jax.profiler` into `directory`; returns (state, files written)."""
    import jax

    os.makedirs(directory, exist_ok=True)
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for i in range(n):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                state, aux = step(state, batches[i % len(batches)])
                block((state, aux))
    files = sorted(
        str(p.relative_to(directory)) for p in pathlib.Path(directory).rglob("*") if p.is_file()
    )
    return state, files
