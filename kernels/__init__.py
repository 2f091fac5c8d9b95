"""Pallas GPU kernels with pure-jnp references and an ``impl=`` switch.

Every public kernel takes ``impl="pallas" | "xla" | "auto"`` (attention also ``"cudnn"``):
``"xla"`` is the jnp reference in `meshtrain.kernels.reference`, ``"pallas"`` the kernel
(interpreted when no GPU is present), ``"auto"`` on a GPU the implementation measured fastest
for the call's shape on that device kind (`autotable`, the committed table the GPU check
writes), the safe default where nothing was measured (cuDNN's attention, XLA's other ops), and
the reference off a GPU.
See kernels/README.md for each kernel's algorithm, backend and limits.
"""

from meshtrain.kernels import reference
from meshtrain.kernels._common import ATTENTION_IMPLS, IMPLS, poison_outputs
from meshtrain.kernels.attention import flash_attention
from meshtrain.kernels.cross_entropy import token_cross_entropy
from meshtrain.kernels.matmul import matmul
from meshtrain.kernels.mse import mean_squared_error
from meshtrain.kernels.norms import layer_norm, rms_norm
from meshtrain.kernels.relu import relu
from meshtrain.kernels.select import check_impls, model_attention_impl

__all__ = [
    "ATTENTION_IMPLS",
    "IMPLS",
    "check_impls",
    "flash_attention",
    "layer_norm",
    "matmul",
    "mean_squared_error",
    "model_attention_impl",
    "poison_outputs",
    "reference",
    "relu",
    "rms_norm",
    "token_cross_entropy",
]
