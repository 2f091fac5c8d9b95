"""The ``meshtrain`` command. Its flags are generated (by tyro) from the config dataclasses.

meshtrain train                                   # the embedded default job
meshtrain train --mesh data=4,tensor=2 --strategy fsdp --steps 300
meshtrain train --gpt.style gpt2 --gpt.n-layers 8 --gpt.dtype bfloat16
meshtrain train --mesh pipe=2,data=2,tensor=2 --schedule 1f1b --microbatches 8
meshtrain train --help
meshtrain launch --nproc 2 --devices-per-proc 4 -- train   # 2 local processes, 4 devices each
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import tyro

from meshtrain.data import DataConfig
from meshtrain.distributed import DistributedConfig, DistributedError
from meshtrain.models import GPTConfig, MLPConfig
from meshtrain.pipeline import PipelineConfig
from meshtrain.train.optim import OptimConfig
from meshtrain.train.trainer import TrainConfig

MODEL_NAMES = ("gpt", "mlp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainJob:
    """Train a model on a device mesh. With no flags: a small Llama-style GPT on this Python's
    own standard library, on 8 simulated CPU devices, as a data × fsdp × tensor = 2×2×2 hybrid.

    Args:
        mesh: mesh axis sizes, e.g. "data=4,tensor=2"; one axis may be -1 (fill).
        strategy: dp, fsdp, hsdp or zero1, optionally "+tp" (tensor rules apply whenever
            tensor > 1).
        devices: CPU devices to simulate (per process); 0 uses the real devices (e.g. GPUs).
        model: gpt or mlp.
        prompt: start of the sample printed at the end (gpt only).
        sample_tokens: tokens to sample at the end (0 = none).
        save: save a checkpoint in run_dir at the end.
    """

    mesh: str = "data=2,fsdp=2,tensor=2"
    strategy: str = "hsdp+tp"
    devices: int = 8
    model: str = "gpt"
    prompt: str = "def "
    sample_tokens: int = 160
    save: bool = True
    train: Annotated[TrainConfig, tyro.conf.OmitArgPrefixes] = TrainConfig(steps=200)
    pipeline: Annotated[PipelineConfig, tyro.conf.OmitArgPrefixes] = PipelineConfig()
    optim: Annotated[OptimConfig, tyro.conf.OmitArgPrefixes] = OptimConfig()
    data: DataConfig = DataConfig()
    gpt: GPTConfig = GPTConfig(n_kv_heads=2)
    mlp: MLPConfig = MLPConfig()
    dist: DistributedConfig = DistributedConfig()

    def __post_init__(self):
        if self.model not in MODEL_NAMES:
            raise ValueError(
                f"model={self.model!r}: unknown model; choose from {', '.join(MODEL_NAMES)}"
            )
        if self.devices < 0 or self.sample_tokens < 0:
            raise ValueError(
                f"devices={self.devices}, sample_tokens={self.sample_tokens}: must be ≥ 0"
            )

    def model_config(self) -> GPTConfig | MLPConfig:
        """The chosen model's config."""
        return self.gpt if self.model == "gpt" else self.mlp


