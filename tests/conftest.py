"""Test setup: force 8 simulated CPU devices before jax initialises, with cheap compiles and
one compilation cache shared by every process of the run (`_compile_cache`)."""

import os

import _compile_cache
from _helpers import FAST_COMPILE  # cheap compiles (jax is not imported yet)

_compile_cache.configure()  # jax's own variables: this process and every child reads them

# Subprocesses that inherit XLA_FLAGS get them too; the notebooks, the CLI's fresh-process runs
# and the benchmarks start without the device count, as a user would (`_helpers.fresh_env`).
# Each flag once: xdist's workers inherit the controller's variables, and the compilation
# cache's key counts every flag as written.
_flags = os.environ.get("XLA_FLAGS", "").split()
_flags += [f for f in ["--xla_force_host_platform_device_count=8", *FAST_COMPILE.split()]
           if f not in _flags]  # fmt: skip
os.environ["XLA_FLAGS"] = " ".join(_flags)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402
from _suite_times import pytest_runtest_logreport, pytest_terminal_summary  # noqa: E402, F401


def pytest_collection_modifyitems(config, items):
    """Skip `gpu`-marked tests when no GPU is present."""
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    # CPU devices: on a GPU host (JAX_PLATFORMS=cuda,cpu, as scripts/gpu_check.sh runs the
    # gpu-marked tests) the default backend is the GPU.
    n = len(jax.devices("cpu"))
    assert n == 8, f"tests need 8 simulated CPU devices, got {n}"


@pytest.fixture
def compiled_path(monkeypatch):
    """The kernels' GPU path (interpret mode keys on the backend, which is the CPU here), for
    the tests that lower kernels for an H100. jax caches traces per function, so the caches
    are cleared on both sides of the switch."""
    from meshtrain.kernels import _common

    jax.clear_caches()
    monkeypatch.setattr(_common, "interpret_mode", lambda: False)
    yield
    jax.clear_caches()
