"""Settings that only count while a feature is on, as one table (`NEEDS`), and the run
check's refusal of one changed while its feature is off (`no_effect_problems`).

A loss-scale setting under fp32, a host memory kind without offload or a pipeline schedule on
a mesh without ``pipe`` would train, exit 0 and leave the user believing it was used. Each row
names the setting, where the run holds it, the feature it belongs to, a test of whether the
feature is on, and the change that would make the setting count::

    loss_scale_init=1024.0: has no effect under --precision fp32: it belongs to fp16's loss
    scaling; drop --loss-scale-init or use --precision fp16 (with --loss-scale auto or dynamic)

A setting is refused only when its value differs from its default: a run cannot tell a
default that was typed from one that was left alone. The settings a `RunSpec` does not hold
(the checkpoints of ``--no-save``, the data source's own options) are rows of scope ``job``,
read from the settings of ``meshtrain train`` (`job_problems`, which the CLI calls before
anything is built). Pairs of features that do not run together are another table
(`meshtrain.composition.REFUSALS`); the settings it already refuses alone (an outer optimizer
without ``--sync-every``, a loss kernel beside a custom ``loss_fn``) are not repeated here.
"""

from __future__ import annotations

from meshtrain.data.config import DataConfig
from meshtrain.effect import features as on
from meshtrain.effect.needs import Needs
from meshtrain.mesh import PIPE, SEQ
from meshtrain.problem import Problem
from meshtrain.run import RunSpec

__all__ = ["NEEDS", "job_problems", "no_effect_problems"]

_CHECKPOINTS = "use checkpoints (drop --no-save; give --run-dir or --checkpoint-dir)"
_NO_SAVE = {"save": False}
_FP16 = {"precision.policy": "fp16"}
_PIPE = {"mesh": {PIPE: 2, "data": 4}}
_NOT_ADAM = {"optim.optimizer": "sgd"}


def _loss_scaling(field: str, example: tuple) -> Needs:
    """A setting of fp16's loss scaling, which counts only while the step scales the loss."""
    fix = "use --precision fp16 (with --loss-scale auto or dynamic)"
    feature = "fp16's loss scaling"
    return Needs(field, f"precision.{field}", feature, on.scales, on.unscaled, fix, example)


def _pipelines(field: str, fix: str, example: tuple, feature: str = "pipelines") -> Needs:
    """A pipeline setting, which counts only on a mesh with ``pipe > 1``."""
    return Needs(field, f"pipeline.{field}", feature, on.pipelined, on.no_pipe, fix, example)


def _outer_optimizers(field: str, value: object, outer: str) -> Needs:
    """A setting of the outer optimizers nesterov and adam (`outer` turns one on)."""
    return Needs(
        field,
        f"sync.{field}",
        "the outer optimizers nesterov and adam",
        lambda run: run.sync.outer_optimizer != "average",
        on.said("with --outer-optimizer average"),
        "use --outer-optimizer nesterov or adam (with --sync-every H)",
        (value, {}, {"sync.outer_optimizer": outer, "sync.sync_every": 4}),
    )


def _optimizers(field: str, names: tuple[str, str], example: tuple) -> Needs:
    """A setting of the two optimizers `names`, which counts only under one of them."""
    a, b = names
    fix = f"use --optimizer {a} or {b}"
    when = on.optimizer(*names)
    return Needs(field, f"optim.{field}", f"{a} and {b}", when, on.with_optimizer, fix, example)


def _evaluation(field: str, value: object, **kw) -> Needs:
    """An evaluation setting, which counts only on data with held-out examples."""
    return Needs(
        field,
        f"train.{field}",
        "evaluation",
        on.held_out,
        on.said("on data without held-out examples"),
        "hold some out (--data.val-fraction, --data.eval-path)",
        (value, {"data": DataConfig(val_fraction=0.0)}, {}),
        **kw,
    )


def _dispatch(field: str, dispatch: str, example: tuple) -> Needs:
    """An MoE setting that counts only under one `dispatch`."""
    return Needs(
        f"moe.{field}",
        f"model.{field}",
        f"{dispatch} dispatch",
        on.model("dispatch", dispatch),
        on.with_model("moe", "dispatch"),
        f"use --moe.dispatch {dispatch}",
        example,
        family="moe",
    )


