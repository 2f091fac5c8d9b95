"""Shared helpers for the kernel tests: fresh random inputs and a relative-error check."""

from __future__ import annotations

import secrets

import jax
import jax.numpy as jnp
import numpy as np

# ‖out − ref‖ / ‖ref‖ bounds per dtype (forward, gradients). The reference runs in float32 on
# the same (possibly bf16-rounded) inputs, so bf16 errors come from the kernel's bf16 operands.
TOL = {jnp.float32: (2e-5, 1e-4), jnp.bfloat16: (2e-2, 3e-2)}


def fresh_key() -> tuple[jax.Array, int]:
    """A new random key each run, with its seed (printed on failure to reproduce it)."""
    seed = secrets.randbits(31)
    return jax.random.key(seed), seed


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere gives inf."""
    a = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_close(out, ref, tol, what, seed):
    """Fails with the error, the bound and the seed."""
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != {ref.shape}"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e} (seed {seed})"


def assert_all_written(*arrays):
    """Every element finite: outputs built under `poison_outputs` left no NaN-filled block."""
    for a in arrays:
        assert bool(jnp.all(jnp.isfinite(a))), "an output element was never written"


# --- lowering for an H100 on a CPU-only machine ----------------------------------------------

TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call a Pallas-Triton kernel lowers to


def h100():
    """An abstract H100, for abstract meshes that export for ``cuda`` without a GPU."""
    from jax.sharding import AbstractDevice

    return AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")


def export_for_cuda(fn, args, mesh, custom_call: str = TRITON_CALL):
    """`fn` jitted and exported for ``cuda`` on the abstract `mesh`, `custom_call` allowed
    (by default Pallas' Triton call, whose lowering runs without a GPU)."""
    from jax import export

    with jax.sharding.use_abstract_mesh(mesh):
        return export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(custom_call)],
        )(*args)


def under_fsdp_tp(kernel):
    """`kernel` called under the activation rules of a data×fsdp×tensor mesh (fsdp+tp), where
    a kernel runs per shard of the batch."""
    from meshtrain.layout import activation_rules, rules_for
    from meshtrain.mesh import make_mesh

    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    rules = rules_for("fsdp+tp", mesh)

    def sharded(*args):
        with activation_rules(mesh, rules):
            return kernel(*args)

    return sharded
