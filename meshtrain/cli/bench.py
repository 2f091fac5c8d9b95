"""``meshtrain bench``: train a named GPT size on synthetic tokens and print one JSON line.

    meshtrain bench --size tiny                      # CPU smoke (seconds)
    meshtrain bench --size 125m                      # on a GPU: bf16, cuDNN attention
    meshtrain bench --size 1.3b --seq-len 2048 --profile runs/trace
    meshtrain bench --size 125m --precision fp8 --compile-only   # compiled memory, no timing
    meshtrain bench --size 1.3b --packed --precision bf16 --attention auto   # the recipe

What it measures is described in `meshtrain.bench`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from meshtrain import validate
from meshtrain.cli import parsing
from meshtrain.problem import Problem

__all__ = ["BenchSettings", "main", "parse", "run"]

EXAMPLE = "meshtrain bench --size tiny"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchSettings(validate.Checked):
    """Train a named GPT size on synthetic tokens; print one JSON line of step time, tokens/s,
    TFLOP/s, MFU (both FLOP conventions), memory and compile time.

    Args:
        size: model size (`meshtrain.bench.SIZES`).
        style: GPT flavour.
        seq_len: tokens per sequence (0: the size's).
        batch: global batch (0: the size's default).
        dtype: compute dtype ("": bfloat16 on a GPU, float32 elsewhere).
        precision: a precision policy (fp32, bf16, fp16, fp8; see `meshtrain.Precision`) in
            place of --dtype; fp8's MFU is against the bfloat16 peak, as peers report it.
        compile_only: compile the step and report its compiled memory, compile time and
            FLOPs; time nothing.
        packed: packed documents, as language-model pretraining batches are built: each row
            holds random documents (segment ids and positions), so attention stays within a
            document and the loss covers real tokens.
        attention: attention kernel; default: cudnn on a GPU, xla elsewhere; auto: what was
            measured fastest (`meshtrain.kernels.autotable`).
        norm: norm kernel.
        loss: cross-entropy kernel.
        remat: remat policy: none, full, save-dots, save-attention-out.
        mesh: mesh axis sizes (default: all devices on data).
        strategy: sharding strategy preset.
        devices: simulate N CPU devices (0: the real devices).
        warmup: untimed steps after compiling.
        steps: timed steps.
        matmul_peak_n: size n of the n³ bf16 matmul peak (-1: 8192 on a GPU, 512 elsewhere;
            0: skip).
        matmul_peak_reps: timed matmul calls.
        profile: write a jax.profiler trace to this directory.
        profile_steps: steps inside the trace.
        seed: seed of the parameters and tokens.
        out: also append the JSON line to this file.
    """

    size: Literal["tiny", "125m", "350m", "1.3b"] = "tiny"
    style: Literal["llama", "gpt2"] = "llama"
    seq_len: int = 0
    batch: int = 0
    dtype: Literal["", "bfloat16", "float32"] = ""
    precision: Literal["", "fp32", "bf16", "fp16", "fp8"] = ""
    compile_only: bool = False
    packed: bool = False
    attention: Literal["default", "xla", "pallas", "cudnn", "auto"] = "default"
    norm: Literal["xla", "pallas", "auto"] = "xla"
    loss: Literal["xla", "pallas", "auto"] = "xla"
    remat: str = "none"
    mesh: str = "data=-1"
    strategy: str = "dp"
    devices: int = 0
    warmup: int = 3
    steps: int = 10
    matmul_peak_n: int = -1
    matmul_peak_reps: int = 10
    profile: str = ""
    profile_steps: int = 3
    seed: int = 0
    out: str = ""

    def problems(self) -> list[Problem]:
        """What is wrong with these settings (empty when they can run)."""
        counts = ("seq_len", "batch", "warmup", "devices", "matmul_peak_reps", "profile_steps")
        found = [p for n in counts for p in validate.non_negative(n, getattr(self, n), example=0)]
        found += validate.require(
            not (self.dtype and self.precision),
            "dtype",
            self.dtype,
            "give either --dtype or --precision (the policy sets the compute dtype)",
        )
        return found + validate.positive("steps", self.steps, example=10)


def run(settings: BenchSettings, argv: list[str] | tuple[str, ...] = ()) -> int:
    """Benchmarks and prints the JSON line (appended to ``--out`` too); returns 0."""
    from meshtrain import bench

    record = bench.run(settings)
    record["command"] = " ".join(["meshtrain bench", *argv])
    bench.emit(record, settings.out)
    return 0


def parse(argv: list[str]) -> BenchSettings:
    """The settings the words after ``meshtrain bench`` give."""
    return parsing.parse("bench", BenchSettings, argv, example=EXAMPLE)


def main(argv: list[str]) -> int:
    """``meshtrain bench ARGV``."""
    return run(parse(argv), argv)
