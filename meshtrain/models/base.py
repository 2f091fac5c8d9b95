"""The model interface: what the trainer, the pipeline, the CLI and the run check ask of a model.

A model *family* is a frozen config dataclass that implements `ModelConfig`, plus the NNX
module it builds. Nothing outside a family's own files asks which family it has: the
`Trainer` builds, counts FLOPs and checks through the config; the pipeline cuts any module
that offers `PipelineParts`; the CLI lists what `meshtrain.models.registry` holds.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.problem import Problem

DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}  # compute dtypes by name


class DataSpec(NamedTuple):
    """What a model needs to know about its data (a `meshtrain.data.Dataset` has all of it).

    Attributes:
        kind: ``"lm"`` (token ids [B, T] → next-token ids) or ``"classify"`` (features [B, F]
            → class ids [B]).
        batch_size: the global batch size.
        seq_len: T for ``lm``, else None.
        vocab_size: token or class count.
        num_features: F for ``classify``, else None.
        image_shape: [H, W, C] when the ``classify`` features are flattened images, else None.
        packed: the batches carry ``segment_ids`` and ``positions`` (packed documents, see
            `PACKED_KEYS`).
    """

    kind: str
    batch_size: int
    seq_len: int | None
    vocab_size: int
    num_features: int | None = None
    image_shape: tuple[int, int, int] | None = None
    packed: bool = False

    def describe(self) -> str:
        """The run summary's part, e.g. ``data lm · global batch 16 × 32 tokens · packed
        documents (segment ids, the loss over real tokens)``."""
        if self.kind != "lm":
            per = f" × {self.num_features} features" if self.num_features else ""
            return f"data {self.kind} · global batch {self.batch_size}{per}"
        packing = (
            "packed documents (segment ids, the loss over real tokens)"
            if self.packed
            else "no packing (plain windows)"
        )
        return f"data lm · global batch {self.batch_size} × {self.seq_len} tokens · {packing}"


@runtime_checkable
class ModelConfig(Protocol):
    """A model family's config: a frozen dataclass deriving from `meshtrain.validate.Checked`,
    whose ``problems()`` lists what is wrong with it (built from `meshtrain.validate`).

    Optionally, it also has ``check_layout(sizes, rules) -> list[Problem]``: what keeps the
    model from being laid out by `rules` on axes of `sizes`, with the fix in its own fields
    (the GPT's names ``gpt.vocab_multiple``); the run check calls it when present.
    And optionally ``supported_axes``: axes the run check otherwise refuses that this model
    runs (the MoE's ``("expert",)``); and ``context_parallel = False`` for a token model whose
    sequences cannot be split over ``seq`` (the run check then refuses ``seq > 1``).

    Attributes:
        dtype: the compute dtype name (``float32``, ``bfloat16`` or ``float16``), for the
            peak-FLOPs lookup. A config whose dense matmuls can run in fp8 also has a bool
            ``fp8`` field (`meshtrain.precision.Precision` sets both).
    """

    dtype: str

    def build(self, *, rngs: nnx.Rngs) -> nnx.Module:
        """The NNX module, unsharded (the trainer creates it sharded)."""
        ...

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, or per example without tokens."""
        ...

    def check(self, data: DataSpec) -> list[Problem]:
        """What keeps this model from training on `data`; an empty list when nothing."""
        ...

    def describe(self) -> str:
        """One line for logs: the shape of the model."""
        ...


@dataclasses.dataclass(frozen=True)
class PipelineParts:
    """A model cut for pipelining: what runs before, within and after its stacked blocks.

    A model offers it from a ``pipeline_parts()`` method; the pipeline then runs the blocks
    stage by stage and the embedding and head around them.

    Attributes:
        blocks: the attribute holding the stacked blocks (parameters with a leading ``layers``
            dimension); the pipeline cuts that dimension into chunks.
        embed: inputs → activations entering the first block; with `packed`, also
            ``embed(inputs, positions)``.
        run_blocks: ``(stacked blocks module of any length, activations) → activations``; a
            plain function of its arguments (no reference to the model). With `packed` it
            also takes ``(blocks, x, segment_ids, positions)`` (one microbatch's [b, T]
            entries); with `stats` it returns ``(activations, stats)``.
        head: activations leaving the last block → logits.
        head_params: the model's top-level attributes `head` reads (their gradients flow
            through the loss head).
        packed: `embed` and `run_blocks` take a packed batch's `PACKED_KEYS` (see above);
            False: the pipeline refuses packed batches for this model.
        stats: set when `run_blocks` also returns statistics: a dict of float32 scalars summed
            over the blocks it ran (an MoE's router losses and load). The pipeline sums them
            over the stages and averages them over the microbatches, and ``stats(totals)``
            gives ``(aux_loss, metrics)``: the weighted loss terms to add to the task loss,
            which must be linear in `totals`, and the metrics to report.
    """

    blocks: str
    embed: Callable[..., jax.Array]
    run_blocks: Callable[..., Any]
    head: Callable[[jax.Array], jax.Array]
    head_params: tuple[str, ...]
    packed: bool = False
    stats: Callable[[dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]] | None = None


class ModelOutput(NamedTuple):
    """What a model's ``__call__`` may return instead of bare logits: the logits with loss
    terms to add to the training loss and metrics to report (an MoE's router losses and
    expert load, say). `meshtrain.loss.loss_and_metrics` reads it.

    Attributes:
        logits: the logits the task loss is computed on.
        aux_loss: a float32 scalar added to the task loss (already weighted).
        metrics: float32 scalars reported beside the loss, by name.
    """

    logits: jax.Array
    aux_loss: jax.Array
    metrics: dict[str, jax.Array]


def logits_of(output) -> jax.Array:
    """The logits of a model's output (bare logits, or a `ModelOutput`)."""
    return output.logits if isinstance(output, ModelOutput) else output


def pipeline_parts(model: nnx.Module) -> PipelineParts | None:
    """The model's `PipelineParts`, or None when it cannot be pipelined."""
    method = getattr(model, "pipeline_parts", None)
    return method() if callable(method) else None


def after_step(graphdef: nnx.GraphDef, params: dict, rest: dict) -> tuple[dict, dict]:
    """The model's non-parameter variables `rest` after its ``after_step()`` method, and the
    metrics it returns. A model offers that method to update its state once per optimizer
    step from what the step's forwards left in it (an MoE's balancing bias from the expert
    load counted over the step's whole batch); without it, `rest` as it was and no metrics.
    """
    model = nnx.merge(graphdef, params, rest)
    method = getattr(model, "after_step", None)
    metrics = method() if callable(method) else {}
    if not metrics:
        return rest, {}
    return nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))), metrics


