"""`Precision`: the run's numeric policy in one place.

A policy names the parameter, compute and output dtypes, the matmul precision, whether dense
projections run in fp8, and whether the loss is scaled:

    policy  params   compute   logits   fp8 matmuls   loss scaling
    fp32    float32  float32   float32  no            no
    bf16    float32  bfloat16  float32  no            no
    fp16    float32  float16   float32  no            dynamic
    fp8     float32  bfloat16  float32  yes           no

Parameters and optimizer state are float32 master copies in every policy. A model config
takes the policy through its ``dtype`` (and, where it has fp8 layers, ``fp8``) fields
(`Precision.applied`); ``auto`` keeps the model's own ``dtype``, so the older spelling
``--gpt.dtype bfloat16`` still means the bf16 policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax

from meshtrain import validate
from meshtrain.problem import Problem

# policy → (compute dtype, fp8 matmuls, loss scaling by default)
POLICIES = {
    "fp32": ("float32", False, False),
    "bf16": ("bfloat16", False, False),
    "fp16": ("float16", False, True),
    "fp8": ("bfloat16", True, False),
}
_BY_DTYPE = {compute: name for name, (compute, fp8, _) in POLICIES.items() if not fp8}
LOSS_SCALES = ("auto", "dynamic", "off")
MATMUL_PRECISIONS = ("default", "high", "highest")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision(validate.Checked):
    """How a run computes: dtypes, matmul precision, fp8 and loss scaling.

    Args:
        policy: ``fp32``, ``bf16``, ``fp16``, ``fp8``, or ``auto`` (the model config's own
            fields: fp8 when its ``fp8`` is set, else by its ``dtype``: fp32 unless it says
            bfloat16 or float16).
        loss_scale: ``auto`` (dynamic for fp16, off otherwise), ``dynamic`` (only with
            fp16: bf16 and fp8 keep float32's exponent range and need none) or ``off``.
        loss_scale_init: the first loss scale, a power of two (scales stay powers of two,
            so scaling and unscaling are exact).
        loss_scale_period: good steps in a row after which the scale doubles.
        matmul_precision: `jax.default_matmul_precision` for float32 matmuls while the step
            traces: ``default`` (the backend's: TF32 on recent NVIDIA GPUs), ``high`` or
            ``highest`` (full float32).
    """

    policy: str = "auto"
    loss_scale: str = "auto"
    loss_scale_init: float = 2.0**15
    loss_scale_period: int = 2000
    matmul_precision: str = "default"

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        problems = validate.one_of("precision", self.policy, ("auto", *POLICIES), example="bf16")
        problems += validate.one_of("loss_scale", self.loss_scale, LOSS_SCALES)
        problems += validate.one_of("matmul_precision", self.matmul_precision, MATMUL_PRECISIONS)
        problems += validate.positive("loss_scale_period", self.loss_scale_period, example=2000)
        init = self.loss_scale_init
        if not (validate.is_number(init) and init >= 1 and _is_power_of_two(init)):
            problems.append(
                Problem(
                    "loss_scale_init",
                    init,
                    "must be a power of two ≥ 1 (scaling by it is then exact); e.g. "
                    "--loss-scale-init 32768",
                )
            )
        if not problems and self.policy != "auto":
            problems += self._scaling_problems(self.policy)
        return problems

    def _scaling_problems(self, policy: str) -> list[Problem]:
        """Loss scaling asked for under a `policy` that has no use for it."""
        if self.loss_scale != "dynamic" or policy == "fp16":
            return []
        return [
            Problem(
                "loss_scale",
                "dynamic",
                f"precision {policy} keeps float32's exponent range, so its gradients do not "
                "underflow: loss scaling is for fp16; drop --loss-scale or use --precision fp16",
            )
        ]

    def resolved(self, model=None) -> str:
        """The policy's name, ``auto`` read from `model` (a config, a constructor or None)."""
        if self.policy != "auto":
            return self.policy
        if getattr(model, "fp8", False) is True:
            return "fp8"
        return _BY_DTYPE.get(getattr(model, "dtype", "float32"), "fp32")

    def applied(self, model):
        """`model` (a model config) computing by this policy: its ``dtype`` (and ``fp8``) set.

        A model that is not a config (a constructor) is returned as it is: it sets its own
        dtypes. `model_problems` says when a policy cannot apply.
        """
        if not _has_field(model, "dtype"):
            return model
        compute, fp8, _ = POLICIES[self.resolved(model)]
        changes = {"dtype": compute}
        if _has_field(model, "fp8"):
            changes["fp8"] = fp8
        return dataclasses.replace(model, **changes)

    def model_problems(self, model) -> list[Problem]:
        """What keeps this policy from applying to `model` (a config or a constructor)."""
        if self.policy == "auto":
            return self._scaling_problems(self.resolved(model))
        name = _model_name(model)
        if getattr(model, "fp8", False) is True and self.policy != "fp8":
            return [
                Problem(
                    f"{name}.fp8",
                    True,
                    f"disagrees with --precision {self.policy}; the precision policy sets fp8: "
                    f"use --precision fp8, or drop --{name}.fp8",
                )
            ]
        if not _has_field(model, "dtype"):
            if self.policy in ("fp32", "fp16"):
                return []  # loss scaling applies; the constructor chooses its dtypes
            return [
                Problem(
                    "precision",
                    self.policy,
                    "a model constructor sets its own dtypes; give a model config (e.g. "
                    "GPTConfig()) or leave precision at auto",
                )
            ]
        compute, fp8, _ = POLICIES[self.policy]
        if fp8 and not _has_field(model, "fp8"):
            return [
                Problem(
                    "precision",
                    "fp8",
                    f"the {name} model has no fp8-capable layers (its config has no fp8 "
                    "field); use --precision bf16",
                )
            ]
        if model.dtype not in ("float32", compute):
            return [
                Problem(
                    f"{name}.dtype",
                    model.dtype,
                    f"disagrees with --precision {self.policy} (compute {compute}); the "
                    f"precision policy sets the compute dtype: drop --{name}.dtype",
                )
            ]
        return []

    def loss_scaling(self, model=None) -> bool:
        """Whether the loss is scaled (dynamically) under this policy, for `model`."""
        if self.loss_scale != "auto":
            return self.loss_scale == "dynamic"
        return POLICIES[self.resolved(model)][2]

    def describe(self, model=None) -> str:
        """One line, e.g. ``precision fp16 · float32 params · float16 compute · float32
        optimizer state · float32 logits · matmul default · dynamic loss scale from 32768, ×2
        after 2000 good steps``; a model whose parts compute otherwise says so through its
        ``experts_precision`` (an MoE's experts, in float32 on CPU)."""
        name = self.resolved(model)
        compute, fp8, _ = POLICIES[name]
        parts = [f"precision {name}", "float32 params", f"{compute} compute"]
        parts.append("float32 optimizer state")
        if fp8:
            parts.append("fp8 dense matmuls (e4m3 forward, e5m2 gradients, current scaling)")
        if callable(experts := getattr(model, "experts_precision", None)):
            parts.append(experts(compute, fp8=fp8))
        parts += ["float32 logits", f"matmul {self.matmul_precision}"]
        if self.loss_scaling(model):
            parts.append(
                f"dynamic loss scale from {self.loss_scale_init:g}, ×2 after "
                f"{self.loss_scale_period} good steps"
            )
        return " · ".join(parts)


def matmul_precision(name: str):
    """A context in which float32 matmuls trace at precision `name` (`MATMUL_PRECISIONS`;
    ``default`` changes nothing)."""
    if name == "default":
        return contextlib.nullcontext()
    return jax.default_matmul_precision(name)


def _is_power_of_two(x: float) -> bool:
    return math.frexp(x)[0] == 0.5


def _has_field(model, name: str) -> bool:
    return dataclasses.is_dataclass(model) and name in {f.name for f in dataclasses.fields(model)}


def _model_name(model) -> str:
    """The CLI section of a model config (``gpt``, ``moe``, ...), from its class name."""
    return type(model).__name__.removesuffix("Config").lower()