def run_train(job: TrainJob) -> dict:
    """Runs a `TrainJob`: builds mesh, data and model, trains, saves, samples.

    Returns:
        A summary: final loss, eval loss, wall time, checkpoint path, sample text.
    """
    start = time.perf_counter()
    import jax

    from meshtrain import checkpoint
    from meshtrain.data import make_dataset
    from meshtrain.mesh import describe, make_mesh, simulate_devices
    from meshtrain.sharding import rules_for
    from meshtrain.train.trainer import Trainer

    if job.devices:
        simulate_devices(job.devices)
    if job.dist.wanted():  # under meshtrain launch, srun, mpirun or a JobSet
        from meshtrain import distributed

        distributed.initialize(job.dist)
    model_cfg = job.model_config()
    mesh = make_mesh(job.mesh)
    rules = rules_for(job.strategy, mesh)
    data = make_dataset(job.data)
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    say(f"meshtrain · mesh {describe(mesh)} · strategy {job.strategy}")
    if mesh.shape["pipe"] > 1:
        pc = job.pipeline
        say(
            f"pipeline {pc.schedule} · {mesh.shape['pipe']} stages · "
            f"{pc.num_microbatches(mesh.shape['pipe'])} microbatches"
            + (f" · {pc.repeats} chunks per stage" if pc.schedule == "circular" else "")
        )
    trainer = Trainer(
        model_cfg,
        data,
        mesh=mesh,
        rules=rules,
        optim=job.optim,
        config=job.train,
        pipeline=job.pipeline,
    )
    n_params = sum(x.size for x in jax.tree.leaves(trainer.state.params))
    shape = ", ".join(
        f"{k}={v}"
        for k, v in dataclasses.asdict(model_cfg).items()
        if k in ("style", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_hidden")
    )
    say(
        f"model {job.model} ({shape}) · {n_params / 1e6:.2f}M parameters · "
        f"{model_cfg.dtype} compute"
    )
    say(
        f"data {job.data.source} · {data.num_train} training examples · global batch "
        f"{data.batch_size}" + (f" × {data.seq_len} tokens" if data.seq_len else "")
    )
    history = trainer.fit()
    summary = {"final_loss": history[-1]["loss"], "eval_loss": history[-1].get("eval_loss")}
    if job.save and job.train.run_dir:
        run_dir = Path(job.train.run_dir)
        ckpt = run_dir / f"checkpoint-{int(jax.device_get(trainer.state.step))}"
        if ckpt.exists():
            ckpt = run_dir / f"{ckpt.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        meta = {"job": dataclasses.asdict(job), "mesh": str(job.mesh)}
        summary["checkpoint"] = str(checkpoint.save(ckpt, trainer.state, meta=meta))
        say(f"checkpoint saved to {summary['checkpoint']}")
    if job.model == "gpt" and job.sample_tokens and data.kind == "lm":
        text = trainer.generate(job.prompt, job.sample_tokens)
        summary["sample"] = text
        say("sample:\n" + text)
    summary["wall_s"] = time.perf_counter() - start
    say(
        f"done in {summary['wall_s']:.0f} s · final loss {summary['final_loss']:.3f}"
        + (f" · eval loss {summary['eval_loss']:.3f}" if summary["eval_loss"] else "")
    )
    return summary


def _raise_config_error(event) -> None:
    """tyro parse-error hook: re-raises a config's own ValueError (from ``__post_init__``), so
    `main` prints it as one line rather than tyro's box, which names tyro's inner wrappers.
    Errors tied to one flag (``--steps abc``) keep tyro's box, which shows that flag's help."""
    from tyro import _errors

    failure = getattr(_errors, "InstantiationFailure", ())
    if isinstance(event, failure) and getattr(event, "argument", None) is None:
        raise ValueError(event.message)


def parse(argv: list[str]) -> TrainJob:
    """Parses command-line arguments (without the program name) into a job; runs nothing.

    Raises:
        ValueError: a config rejected its value (e.g. ``--steps 0``).
        SystemExit: ``--help`` (code 0), or flags tyro itself rejects (code 2).
    """
    try:  # tyro's hook API is private and experimental: without it, tyro's own box shows
        from tyro._errors import on_parse_error
    except ImportError:
        hook = contextlib.nullcontext()
    else:
        hook = on_parse_error(_raise_config_error)
    with hook:
        return tyro.extras.subcommand_cli_from_dict(
            {"train": TrainJob},
            args=argv,
            prog="meshtrain",
            description="meshtrain: sharded training where the XLA compiler does the distributing. "
            "Multi-process: meshtrain launch --nproc N [--devices-per-proc K] -- train ...",
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``meshtrain`` command."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:
        from meshtrain.launch import run

        return run(argv[1:])
    try:
        job = parse(argv)
        if isinstance(job, TrainJob):
            run_train(job)
    except (ValueError, DistributedError) as e:
        if os.environ.get("MESHTRAIN_DEBUG"):
            raise
        print(f"meshtrain: error: {e} (MESHTRAIN_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("meshtrain: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
