"""The public kernels' argument checks: a wrong argument is one ValueError naming the kernel,
the argument, its value and a value that works, never a raw error from deep inside jax.

    grouped_matmul: tile=2.5 must be ≥ 1 and a whole number; e.g. tile=16
"""

from __future__ import annotations

from typing import NoReturn

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.validate import is_int, is_number


def _refuse(kernel: str, name: str, value, need: str, example) -> NoReturn:
    """Raises the one line: ``kernel: name=value need; e.g. name=example``."""
    raise ValueError(f"{kernel}: {name}={value!r} {need}; e.g. {name}={example}")


def whole(kernel: str, name: str, value, *, example, low: int = 1) -> None:
    """Refuses anything but None or an integer ≥ `low` (bools and floats included)."""
    if value is None or (is_int(value) and value >= low):
        return
    _refuse(kernel, name, value, f"must be ≥ {low} and a whole number", example)


def power_of_two(kernel: str, name: str, value, *, example, low: int = 1) -> None:
    """Refuses anything but None or a power of two ≥ `low` (a block or tile size)."""
    if value is None or (is_int(value) and value >= low and value & (value - 1) == 0):
        return
    _refuse(kernel, name, value, f"must be a power of two ≥ {low}", example)


def finite(kernel: str, name: str, value, *, example, low: float = 0.0) -> None:
    """Refuses a number that is not finite or below `low`; a traced value passes unchecked."""
    if isinstance(value, jax.core.Tracer):
        return
    if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0:
        value = value.item()
    if is_number(value) and value >= low:
        return
    _refuse(kernel, name, value, f"must be a finite number ≥ {low:g}", example)


def integers(kernel: str, name: str, x) -> None:
    """Refuses an array whose dtype is not an integer one (token ids, sizes, positions)."""
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(
            f"{kernel}: {name} must be integers, got {x.dtype}; e.g. {name}.astype(jnp.int32)"
        )


def concrete(x) -> np.ndarray | None:
    """The values of `x` when they are known now (not traced under jit or a transform)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)
