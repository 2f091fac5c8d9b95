"""Throughput and MFU arithmetic, metric writers and a progress bar.

MFU (model FLOPs utilisation) = flops_per_step / (step_time * n_devices * peak_per_device).
`flops_per_step` is the model FLOPs (forward + backward) of one optimizer step: the model
config supplies a FLOP formula per token and the trainer multiplies it by the step's tokens.
Rematerialisation, padding and communication are not counted, so MFU measures useful work.
The peak is the vendor's dense (no sparsity) tensor-core rate for the compute dtype; where
no peak is known (CPU) MFU is None.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
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
METRICS_FILE = "metrics.jsonl"  # a run directory's metrics, one JSON object per line


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
    """`transformer_flops_per_token` of a `GPTConfig` at sequence length `seq_len`."""
    return transformer_flops_per_token(
        matmul_params=config.matmul_params(),
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        head_dim=config.head_dim,
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


def _si(x: float) -> str:
    """Three significant digits with a k/M/G suffix: 12345 -> "12.3k"."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g}{suffix}"
    return f"{x:.3g}"


_FORMATS = {
    "loss": lambda v: f"loss {v:.4g}",
    "eval_loss": lambda v: f"eval_loss {v:.4g}",
    "grad_norm": lambda v: f"gnorm {v:.3g}",
    "tokens_per_s": lambda v: f"{_si(v)} tok/s",
    "tflops_per_device": lambda v: f"{v:.3g} TFLOP/s/dev",
    "mfu": lambda v: f"MFU {format_mfu(v)}",
    "step_time": lambda v: f"{1e3 * v:.4g} ms/step",
}


def format_metrics(metrics: dict) -> str:
    """A compact one-line summary of the known keys of `metrics`.

    Args:
        metrics: shown when present, in this order: loss, eval_loss, grad_norm, tokens_per_s,
            tflops_per_device, mfu, step_time (seconds, shown in ms). Python, numpy or jax
            scalars; None values are skipped, except mfu=None, shown as "MFU n/a".

    Returns:
        e.g. "loss 2.314 | gnorm 0.91 | 12.3k tok/s | 0.02 TFLOP/s/dev | MFU n/a".
    """
    shown = [(k, metrics[k]) for k in _FORMATS if k in metrics]
    return " | ".join(
        _FORMATS[k](None if v is None else float(v))
        for k, v in shown
        if v is not None or k == "mfu"
    )


