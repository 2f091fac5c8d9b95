"""``meshtrain train``: the train job's settings (`TrainJob`) and the run that trains them.

meshtrain train                                   # the embedded default job
meshtrain train --mesh data=4,tensor=2 --strategy fsdp --steps 300
meshtrain train --gpt.style gpt2 --gpt.n-layers 8 --precision bf16
meshtrain train --precision fp16                  # float16 with dynamic loss scaling
meshtrain train --mesh pipe=2,data=2,tensor=2 --schedule 1f1b --microbatches 8
meshtrain train --run-dir runs/a --save-every 50 --resume   # continue from the newest checkpoint
meshtrain train --config plan.json                # flags from a file (later ones win)
meshtrain train --init-from hf:gpt2-dir --export-hf tuned   # fine-tune a HF checkpoint
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Annotated

import tyro

from meshtrain import validate
from meshtrain._log import LOG
from meshtrain.checkpoint import CheckpointConfig, holds_run
from meshtrain.cli import configfile, parsing
from meshtrain.cli.errors import UsageError
from meshtrain.data import DataConfig
from meshtrain.distributed import DistributedConfig
from meshtrain.layout.memory import HOST_KINDS
from meshtrain.mesh import PIPE, SEQ
from meshtrain.models import CNNConfig, GPTConfig, MLPConfig, MoEConfig, families
from meshtrain.offload import Offload
from meshtrain.optim import OptimConfig
from meshtrain.pipeline import PipelineConfig
from meshtrain.precision import Precision
from meshtrain.problem import Problem, RunCheckError, raise_if
from meshtrain.replicas import SyncConfig
from meshtrain.run import RunSpec, TrainConfig

__all__ = ["TrainJob", "build_trainer", "check", "config_flags", "main", "parse", "run"]

EXAMPLE = "meshtrain train --mesh data=4,tensor=2 --steps 300"
_Flat = tyro.conf.OmitArgPrefixes  # the section's flags without its prefix: --steps, --lr


def _family_default(name: str):
    return dataclasses.field(default=families()[name].default)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionFlags(Precision):
    """`Precision` with its policy on the command line as ``--precision``."""

    policy: Annotated[str, tyro.conf.arg(name="precision")] = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadFlags(validate.Checked):
    """`meshtrain.offload.Offload` on the command line.

    Args:
        offload: what lives in host memory between steps: none, or optimizer (the optimizer
            state; each step fetches it and writes it back). Activations go to host memory
            through a remat policy (--gpt.remat offload-dots). See the Memory guide.
        offload_memory_kind: the host memory of --offload optimizer: pinned_host or
            unpinned_host (a remat policy's activations always go to pinned_host).
    """

    offload: str = "none"
    offload_memory_kind: str = "pinned_host"

    def problems(self) -> list[Problem]:
        """An unknown choice of either flag."""
        return validate.one_of("offload", self.offload, ("none", "optimizer")) + validate.one_of(
            "offload_memory_kind", self.offload_memory_kind, HOST_KINDS
        )

    def config(self) -> Offload:
        """The `Offload` these flags describe."""
        return Offload(optimizer=self.offload == "optimizer", memory_kind=self.offload_memory_kind)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainJob(validate.Checked):
    """Train a model on a device mesh. With no flags: a small Llama-style GPT on this Python's
    own standard library, on 8 simulated CPU devices, as a data × fsdp × tensor = 2×2×2 hybrid.

    Args:
        mesh: mesh axis sizes, e.g. "data=4,tensor=2"; one axis may be -1 (fill).
        strategy: dp, fsdp, hsdp or zero1, optionally "+tp" (tensor rules apply whenever
            tensor > 1); auto picks from the mesh: hsdp when data and fsdp are both > 1, fsdp
            when only fsdp is, else dp, with +tp when tensor > 1.
        context_parallel: attention over a sequence split over seq > 1: ring (default; memory
            falls as 1/seq), allgather (short sequences, GQA) or ulysses (heads divisible by
            seq).
        devices: CPU devices to simulate (per process); 0 uses the real devices (e.g. GPUs).
        model: the model family: gpt (decoder-only transformer, GPT-2 or Llama style), mlp
            (residual MLP classifier), cnn (LeNet/VGG or ResNet style image classifier) or moe
            (mixture-of-experts decoder, Mixtral style); its flags are --NAME.field.
        prompt: start of the sample printed at the end (language models only).
        sample_tokens: tokens to sample at the end (0 = none).
        save: write checkpoints (to run_dir/checkpoints unless --checkpoint-dir is given).
        init_from: start from a Hugging Face checkpoint, hf:PATH: its weights, its model shape
            and (unless --data.tokenizer is given) its tokenizer.json; model flags may change
            only training choices (remat, dtype, kernels).
        export_hf: after training, write the model (and tokenizer) as a Hugging Face checkpoint
            to this new directory (transformers loads it).
        precision: fp32, bf16, fp16 (dynamic loss scaling) or fp8 (e4m3/e5m2 dense
            matmuls); auto: the model's --NAME.dtype (fp32 unless set). See the Precision
            guide.
        gpt: the gpt family's config (with --model gpt).
        mlp: the mlp family's config (with --model mlp).
        cnn: the cnn family's config (with --model cnn).
        moe: the moe family's config (with --model moe).
        dist: joining a multi-process job (meshtrain launch, srun, mpirun, a JobSet).
    """

    mesh: str = "data=2,fsdp=2,tensor=2"
    strategy: str = "auto"
    context_parallel: str = "ring"
    devices: int = 8
    model: str = "gpt"
    prompt: str = "def "
    sample_tokens: int = 160
    save: bool = True
    init_from: str = ""
    export_hf: str = ""
    train: Annotated[TrainConfig, _Flat] = TrainConfig(steps=200)
    pipeline: Annotated[PipelineConfig, _Flat] = PipelineConfig()
    checkpoint: Annotated[CheckpointConfig, _Flat] = CheckpointConfig()
    optim: Annotated[OptimConfig, _Flat] = OptimConfig()
    sync: Annotated[SyncConfig, _Flat] = SyncConfig()
    precision: Annotated[PrecisionFlags, _Flat] = PrecisionFlags()
    offload: Annotated[OffloadFlags, _Flat] = OffloadFlags()
    data: DataConfig = DataConfig()
    # One field per registered model family (tests/test_cli_package.py checks the registry).
    gpt: GPTConfig = _family_default("gpt")
    mlp: MLPConfig = _family_default("mlp")
    cnn: CNNConfig = _family_default("cnn")
    moe: MoEConfig = _family_default("moe")
    dist: DistributedConfig = DistributedConfig()

    def problems(self) -> list[Problem]:
        """What is wrong with the job's own fields (each config checks its own)."""
        from meshtrain.context_parallel import algorithm_problems

        return (
            validate.one_of("model", self.model, families())
            + algorithm_problems(self.context_parallel)
            + validate.non_negative("devices", self.devices, example=8, note="0: real devices")
            + validate.non_negative("sample_tokens", self.sample_tokens, example=160)
        )

    def model_config(self):
        """The chosen model family's config."""
        return getattr(self, self.model)


def _fresh_default_run_dir(job: TrainJob, say) -> TrainJob:
    """A fresh run left at the default run_dir moves to the next free ``runs/default-N`` when
    the default already holds a run, so ``make train`` runs again without touching it. An
    explicit ``--run-dir`` that holds checkpoints is an error (see `directory_problems`)."""
    default = TrainConfig.run_dir
    if (
        job.checkpoint.resume
        or job.checkpoint.checkpoint_dir
        or job.train.run_dir != default
        or not holds_run(Path(default))
    ):
        return job
    n = 1
    while Path(f"{default}-{n}").exists():
        n += 1
    run_dir = f"{default}-{n}"
    say(f"{default} holds an earlier run (--resume continues it); this run writes to {run_dir}")
    return dataclasses.replace(job, train=dataclasses.replace(job.train, run_dir=run_dir))


def build_trainer(job: TrainJob, say=print):
    """Builds the mesh, data and `Trainer` of a job (resuming if it asks to); trains nothing.

    Args:
        job: the job; with ``--init-from``, as `meshtrain.hf.finetune.resolve` returned it.
        say: where progress lines go.

    Returns:
        The `Trainer`; with ``job.checkpoint.resume`` its state is the restored one.
    """
    from meshtrain.data import make_dataset
    from meshtrain.hf import finetune
    from meshtrain.layout import rules_for
    from meshtrain.mesh import make_mesh, simulate_devices
    from meshtrain.train.trainer import Trainer

    checkpointing = job.save and bool(job.train.run_dir or job.checkpoint.checkpoint_dir)
    if job.checkpoint.resume and not checkpointing:
        raise RunCheckError(
            [
                Problem(
                    "checkpoint.resume",
                    True,
                    "needs checkpoints, but --no-save or an empty --run-dir turns them off; "
                    "drop --no-save or give --run-dir / --checkpoint-dir",
                )
            ]
        )
    if job.devices:
        simulate_devices(job.devices)
    if job.dist.wanted():  # under meshtrain launch, srun, mpirun or a JobSet
        from meshtrain import distributed

        distributed.initialize(job.dist)
    job = _fresh_default_run_dir(job, say)  # after jax starts: `say` asks for the process index
    mesh = make_mesh(job.mesh)
    rules = rules_for(job.strategy, mesh, context_parallel=job.context_parallel)
    data = make_dataset(job.data)
    with summary_to(say):  # the Trainer logs the run summary (`RunSpec.summary`)
        trainer = Trainer(
            run=run_spec(
                job, data, mesh, rules, checkpoint=job.checkpoint if checkpointing else None
            ),
            run_meta={"job": dataclasses.asdict(job)},
            params=finetune.initial_params(job, mesh, rules),
        )
    if mesh.shape[PIPE] > 1 and job.pipeline.gather_once:
        say(gathered_line(job, mesh, rules))
    return trainer


class _Say(logging.Handler):
    """Hands each record of the ``meshtrain`` logger to the CLI's `say`."""

    def __init__(self, say):
        super().__init__(logging.INFO)
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        self.say(record.getMessage())


@contextlib.contextmanager
def summary_to(say):
    """Within it, the ``meshtrain`` logger's INFO lines (the run summary) go to `say` alone."""
    handler, propagate = _Say(say), LOG.propagate
    LOG.addHandler(handler)
    LOG.propagate = False
    try:
        yield
    finally:
        LOG.removeHandler(handler)
        LOG.propagate = propagate


def gathered_line(job: TrainJob, mesh, rules) -> str:
    """What ``--gather-once`` keeps whole, as the communication model counts it."""
    from meshtrain._units import fmt_bytes
    from meshtrain.comm.expect import stage_weight_bytes

    held = stage_weight_bytes(job.model_config(), mesh, rules)
    return f"gather once: +{fmt_bytes(held)} of stage weights per device"


def run_spec(job: TrainJob, data, mesh, rules, checkpoint=None) -> RunSpec:
    """The `RunSpec` a job describes, on a built mesh and data."""
    return RunSpec(
        model=job.model_config(),
        data=data,
        mesh=mesh,
        rules=rules,
        train=job.train,
        optim=job.optim,
        pipeline=job.pipeline,
        sync=job.sync,
        precision=job.precision,
        offload=job.offload.config(),
        checkpoint=checkpoint,
    )


def run_train(job: TrainJob, given: frozenset[str] = frozenset()) -> dict:
    """Runs a `TrainJob`: builds mesh, data and model, trains with checkpoints, samples.

    Args:
        job: the job.
        given: the dotted fields its command line set (`parsing.given`); ``--init-from``
            keeps the model fields given and takes the rest from the checkpoint.

    Returns:
        A summary: final loss, eval loss, wall time, checkpoint path, sample text; with
        ``stopped`` (the signal's name) when a SIGTERM/SIGINT ended it early.
    """
    start = time.perf_counter()
    import jax

    def say(*parts):
        if jax.process_index() == 0:
            print(*parts, flush=True)

    from meshtrain.hf import finetune

    job = finetune.resolve(job, given)  # --init-from / --export-hf: JSON read and checked
    trainer = build_trainer(job, say)
    first = int(jax.device_get(trainer.state.step))
    _announce(job, trainer, first, say)
    try:
        history = trainer.fit()
    finally:
        if trainer.checkpoints:
            trainer.checkpoints.close()
    summary = _summary(trainer, history)
    if trainer.stop_reason:
        saved = (
            f"checkpoint {summary['checkpoint']}" if trainer.checkpoints else "no checkpoint kept"
        )
        step = int(jax.device_get(trainer.state.step))
        why = trainer.stop_reason
        say(f"meshtrain: {why}: stopped after step {step}; {saved}; --resume continues")
        summary["stopped"] = trainer.stop_reason
        return summary
    if trainer.checkpoints:
        say(f"checkpoint saved to {summary['checkpoint']}")
    _stop_unless_finite(summary)
    _after_training(job, trainer, summary, say)
    summary["wall_s"] = time.perf_counter() - start
    loss = summary["final_loss"]
    ppl = summary.get("eval_perplexity")
    say(
        f"done in {summary['wall_s']:.0f} s · final loss "
        + (f"{loss:.3f}" if loss is not None else "n/a (no steps left to run)")
        + (f" · eval loss {summary['eval_loss']:.3f}" if summary["eval_loss"] else "")
        + (f" (perplexity {ppl:.4g})" if ppl is not None else "")
    )
    return summary


def _announce(job: TrainJob, trainer, first: int, say) -> None:
    """The CLI's lines after the run summary: resume, initial weights, the data's source."""
    data = trainer.data
    if job.checkpoint.resume and trainer.checkpoints:
        where = trainer.checkpoints.directory
        say(
            f"resumed from {where / str(first)}"
            if first
            else f"no checkpoint in {where}: from step 0"
        )
    if job.init_from and not first:
        say(f"weights and tokenizer from {job.init_from} · data.tokenizer {job.data.tokenizer}")
    clients = (
        f" · clients: a Dirichlet({data.client_alpha:g}) mix each" if data.client_alpha else ""
    )
    say(f"data source {job.data.source} · {data.num_train} training examples{clients}")


def _summary(trainer, history: list[dict]) -> dict:
    """The losses of a finished `fit` and where its last checkpoint is."""
    import jax

    last = history[-1] if history else {}
    summary = {"final_loss": last.get("loss"), "eval_loss": last.get("eval_loss")}
    if last.get("eval_perplexity") is not None:
        summary["eval_perplexity"] = last["eval_perplexity"]
    if trainer.checkpoints:
        step = int(jax.device_get(trainer.state.step))
        summary["checkpoint"] = str(trainer.checkpoints.path(step))
    return summary


def _stop_unless_finite(summary: dict) -> None:
    """Raises `NonFiniteError` when the run ended on a loss that is not finite: it did not
    train (data outside the vocabulary, a step that diverged), and must not end ``done``."""
    from meshtrain.train.hooks import NonFiniteError

    for key in ("final_loss", "eval_loss"):
        value = summary.get(key)
        if value is not None and not math.isfinite(value):
            name = key.replace("_", " ")
            raise NonFiniteError(
                f"the {name} is {value}: the run ended without a finite loss (tokens outside "
                "the vocabulary, or steps that diverged); the checkpoints are kept: check the "
                "data and --lr, then --resume or start afresh"
            )


def _after_training(job: TrainJob, trainer, summary: dict, say) -> None:
    """The Hugging Face export and the sample a job asks for, added to `summary`."""
    if job.export_hf:
        from meshtrain.data import load_tokenizer
        from meshtrain.hf import finetune

        tokenizer = load_tokenizer(getattr(job.data, "tokenizer", "bytes"))
        summary["export_hf"] = str(finetune.export(trainer, job.export_hf, tokenizer=tokenizer))
        say(f"Hugging Face checkpoint written to {summary['export_hf']}")
    if job.sample_tokens and trainer.data.kind == "lm":
        text = trainer.generate(job.prompt, job.sample_tokens)
        summary["sample"] = text
        say("sample:\n" + text)


def config_flags(argv: list[str], cls: type = TrainJob) -> list[str]:
    """Expands ``--config FILE`` (a JSON object of flag name → value, as ``meshtrain plan
    --write`` saves) into flags placed first, so flags given on the command line win; each
    value is checked against its flag's type (`meshtrain.cli.configfile`)."""
    return configfile.expand(argv, cls)


def parse(argv: list[str], cls: type = TrainJob, name: str = "train"):
    """The job the words after ``meshtrain train`` describe (``--config`` expanded); runs
    nothing.

    Args:
        argv: the words after the subcommand.
        cls: the job's class (`TrainJob`, or a subclass such as inspect's).
        name: the subcommand, for the help and the error lines.

    Raises:
        ValueError: a config rejected its value (e.g. ``--steps 0``); a `UsageError` for a
            flag tyro cannot read.
        SystemExit: ``--help`` (code 0).
    """
    example = EXAMPLE.replace("meshtrain train", f"meshtrain {name}")
    file = configfile.read(argv, cls)
    with configfile.relabelled(file):
        return parsing.parse(name, cls, file.argv if file else argv, example=example)


def _seq_size(job: TrainJob) -> int | None:
    """The mesh's seq size, when the flags alone decide it (None: a fill over real devices)."""
    from meshtrain.mesh import MeshConfig

    try:
        mesh = MeshConfig.parse(job.mesh)
        if mesh.seq != -1:
            return mesh.seq
        return mesh.sizes(job.devices)[SEQ] if job.devices else None
    except ValueError:
        return None  # a bad mesh: the run check names it


def check(job: TrainJob, given: frozenset[str]) -> None:
    """The mistakes only the command line can make, refused before anything runs.

    Raises:
        UsageError: flags of a model family the job does not train, or ``--context-parallel``
            given while the mesh splits nothing over seq.
        RunCheckError: settings a `RunSpec` does not hold changed while their feature is off
            (`meshtrain.effect.job_problems`: checkpoints under --no-save, data options).
    """
    from meshtrain.effect import job_problems

    for path in sorted(given):
        family = path.split(".")[0]
        if family in families() and family != job.model and "." in path:
            flag = "--" + path.replace("_", "-")
            raise UsageError(
                f"{flag}: a flag of the {family} model, but --model is {job.model}; add "
                f"--model {family}, or drop the --{family}.* flags"
            )
    if "context_parallel" in given and _seq_size(job) == 1:
        raise UsageError(
            f"--context-parallel {job.context_parallel}: the mesh {job.mesh} has no seq axis > 1, "
            "so no attention is split over the sequence; add seq=N to --mesh (e.g. --mesh "
            "data=4,seq=2) or drop --context-parallel"
        )
    raise_if(job_problems(job))


def run(job: TrainJob, given: frozenset[str] = frozenset()) -> int:
    """Trains `job` (see `run_train`); returns the exit code."""
    check(job, given)
    run_train(job, given)
    return 0


def main(argv: list[str]) -> int:
    """``meshtrain train ARGV``: parses, checks and runs; returns the exit code."""
    file = configfile.read(argv, TrainJob)
    argv = file.argv if file else argv
    with configfile.relabelled(file):  # a value of the file is refused as the file's
        return run(parse(argv), parsing.given(argv, TrainJob))
