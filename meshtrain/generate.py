"""``meshtrain generate``: sample text from a checkpoint with its tokenizer.

    meshtrain generate runs/default --prompt "def " --tokens 200       # a run's newest step
    meshtrain generate runs/a/checkpoints/200 --temperature 0.7 --top-p 0.9
    meshtrain generate hf:exported --top-k 40 --seed 1                 # a Hugging Face directory

A meshtrain checkpoint names its model config and, when the CLI trained it, its tokenizer
(``--data.tokenizer``); a Hugging Face directory has ``config.json`` and (optionally) a
``tokenizer.json``. ``--tokenizer`` overrides either. Its flags are
`meshtrain.cli.generate.GenerateSettings`.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.models.sampling import sample


def _checkpoint_step(source: Path) -> tuple[Path, int]:
    """A run directory, a checkpoint directory or one step's directory → (directory, step)."""
    from meshtrain.checkpoint.dirs import saved_steps

    if source.name.isdigit() and (source / "state").is_dir():
        return source.parent, int(source.name)
    directory = source / "checkpoints" if (source / "checkpoints").is_dir() else source
    steps = saved_steps(directory) if directory.is_dir() else []
    if not steps:
        raise ValueError(
            f"{source}: no meshtrain checkpoint there; give a run directory (--run-dir), a "
            "checkpoint directory, one step's directory, or hf:PATH"
        )
    return directory, steps[-1]


def _read_meta(directory: Path, step: int) -> dict:
    """The JSON facts a checkpoint step records (its ``meta`` item)."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    handlers = {"meta": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(directory, options=options, item_handlers=handlers) as mgr:
        args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        return mgr.restore(step, args=args)["meta"]


def _model_config(meta: dict, where: str):
    """The model config a checkpoint's meta records."""
    from meshtrain.models import families

    saved = dict((meta.get("config") or {}).get("model") or {})
    kind = saved.pop("kind", None)
    for family in families().values():
        if family.config.__name__ == kind:
            fields = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
            return family.config(**fields)
    raise ValueError(
        f"{where}: the checkpoint records no model config meshtrain knows ({kind!r}); it was "
        "written by a Trainer given a model constructor, so build the model in Python and use "
        "meshtrain.models.sampling.sample"
    )


def _load_meshtrain(source: Path):
    """(model, tokenizer spec) of a meshtrain checkpoint, restored onto one device."""
    from meshtrain.checkpoint import restore
    from meshtrain.layout import rules_for
    from meshtrain.mesh import make_mesh
    from meshtrain.optim import OptimConfig, make_optimizer
    from meshtrain.precision import Precision, with_loss_scale
    from meshtrain.state import abstract_model, abstract_train_state

    directory, step = _checkpoint_step(source)
    meta = _read_meta(directory, step)
    cfg = _model_config(meta, f"{directory / str(step)}")
    config = meta["config"]
    tx = make_optimizer(OptimConfig(**config["optim"]), config["train"]["steps"])
    precision = Precision(**config.get("precision") or {})
    if precision.loss_scaling(cfg):  # the loss scale sits in the optimizer state
        tx = with_loss_scale(tx, precision.loss_scale_init)
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    rules = rules_for("dp", mesh)
    ctor = lambda: cfg.build(rngs=nnx.Rngs(0))
    state = restore(directory, abstract_train_state(ctor, tx, mesh, rules), step).state
    graphdef, abstract = abstract_model(ctor)
    graphdef = nnx.split(nnx.merge(graphdef, abstract), nnx.Param, ...)[0]
    tokenizer = ((config.get("job") or {}).get("data") or {}).get("tokenizer", "bytes")
    return nnx.merge(graphdef, state.params, state.rest), tokenizer


def load(source: str, tokenizer: str | None = None):
    """A model and its tokenizer, ready to sample.

    Args:
        source: ``hf:PATH`` (a Hugging Face directory), or a meshtrain run directory,
            checkpoint directory or step directory (the newest step is taken).
        tokenizer: a `meshtrain.data.load_tokenizer` spec; None: the checkpoint's own
            (``tokenizer.json`` beside a Hugging Face checkpoint, the run's
            ``--data.tokenizer`` for a meshtrain one, else ``"bytes"``).

    Returns:
        ``(model, tokenizer)``.

    Raises:
        ValueError: one line: no checkpoint there, or a tokenizer larger than the model's
            vocabulary.
    """
    from meshtrain.data import load_tokenizer

    if source.startswith("hf:"):
        from meshtrain.hf import load_checkpoint_tokenizer, load_model
        from meshtrain.hf.finetune import checkpoint_dir

        path = checkpoint_dir(source, "source")
        model = load_model(path)
        tok = load_tokenizer(tokenizer) if tokenizer else load_checkpoint_tokenizer(path)
        tok = tok or load_tokenizer("bytes")
    else:
        model, spec = _load_meshtrain(Path(source))
        tok = load_tokenizer(tokenizer or spec)
    vocab = getattr(model.cfg, "vocab_size", None)
    if vocab is not None and tok.vocab_size > vocab:
        raise ValueError(
            f"tokenizer {tok.name} has {tok.vocab_size} tokens but the model's vocabulary has "
            f"{vocab}; give --tokenizer the one the model was trained with"
        )
    return model, tok


def generate(
    model,
    tokenizer,
    prompt: str,
    n_new: int = 200,
    *,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> str:
    """Continues `prompt` with `n_new` sampled tokens.

    Args:
        model: a causal LM (e.g. from `load`).
        tokenizer: a `meshtrain.data.Tokenizer`.
        prompt: the text to continue; an empty prompt starts from the tokenizer's EOS token.
        n_new: tokens to sample.
        temperature: softmax temperature (near 0: greedy).
        top_k: sample from the k most probable tokens (0: all).
        top_p: sample from the nucleus of this probability mass (1: all).
        seed: the random seed.

    Returns:
        The prompt and its continuation, decoded.

    Raises:
        ValueError: one line for a setting out of range, or a prompt of more tokens than the
            model's context (``max_seq_len``).
    """
    check_settings(n_new=n_new, temperature=temperature, top_k=top_k, top_p=top_p)
    ids = tokenizer.encode(prompt)
    context = getattr(getattr(model, "cfg", None), "max_seq_len", None)
    if context is not None and len(ids) > context:
        raise ValueError(
            f"prompt: {len(ids)} tokens, longer than the model's context of {context} tokens "
            f"(max_seq_len); give a prompt (--prompt) of at most {context} tokens"
        )
    start = 0
    if not ids:
        if tokenizer.eos_id is None:
            raise ValueError("prompt='': the tokenizer has no EOS token to start from; give text")
        ids, start = [tokenizer.eos_id], 1
    tokens = sample(
        model,
        jnp.asarray(ids, jnp.int32),
        n_new,
        key=jax.random.key(seed),
        temperature=temperature,
        vocab_size=tokenizer.vocab_size,
        top_k=top_k,
        top_p=top_p,
    )
    return tokenizer.decode([int(t) for t in tokens[start:]])


def check_settings(*, n_new: int, temperature: float, top_k: int, top_p: float) -> None:
    """Raises a one-line ValueError naming the first sampling setting out of range."""
    if n_new < 1:
        raise ValueError(f"tokens={n_new}: sample at least 1 token")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(
            f"temperature={temperature}: must be a finite number ≥ 0 (0 samples greedily)"
        )
    if top_k < 0:
        raise ValueError(f"top_k={top_k}: must be ≥ 0 (0 keeps every token)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: must be in (0, 1] (1 keeps every token)")