# A packed batch's extra entries, each [B, T] int32, passed to the model as keywords of the same
# names: ``segment_ids`` (0 = padding, documents 1, 2, … in a row) and ``positions`` (each
# token's position within its document).
PACKED_KEYS = ("segment_ids", "positions")


def batch_structs(data) -> dict[str, jax.ShapeDtypeStruct]:
    """Global shapes of one batch of `data` (a `DataSpec`, or a `Dataset`, whose
    ``batch_keys`` say whether it is packed)."""
    B = data.batch_size
    if data.kind == "lm":
        tokens = jax.ShapeDtypeStruct((B, data.seq_len), jnp.int32)
        packed = getattr(data, "packed", False) or "segment_ids" in getattr(data, "batch_keys", ())
        return dict.fromkeys(("inputs", "targets", *(PACKED_KEYS if packed else ())), tokens)
    return {
        "inputs": jax.ShapeDtypeStruct((B, data.num_features), jnp.float32),
        "targets": jax.ShapeDtypeStruct((B,), jnp.int32),
    }


def takes_packed(model: nnx.Module) -> bool:
    """True when ``model.__call__`` accepts the `PACKED_KEYS` as keyword arguments."""
    try:
        params = inspect.signature(model.__call__).parameters.values()
    except (TypeError, ValueError):
        return True  # cannot tell: let the call itself say
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return True
    names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return set(PACKED_KEYS) <= names


def call_model(model: nnx.Module, batch: Mapping[str, jax.Array]):
    """The model's output on a batch: ``model(batch["inputs"])``, with the `PACKED_KEYS` the
    batch holds passed as keywords (a packed batch).

    Args:
        model: the model.
        batch: ``inputs`` (and ``targets``), and for a packed batch ``segment_ids`` and
            ``positions``.

    Returns:
        What the model returns (logits or a `ModelOutput`).

    Raises:
        ValueError: a packed batch, and a model whose ``__call__`` does not take them.
    """
    packed = {k: batch[k] for k in PACKED_KEYS if k in batch}
    if packed and not takes_packed(model):
        raise ValueError(
            f"model {type(model).__name__}: a packed batch passes segment_ids= and positions= "
            "to __call__, which does not take them; add those keyword arguments (see "
            "meshtrain.models.GPT.__call__) or train on plain windows (--data.no-packing)"
        )
    return model(batch["inputs"], **packed)