def _to_python(name: str, value: Any) -> Any:
    """Converts a numpy/jax scalar to a python bool/int/float; None and str pass through."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    array = np.asarray(value)
    if array.ndim != 0:
        raise TypeError(f"metric {name!r} must be a scalar, got shape {array.shape}")
    if array.dtype == np.bool_:
        return bool(array)
    return int(array) if np.issubdtype(array.dtype, np.integer) else float(array)


class MetricsWriter:
    """Appends one JSON object per line to `<run_dir>/metrics.jsonl`; optionally mirrors
    scalars to TensorBoard (event files in `run_dir`).

    Args:
        run_dir: the run directory (created if missing); None makes a writer that does nothing.
        tensorboard: also write TensorBoard scalars (needs tensorboardX).
        append: keep the lines already in metrics.jsonl (a resumed run); False starts the
            file afresh (a new run).

    Raises:
        ImportError: tensorboard=True and tensorboardX is not installed.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike | None,
        *,
        tensorboard: bool = False,
        append: bool = True,
    ):
        self.path = None if run_dir is None else os.path.join(os.fspath(run_dir), METRICS_FILE)
        self._file, self._tb = None, None
        if run_dir is None:
            return
        os.makedirs(run_dir, exist_ok=True)
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "MetricsWriter(tensorboard=True) needs tensorboardX: pip install tensorboardX"
                ) from e
            self._tb = SummaryWriter(logdir=os.fspath(run_dir))
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, step: int, metrics: dict[str, Any], *, prefix: str = "train") -> None:
        """Appends `{"step": step, "split": prefix, **metrics}` as one line and flushes it.

        Args:
            step: the optimizer step.
            metrics: python/numpy/jax scalars or None (written as null). NaN and infinities
                are written as null and their names listed under "nonfinite".
            prefix: the split ("train", "eval", ...); TensorBoard tags are `prefix/name`.

        Raises:
            ValueError: a metric named "step", "split" or "nonfinite"; or the writer is closed.
            TypeError: a metric is not a scalar.
        """
        if self.path is None:
            return
        if self._file is None:
            raise ValueError("write() on a closed MetricsWriter")
        if clash := {"step", "split", "nonfinite"} & set(metrics):
            raise ValueError(f"metric names {sorted(clash)} are reserved")
        record: dict[str, Any] = {"step": int(step), "split": prefix}
        nonfinite = []
        for name, value in metrics.items():
            value = _to_python(name, value)
            if isinstance(value, float) and not math.isfinite(value):
                nonfinite.append(name)
                value = None
            record[name] = value
            if self._tb is not None and type(value) in (int, float):
                self._tb.add_scalar(f"{prefix}/{name}", value, int(step))
        if nonfinite:
            record["nonfinite"] = nonfinite
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flushes and closes the files; calling it again does nothing."""
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        self._file, self._tb = None, None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Reads a JSON-lines file.

    Args:
        path: a file such as `<run_dir>/metrics.jsonl`.

    Returns:
        One dict per non-empty line, in file order.
    """
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _clock(seconds: float) -> str:
    """Formats seconds as H:MM:SS."""
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """A rich progress bar for a training run: step/total, elapsed, ETA and a metrics line.

    In a terminal, or Jupyter with ipywidgets, it is a live bar. Elsewhere (CI logs, pipes,
    Jupyter without ipywidgets) it prints plain lines: at the first update, at the last step
    and otherwise at most once per `min_interval_s`; `close()` prints the latest one.

    Args:
        total_steps: the step the run ends at.
        description: label in front of the bar.
        enabled: False prints nothing at all.
        console: a `rich.console.Console`; default one on stdout.
        min_interval_s: least seconds between plain lines.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        description: str = "train",
        enabled: bool = True,
        console: Any = None,
        min_interval_s: float = 30.0,
    ):
        if total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {total_steps}")
        self.total_steps, self.description, self.enabled = total_steps, description, enabled
        self.min_interval_s = min_interval_s
        self._start = time.monotonic()
        self._first: tuple[float, int] | None = None  # (time, step) of the first update
        self._last_print: float | None = None
        self._pending = ""  # the latest plain line, not yet printed
        self._bar = None
        if not enabled:
            return
        from rich import progress as rp
        from rich.console import Console

        self.console = Console() if console is None else console
        if self.console.is_jupyter:
            try:
                import ipywidgets  # noqa: F401
            except ImportError:
                return
        elif not self.console.is_terminal or self.console.is_dumb_terminal:
            return
        self._bar = rp.Progress(
            rp.TextColumn("{task.description}"),
            rp.BarColumn(),
            rp.MofNCompleteColumn(),
            rp.TimeElapsedColumn(),
            rp.TextColumn("ETA {task.fields[eta]}"),
            rp.TextColumn("{task.fields[metrics]}", markup=False),
            console=self.console,
            auto_refresh=not self.console.is_jupyter,  # Jupyter: redraw on update only
            refresh_per_second=2,
        )
        self._task = self._bar.add_task(description, total=total_steps, eta="-:--:--", metrics="")
        self._bar.start()

    def _eta(self, step: int, now: float) -> str:
        """Time left, at the mean rate since the first update (so compilation is excluded)."""
        t0, s0 = self._first or (now, step)
        if step >= self.total_steps:
            return _clock(0)
        if step <= s0 or now <= t0:
            return "-:--:--"
        return _clock((self.total_steps - step) * (now - t0) / (step - s0))

    def update(self, step: int, metrics: dict) -> None:
        """Moves the bar to `step` and shows `format_metrics(metrics)`.

        Args:
            step: the current optimizer step (absolute, so a resumed run starts mid-bar).
            metrics: see `format_metrics`; jax values are fetched from the device.
        """
        if not self.enabled:
            return
        now = time.monotonic()
        self._first = self._first or (now, step)
        eta, text = self._eta(step, now), format_metrics(metrics)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, eta=eta, metrics=text)
            if self.console.is_jupyter:
                self._bar.refresh()
            return
        elapsed = _clock(now - self._start)
        self._pending = f"{self.description} {step}/{self.total_steps} [{elapsed}<{eta}] {text}"
        quiet = self._last_print is not None and now - self._last_print < self.min_interval_s
        if not quiet or step >= self.total_steps:
            self._print_pending(now)

    def _print_pending(self, now: float) -> None:
        """Prints the latest plain line, if not yet printed."""
        if self._pending:
            self.console.print(
                self._pending.rstrip(), markup=False, highlight=False, soft_wrap=True
            )
            self._pending, self._last_print = "", now

    def log(self, message: str) -> None:
        """Prints `message` on its own line above the bar.

        Args:
            message: plain text (rich markup is not interpreted).
        """
        if self.enabled:
            self.console.print(message, markup=False, highlight=False)

    def close(self) -> None:
        """Stops the bar, or prints the latest plain line not yet shown; idempotent."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        self._print_pending(time.monotonic())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
