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
    Needs(
        "loss_scale_init",
        "precision.loss_scale_init",
        "fp16's loss scaling",
        on.scales,
        on.unscaled,
        "use --precision fp16 (with --loss-scale auto or dynamic)",
        (1024.0, {}, _FP16),
    ),
    Needs(
        "loss_scale_period",
        "precision.loss_scale_period",
        "fp16's loss scaling",
        on.scales,
        on.unscaled,
        "use --precision fp16 (with --loss-scale auto or dynamic)",
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
    Needs(
        "schedule",
        "pipeline.schedule",
        "pipelines",
        on.pipelined,
        on.no_pipe,
        "add pipe=N to --mesh (e.g. --mesh pipe=2,data=4)",
        ("1f1b", {}, _PIPE),
    ),
    Needs(
        "microbatches",
        "pipeline.microbatches",
        "pipelines",
        on.pipelined,
        on.no_pipe,
        "add pipe=N to --mesh (gradient accumulation is --accum-steps)",
        (8, {}, _PIPE),
    ),
    Needs(
        "repeats",
        "pipeline.repeats",
        "pipelines with several chunks per stage",
        on.pipelined,
        on.no_pipe,
        "add pipe=N to --mesh with --schedule interleaved-1f1b or circular",
        (2, {}, {**_PIPE, "pipeline.schedule": "circular"}),
    ),
    Needs(
        "gather_once",
        "pipeline.gather_once",
        "pipelines",
        on.pipelined,
        on.no_pipe,
        "add pipe=N to --mesh (e.g. --mesh pipe=2,fsdp=4)",
        (True, {}, _PIPE),
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
    Needs(
        "outer_lr",
        "sync.outer_lr",
        "the outer optimizers nesterov and adam",
        lambda run: run.sync.outer_optimizer != "average",
        on.said("with --outer-optimizer average"),
        "use --outer-optimizer nesterov or adam (with --sync-every H)",
        (0.5, {}, {"sync.outer_optimizer": "nesterov", "sync.sync_every": 4}),
    ),
    Needs(
        "outer_momentum",
        "sync.outer_momentum",
        "the outer optimizers nesterov and adam",
        lambda run: run.sync.outer_optimizer != "average",
        on.said("with --outer-optimizer average"),
        "use --outer-optimizer nesterov or adam (with --sync-every H)",
        (0.5, {}, {"sync.outer_optimizer": "adam", "sync.sync_every": 4}),
    ),
    Needs(
        "client_seed",
        "sync.client_seed",
        "federated averaging",
        lambda run: run.sync.federates,
        on.said("without --client-fraction"),
        "add --client-fraction F (with --sync-every H)",
        (7, {}, {"sync.client_fraction": 0.5, "sync.sync_every": 4}),
    ),
    Needs(
        "b1",
        "optim.b1",
        "adamw and lamb",
        on.optimizer("adamw", "lamb"),
        on.with_optimizer,
        "use --optimizer adamw or lamb",
        (0.8, _NOT_ADAM, {}),
    ),
    Needs(
        "b2",
        "optim.b2",
        "adamw and lamb",
        on.optimizer("adamw", "lamb"),
        on.with_optimizer,
        "use --optimizer adamw or lamb",
        (0.99, {"optim.optimizer": "lars"}, {"optim.optimizer": "lamb"}),
    ),
    Needs(
        "eps",
        "optim.eps",
        "adamw and lamb",
        on.optimizer("adamw", "lamb"),
        on.with_optimizer,
        "use --optimizer adamw or lamb",
        (1e-6, _NOT_ADAM, {}),
    ),
    Needs(
        "momentum",
        "optim.momentum",
        "sgd and lars",
        on.optimizer("sgd", "lars"),
        on.with_optimizer,
        "use --optimizer sgd or lars",
        (0.5, {}, _NOT_ADAM),
    ),
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
    Needs(
        "eval_every",
        "train.eval_every",
        "evaluation",
        on.held_out,
        on.said("on data without held-out examples"),
        "hold some out (--data.val-fraction, --data.eval-path)",
        (50, {"data": DataConfig(val_fraction=0.0)}, {}),
        quiet=(0,),
    ),
    Needs(
        "eval_batches",
        "train.eval_batches",
        "evaluation",
        on.held_out,
        on.said("on data without held-out examples"),
        "hold some out (--data.val-fraction, --data.eval-path)",
        (2, {"data": DataConfig(val_fraction=0.0)}, {}),
    ),
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
    Needs(
        "moe.grouped_impl",
        "model.grouped_impl",
        "dropless dispatch",
        on.model("dispatch", "dropless"),
        on.with_model("moe", "dispatch"),
        "use --moe.dispatch dropless",
        ("tiled", {}, {"model.dispatch": "dropless"}),
        family="moe",
    ),
    Needs(
        "moe.capacity_factor",
        "model.capacity_factor",
        "capacity dispatch",
        on.model("dispatch", "capacity"),
        on.with_model("moe", "dispatch"),
        "use --moe.dispatch capacity",
        (2.0, {"model.dispatch": "dropless"}, {}),
        family="moe",
    ),
    Needs(
        "save_every",
        "checkpoint.save_every",
        "checkpoints",
        on.saves,
        on.unsaved,
        _CHECKPOINTS,
        (50, _NO_SAVE, {}),
        scope="job",
    ),
    Needs(
        "keep_last",
        "checkpoint.keep_last",
        "checkpoints",
        on.saves,
        on.unsaved,
        _CHECKPOINTS,
        (5, {"train.run_dir": ""}, {}),
        scope="job",
    ),
    Needs(
        "keep_every",
        "checkpoint.keep_every",
        "checkpoints",
        on.saves,
        on.unsaved,
        _CHECKPOINTS,
        (1000, _NO_SAVE, {}),
        scope="job",
    ),
    Needs(
        "async_save",
        "checkpoint.async_save",
        "checkpoints",
        on.saves,
        on.unsaved,
        _CHECKPOINTS,
        (False, _NO_SAVE, {}),
        scope="job",
    ),
    Needs(
        "checkpoint_dir",
        "checkpoint.checkpoint_dir",
        "checkpoints",
        on.saves,
        on.unsaved,
        "drop --no-save",
        ("ckpt", _NO_SAVE, {"train.run_dir": ""}),
        scope="job",
    ),
    Needs(
        "data.packing",
        "data.packing",
        "prepared tokens (the only source with document boundaries)",
        on.source("tokens"),
        on.with_source,
        "use --data.source tokens",
        (False, {}, {"data.source": "tokens", "data.path": "corpus"}),
        scope="job",
    ),
    Needs(
        "data.max_bytes",
        "data.max_bytes",
        "the stdlib source",
        on.source("stdlib"),
        on.with_source,
        "use --data.source stdlib",
        (1_000_000, {"data.source": "synthetic"}, {}),
        scope="job",
    ),
    Needs(
        "data.seq_len",
        "data.seq_len",
        "the token sources (stdlib, synthetic, text, tokens)",
        on.source("stdlib", "synthetic", "text", "tokens"),
        on.with_source,
        "use a token source (arrays take their length from the arrays)",
        (64, {"data.source": "digits"}, {}),
        scope="job",
    ),
    Needs(
        "data.image_shape",
        "data.image_shape",
        "the fake_images source",
        on.source("fake_images"),
        on.with_source,
        "use --data.source fake_images (the other image sources read their shape)",
        ((8, 8, 1), {}, {"data.source": "fake_images"}),
        scope="job",
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
