"""The two ends of the fine-tune workflow: a run that starts from a Hugging Face checkpoint
(``meshtrain train --init-from hf:PATH``) and the checkpoint it writes back (``--export-hf DIR``).

The run takes the model's shape from the checkpoint's ``config.json`` and its tokenizer from the
``tokenizer.json`` beside it; the flags keep the training choices (remat, dtype, kernels). All of
it is checked by reading JSON only, before anything is built or compiled.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from meshtrain.filevalues import read_json
from meshtrain.hf.config import FIX, config_from_hf, same_architecture
from meshtrain.hf.files import tensor_files
from meshtrain.hf.pretrained import load_pretrained, save_pretrained
from meshtrain.hf.registry import adapter_for
from meshtrain.hf.tokenizer import tokenizer_path
from meshtrain.models.gpt import GPTConfig

PREFIX = "hf:"
# A wrong value in the checkpoint's config.json: the other fix is a model of one's own shape.
FLAG_FIX = "or pass --{flag} when not using --init-from"


def checkpoint_dir(spec: str, field: str = "init_from") -> Path:
    """The directory of an ``hf:PATH`` spec, checked to hold a Hugging Face model.

    Args:
        spec: ``hf:PATH``.
        field: the flag's name, for the error.

    Returns:
        PATH.

    Raises:
        ValueError: not ``hf:...``, or PATH has no ``config.json`` or no safetensors weights.
    """
    if not spec.startswith(PREFIX) or not spec[len(PREFIX) :]:
        raise ValueError(
            f"{field}={spec!r}: give hf:PATH, PATH a Hugging Face model directory "
            "(config.json + model.safetensors)"
        )
    path = Path(spec[len(PREFIX) :])
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{field}={spec!r}: {path} has no config.json, so it is not a Hugging Face model "
            "directory; give the directory save_pretrained (or transformers) wrote"
        )
    try:
        tensor_files(path)
    except ValueError as e:
        raise ValueError(f"{field}={spec!r}: {e}") from None
    return path


def given_fields(config, default, given=(), prefix: str = "gpt") -> list[str]:
    """The fields of `config` the command line set: those that differ from `default`, and
    those a flag set (``"{prefix}.field"`` in `given`), even to the default's value."""
    names = [f.name for f in dataclasses.fields(config)]
    named = {path[len(prefix) + 1 :] for path in given if path.startswith(prefix + ".")}
    return [n for n in names if n in named or getattr(config, n) != getattr(default, n)]


def run_config(path: Path, flags: GPTConfig, given: list[str]) -> GPTConfig:
    """The model config of a run that starts from the checkpoint in `path`.

    Args:
        path: the checkpoint directory.
        flags: the config the command line built.
        given: the fields the command line set (`given_fields`).

    Returns:
        The checkpoint's config with the fields the flags changed (training choices such as
        ``remat``, ``dtype`` or the kernels; any field that leaves the weights and math alone).

    Raises:
        ValueError: a flag contradicts the checkpoint (one line naming the flags and values).
    """
    where = f"{path / 'config.json'}"
    hf_json = read_json(where, FIX)
    saved = config_from_hf(hf_json, where=where, fix="fix the file", flag_fix=FLAG_FIX)
    given = {name: getattr(flags, name) for name in given}
    wrong = [
        f"--gpt.{name.replace('_', '-')} {value} (the checkpoint has {getattr(saved, name)!r})"
        for name, value in given.items()
        if same_architecture(dataclasses.replace(saved, **{name: value}), saved)
    ]
    if wrong:
        raise ValueError(
            f"init_from: {', '.join(wrong)} contradicts {where}; drop the flag: the model's "
            "shape comes from the checkpoint (flags may change remat, dtype and the kernels)"
        )
    return dataclasses.replace(saved, **given)


