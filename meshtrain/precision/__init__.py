"""Numeric precision: one policy (`Precision`), dynamic loss scaling for float16
(`loss_scale`), and fp8 matmuls with current scaling (`fp8`).

- `policy`: `Precision`, `POLICIES`, `matmul_precision`.
- `loss_scale`: `with_loss_scale`, `step_scale`, `scale_backward`, `unscale`, `adjust`,
  `settle`, `state_of`.
- `fp8`: `dot_general` (for ``nnx.Linear``), `matmul` (for other products), `round_trip`.
"""

from meshtrain.precision import fp8, loss_scale
from meshtrain.precision.loss_scale import LossScaleState, with_loss_scale
from meshtrain.precision.policy import POLICIES, Precision, matmul_precision

__all__ = [
    "POLICIES",
    "LossScaleState",
    "Precision",
    "fp8",
    "loss_scale",
    "matmul_precision",
    "with_loss_scale",
]
