"""Model FLOPs, device peaks, throughput and MFU.

MFU (model FLOPs utilisation) = flops_per_step / (step_time * n_devices * peak_per_device).
`flops_per_step` is the model FLOPs (forward + backward) of one optimizer step: the model
config supplies a FLOP formula per token and the trainer multiplies it by the step's tokens.
Rematerialisation, padding and communication are not counted, so MFU measures useful work.
The peak is the vendor's dense (no sparsity) tensor-core rate for the compute dtype; where
no peak is known (CPU) MFU is None.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

# Dense per-device peak TFLOP/s. Datasheets print 2:4-sparse rates; dense is half of those.
# "float32" means TF32 tensor-core matmuls.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 Tensor Core GPU datasheet / Hopper whitepaper, H100 SXM5:
    # BF16 and FP16 1979 sparse -> 989.4 dense; TF32 989 sparse -> 494.7 dense.
    "H100": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},
    # NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe: BF16/FP16 1513 sparse, TF32 756 sparse.
    "H100 PCIe": {"bfloat16": 756.0, "float16": 756.0, "float32": 378.0},
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM (H100 silicon): as H100 SXM above.
    "H200": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 and PCIe): BF16/FP16 312 dense, TF32 156.
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "tf32": "float32"}


def _device_family(device_kind: str) -> str | None:
    """Maps a jax `device_kind` string to a `PEAK_TFLOPS` key, or None."""
    kind = device_kind.lower()
    if "h200" in kind:  # also GH200, whose GPU has the H100 SXM peaks
        return "H200"
    if "h100" in kind:
        return "H100 PCIe" if "pcie" in kind else "H100"
    return "A100" if "a100" in kind else None


def peak_flops_per_device(device: Any = None, dtype: Any = "bfloat16") -> float | None:
    """Peak FLOP/s (not TFLOP/s) of one device for dense matmuls in `dtype`.

    Args:
        device: a jax device (or anything with a `device_kind` string); default
            `jax.devices()[0]`.
        dtype: compute dtype: a name ("bfloat16", "bf16", "float32", ...) or a numpy/jax
            dtype. float32 means TF32 tensor cores.

    Returns:
        FLOP/s, or None when the device or dtype is not in `PEAK_TFLOPS` (CPU, TPU, float64...).

    Raises:
        ValueError: `dtype` is not a dtype.
    """
    dtype = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower()) if isinstance(dtype, str) else dtype
    try:
        name = np.dtype(jax.numpy.dtype(dtype)).name
    except TypeError as e:
        raise ValueError(f"not a dtype: {dtype!r}") from e
    device = jax.devices()[0] if device is None else device
    family = _device_family(str(getattr(device, "device_kind", "")))
    if family is None or name not in PEAK_TFLOPS[family]:
        return None
    return PEAK_TFLOPS[family][name] * 1e12


# --- Model FLOPs of a decoder-only transformer ---------------------------------------------
# Written down once, here. Per token and per training step (forward + backward = 3 × forward):
#
#   6·N            the N parameters that take part in a matmul (2 FLOPs forward per weight and
#                  token, 4 backward); embedding lookups, norms and biases are not matmuls.
#   attention      the scores q·kᵀ and the weighted sum p·v: forward 2·H·K FLOPs each per
#                  (query, key) pair and layer, so 4·L·H·K per pair, 12·L·H·K with the backward.
#     "palm"       every pair counted, masked or not: T pairs per query → 12·L·H·K·T per token
#                  (PaLM, appendix B; `GPTConfig.flops_per_token` and the Trainer's MFU).
#     "causal"     only the pairs a causal mask keeps, T/2 per query on average → 6·L·H·K·T
#                  (as MaxText and Megatron-LM now report).
#
# Rematerialisation, padding, the optimizer and communication are not model FLOPs.
FLOP_CONVENTIONS = ("causal", "palm")


def attention_flops_per_token(
    *, n_layers: int, n_heads: int, head_dim: int, seq_len: int, convention: str = "palm"
) -> float:
    """Training FLOPs per token of the attention scores and weighted sum (forward + backward).

    Args:
        n_layers: transformer blocks (L).
        n_heads: query heads (H); key/value heads do not change this count.
        head_dim: width of one head (K).
        seq_len: tokens per sequence (T).
        convention: "palm" (every query-key pair) or "causal" (only unmasked pairs: half).

    Returns:
        12·L·H·K·T ("palm") or 6·L·H·K·T ("causal").

    Raises:
        ValueError: an unknown convention.
    """
    if convention not in FLOP_CONVENTIONS:
        raise ValueError(f"convention={convention!r}: choose from {', '.join(FLOP_CONVENTIONS)}")
    pairs_per_query = seq_len if convention == "palm" else seq_len / 2
    return 12.0 * n_layers * n_heads * head_dim * pairs_per_query


def transformer_flops_per_token(
    *,
    matmul_params: int,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    seq_len: int,
    convention: str = "palm",
) -> float:
    """Training FLOPs per token (forward + backward) of a decoder-only transformer.

    Args:
        matmul_params: parameters that take part in a matmul per token (N; for the GPT,
            `GPTConfig.matmul_params()`: all but embedding lookups, norms and biases).
        n_layers, n_heads, head_dim, seq_len, convention: see `attention_flops_per_token`.

    Returns:
        ``6·N + attention_flops_per_token(...)``.
    """
    attention = attention_flops_per_token(
        n_layers=n_layers,
        n_heads=n_heads,
        head_dim=head_dim,
        seq_len=seq_len,
        convention=convention,
    )
    return 6.0 * matmul_params + attention


def gpt_flops_per_token(config: Any, seq_len: int, convention: str = "palm") -> float:
    """`transformer_flops_per_token` of a `GPTConfig` at sequence length `seq_len` (with latent
    attention the head width counted is the mean of the q·k and p·v widths)."""
    scores, values = config.attention_widths()
    return transformer_flops_per_token(
        matmul_params=config.matmul_params(),
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        head_dim=(scores + values) / 2,
        seq_len=seq_len,
        convention=convention,
    )


@dataclasses.dataclass(frozen=True)
class StepRate:
    """Throughput of an optimizer step (see `step_rate`)."""

    step_time: float  # seconds per optimizer step
    tokens_per_s: float  # all devices together
    tflops_per_device: float  # achieved model TFLOP/s per device
    mfu: float | None  # achieved / peak; None if the peak is unknown


def step_rate(
    *,
    step_time: float,
    tokens_per_step: int,
    flops_per_step: float,
    n_devices: int,
    peak_flops: float | None,
) -> StepRate:
    """Throughput and MFU of a step.

    Args:
        step_time: seconds per optimizer step (> 0).
        tokens_per_step: tokens in one step, all devices together.
        flops_per_step: model FLOPs of one step, all devices together.
        n_devices: devices sharing the step (>= 1).
        peak_flops: peak FLOP/s of one device (`peak_flops_per_device`), or None.

    Returns:
        A `StepRate`; `mfu` is None when `peak_flops` is None.

    Raises:
        ValueError: step_time or peak_flops not positive and finite, n_devices < 1, or
            negative tokens/FLOPs.
    """
    if not (math.isfinite(step_time) and step_time > 0):
        raise ValueError(f"step_time must be a positive number of seconds, got {step_time!r}")
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices!r}")
    if tokens_per_step < 0 or flops_per_step < 0:
        raise ValueError(f"negative tokens_per_step={tokens_per_step} or flops={flops_per_step}")
    if peak_flops is not None and not (math.isfinite(peak_flops) and peak_flops > 0):
        raise ValueError(f"peak_flops must be positive or None, got {peak_flops!r}")
    achieved = flops_per_step / step_time / n_devices
    return StepRate(
        step_time=float(step_time),
        tokens_per_s=tokens_per_step / step_time,
        tflops_per_device=achieved / 1e12,
        mfu=None if peak_flops is None else achieved / peak_flops,
    )


def format_mfu(mfu: float | None) -> str:
    """Formats an MFU fraction as a percentage.

    Args:
        mfu: a fraction such as 0.412, or None.

    Returns:
        "41.2%", or "n/a" for None or a non-finite value.
    """
    return "n/a" if mfu is None or not math.isfinite(mfu) else f"{100 * mfu:.1f}%"