def resolve(job, given=frozenset()):
    """The job a ``--init-from`` / ``--export-hf`` run really runs; raises before anything is
    built when either cannot work.

    Args:
        job: a `meshtrain.cli.train.TrainJob`.
        given: the dotted fields the command line set (``"gpt.d_model"``,
            ``"data.tokenizer"``; `meshtrain.cli.parsing.given` computes them once), to tell
            the model flags given from the defaults (without them, only flags that change a
            default count as given).

    Returns:
        The job, with ``--init-from``: the model config from the checkpoint (plus the training
        flags) and, unless ``--data.tokenizer`` was given, the checkpoint's ``tokenizer.json``.
        Without either flag, `job` unchanged.

    Raises:
        ValueError: one line: not a Hugging Face directory, a flag contradicting it, a model
            family without a Hugging Face layout, an export directory that holds a model.
    """
    from meshtrain.models import families

    if not (job.init_from or job.export_hf):
        return job
    family = families()[job.model]
    if family.config is not GPTConfig:
        flag = "--init-from" if job.init_from else "--export-hf"
        raise ValueError(
            f"model={job.model!r}: {flag} reads and writes GPTs (GPT-2, Llama, Mistral, Qwen2 "
            "checkpoints); use --model gpt, or meshtrain.hf.load_mixtral for a Mixtral"
        )
    if job.init_from:
        path = checkpoint_dir(job.init_from)
        flags = job.model_config()
        cfg = run_config(path, flags, given_fields(flags, family.default, given, job.model))
        data, tokenizer = job.data, tokenizer_path(path)
        if tokenizer is not None and data.tokenizer == "bytes" and "data.tokenizer" not in given:
            data = dataclasses.replace(data, tokenizer=str(tokenizer.absolute()))
        job = dataclasses.replace(job, data=data, **{job.model: cfg})
    if job.export_hf:
        check_export(job.export_hf, job.model_config())
    return job


def check_export(directory: str | Path, config: GPTConfig) -> None:
    """Raises a one-line ValueError when `config` cannot be exported to `directory` (it already
    holds a model, or no Hugging Face architecture holds the config); checked before training."""
    path = Path(directory)
    if (path / "config.json").exists() or (path / "model.safetensors").exists():
        raise ValueError(
            f"export_hf={str(directory)!r} already holds a model; choose a new directory "
            "or remove it"
        )
    try:
        adapter_for(config)
    except ValueError as e:
        raise ValueError(f"export_hf={str(directory)!r}: {e}") from None


def initial_params(job, mesh, rules) -> dict | None:
    """The parameters a ``--init-from`` run starts from, read onto `mesh` in its layout.

    Args:
        job: a resolved `meshtrain.cli.train.TrainJob` (see `resolve`).
        mesh: the run's mesh.
        rules: the run's logical-axis rules.

    Returns:
        The checkpoint's parameters for ``Trainer(params=...)``; None without ``--init-from``,
        or when ``--resume`` will restore a saved step instead.
    """
    from meshtrain.checkpoint.dirs import checkpoint_directory, saved_steps

    if not job.init_from:
        return None
    directory = checkpoint_directory(job.checkpoint, job.train.run_dir) if job.save else ""
    if job.checkpoint.resume and directory and saved_steps(Path(directory)):
        return None
    path = checkpoint_dir(job.init_from)
    return load_pretrained(path, config=job.model_config(), mesh=mesh, rules=rules)[1]


def export(trainer, directory: str | Path, *, tokenizer=None, dtype: str = "float32") -> Path:
    """Writes a `Trainer`'s model as a Hugging Face checkpoint, with its tokenizer.

    Args:
        trainer: the `meshtrain.train.Trainer` (a GPT config).
        directory: a new directory.
        tokenizer: the `meshtrain.data.Tokenizer` the run used (saved as ``tokenizer.json``).
        dtype: storage dtype (see `save_pretrained`).

    Returns:
        The directory; ``transformers.AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained`` load it.
    """
    return save_pretrained(
        directory, trainer.state.params, trainer.model_config, dtype=dtype, tokenizer=tokenizer
    )