def _checkpoints(field: str, example: tuple, fix: str = _CHECKPOINTS) -> Needs:
    """A checkpoint setting of the job, which counts only while it saves."""
    at = f"checkpoint.{field}"
    return Needs(field, at, "checkpoints", on.saves, on.unsaved, fix, example, scope="job")


def _source(field: str, feature: str, sources: tuple[str, ...], fix: str, example) -> Needs:
    """A data setting of the job, which counts only with one of the data `sources`."""
    when = on.source(*sources)
    return Needs(field, field, feature, when, on.with_source, fix, example, scope="job")


NEEDS: tuple[Needs, ...] = (
    Needs(
        "loss_scale",
        "precision.loss_scale",
        "fp16's loss scaling",
        lambda run: on.scales(run) or on.policy(run) == "fp16",
        lambda run: f"under --precision {on.policy(run)}",
        "use --precision fp16",
        ("off", {}, _FP16),
    ),
    _loss_scaling("loss_scale_init", (1024.0, {}, _FP16)),
    _loss_scaling(
        "loss_scale_period",
        (100, {"precision.policy": "fp16", "precision.loss_scale": "off"}, _FP16),
    ),
    Needs(
        "offload_memory_kind",
        "offload.memory_kind",
        "optimizer offload",
        lambda run: run.offload.active,
        on.said("with --offload none"),
        "add --offload optimizer",
        ("unpinned_host", {}, {"offload.optimizer": True}),
    ),
    _pipelines("schedule", "add pipe=N to --mesh (e.g. --mesh pipe=2,data=4)", ("1f1b", {}, _PIPE)),
    _pipelines(
        "microbatches",
        "add pipe=N to --mesh (gradient accumulation is --accum-steps)",
        (8, {}, _PIPE),
    ),
    _pipelines(
        "repeats",
        "add pipe=N to --mesh with --schedule interleaved-1f1b or circular",
        (2, {}, {**_PIPE, "pipeline.schedule": "circular"}),
        feature="pipelines with several chunks per stage",
    ),
    _pipelines(
        "gather_once", "add pipe=N to --mesh (e.g. --mesh pipe=2,fsdp=4)", (True, {}, _PIPE)
    ),
    Needs(
        "context_parallel",
        "rules.context_parallel",
        "context parallelism",
        lambda run: run.sizes.get(SEQ, 1) > 1,
        lambda run: f"on a mesh with seq={run.sizes.get(SEQ, 1)}",
        "add seq=N to --mesh (e.g. --mesh data=4,seq=2)",
        ("allgather", {}, {"mesh": {"data": 4, SEQ: 2}}),
    ),
    Needs(
        "error_feedback",
        "sync.error_feedback",
        "gradient compression",
        lambda run: run.sync.compresses,
        on.said("with --grad-compression none"),
        "add --grad-compression (e.g. int8)",
        (False, {}, {"sync.grad_compression": "int8"}),
    ),
    _outer_optimizers("outer_lr", 0.5, "nesterov"),
    _outer_optimizers("outer_momentum", 0.5, "adam"),
    Needs(
        "client_seed",
        "sync.client_seed",
        "federated averaging",
        lambda run: run.sync.federates,
        on.said("without --client-fraction"),
        "add --client-fraction F (with --sync-every H)",
        (7, {}, {"sync.client_fraction": 0.5, "sync.sync_every": 4}),
    ),
    _optimizers("b1", ("adamw", "lamb"), (0.8, _NOT_ADAM, {})),
    _optimizers(
        "b2", ("adamw", "lamb"), (0.99, {"optim.optimizer": "lars"}, {"optim.optimizer": "lamb"})
    ),
    _optimizers("eps", ("adamw", "lamb"), (1e-6, _NOT_ADAM, {})),
    _optimizers("momentum", ("sgd", "lars"), (0.5, {}, _NOT_ADAM)),
    Needs(
        "tensorboard",
        "train.tensorboard",
        "the run directory's files",
        lambda run: bool(run.train.run_dir),
        on.said("with an empty --run-dir"),
        "give --run-dir",
        (True, {"train.run_dir": ""}, {}),
    ),
    Needs(
        "hang_factor",
        "train.hang_factor",
        "the hang watchdog",
        lambda run: run.train.hang_floor_s > 0,
        on.said("with --hang-floor-s 0 (the watchdog off)"),
        "set --hang-floor-s above 0",
        (10.0, {"train.hang_floor_s": 0.0}, {}),
    ),
    _evaluation("eval_every", 50, quiet=(0,)),
    _evaluation("eval_batches", 2),
    Needs(
        "gpt.rope_theta",
        "model.rope_theta",
        "rotary positions (llama style)",
        on.model("style", "llama"),
        on.with_model("gpt", "style", " (learned positions)"),
        "use --gpt.style llama",
        (500_000.0, {"model.style": "gpt2"}, {}),
        family="gpt",
    ),
    Needs(
        "gpt.restart_positions",
        "model.restart_positions",
        "packed batches",
        on.packed,
        on.said("on batches of plain windows"),
        "train on packed documents (--data.source tokens)",
        (False, {}, {"data": DataConfig(source="tokens", path="corpus")}),
        family="gpt",
    ),
    _dispatch("grouped_impl", "dropless", ("tiled", {}, {"model.dispatch": "dropless"})),
    _dispatch("capacity_factor", "capacity", (2.0, {"model.dispatch": "dropless"}, {})),
    _checkpoints("save_every", (50, _NO_SAVE, {})),
    _checkpoints("keep_last", (5, {"train.run_dir": ""}, {})),
    _checkpoints("keep_every", (1000, _NO_SAVE, {})),
    _checkpoints("async_save", (False, _NO_SAVE, {})),
    _checkpoints("checkpoint_dir", ("ckpt", _NO_SAVE, {"train.run_dir": ""}), fix="drop --no-save"),
    _source(
        "data.packing",
        "prepared tokens (the only source with document boundaries)",
        ("tokens",),
        "use --data.source tokens",
        (False, {}, {"data.source": "tokens", "data.path": "corpus"}),
    ),
    _source(
        "data.max_bytes",
        "the stdlib source",
        ("stdlib",),
        "use --data.source stdlib",
        (1_000_000, {"data.source": "synthetic"}, {}),
    ),
    _source(
        "data.seq_len",
        "the token sources (stdlib, synthetic, text, tokens)",
        ("stdlib", "synthetic", "text", "tokens"),
        "use a token source (arrays take their length from the arrays)",
        (64, {"data.source": "digits"}, {}),
    ),
    _source(
        "data.image_shape",
        "the fake_images source",
        ("fake_images",),
        "use --data.source fake_images (the other image sources read their shape)",
        ((8, 8, 1), {}, {"data.source": "fake_images"}),
    ),
    Needs(
        "data.val_fraction",
        "data.val_fraction",
        "the held-out tail of the training data",
        on.tail_held_out,
        on.said("with --data.eval-path (held-out data of its own)"),
        "drop --data.eval-path",
        (0.1, {"data.eval_path": "held_out.txt"}, {}),
        scope="job",
    ),
)


def no_effect_problems(run: RunSpec) -> list[Problem]:
    """One `Problem` per setting of `run` that differs from its default while the feature it
    belongs to is off (`NEEDS`).

    Args:
        run: the run; its mesh may be axis sizes alone.

    Returns:
        The problems, in the table's order; an empty list when every setting counts.
    """
    run = run.resolved()
    return [p for n in NEEDS if n.scope == "run" and (p := n.problem(run)) is not None]


def job_problems(job) -> list[Problem]:
    """One `Problem` per setting of scope ``job`` that differs from its default while the
    feature it belongs to is off.

    Args:
        job: the settings of ``meshtrain train`` (`meshtrain.cli.train.TrainJob`).

    Returns:
        The problems, in the table's order; an empty list when every setting counts.
    """
    return [p for n in NEEDS if n.scope == "job" and (p := n.problem(job)) is not None]
