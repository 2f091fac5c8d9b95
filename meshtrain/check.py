"""The run check: every reason a run cannot work, found at once, before anything compiles.

`check_run` is a pure function of the run's settings. It allocates nothing and compiles
nothing, so the `Trainer` and the CLI call it once up front, and a planner can call it on
many candidate meshes to reject those that cannot work.

Features that do not run together are refused through one table,
`meshtrain.composition.REFUSALS` (`pair_problems`); each config's own values are checked when
it is built (its ``problems()``, in the words of `meshtrain.validate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flax import nnx

from meshtrain.checkpoint.dirs import directory_problems
from meshtrain.composition import model_name, pair_problems
from meshtrain.context_parallel import context_problems
from meshtrain.data.clients import client_problems
from meshtrain.effect import no_effect_problems
from meshtrain.layout import Rules, state_problems
from meshtrain.mesh import PIPE
from meshtrain.models.base import pipeline_parts, takes_packed
from meshtrain.pipeline import pipeline_problems
from meshtrain.problem import Problem
from meshtrain.replicas.needs import layout_problems as replica_problems
from meshtrain.run import RunSpec

__all__ = ["DEVICE_CHECKS", "check_run"]

# Checks of a run against its devices that use the planner's models, a layer above this one:
# `meshtrain.fit` adds the memory check when meshtrain is imported.
DEVICE_CHECKS: list[Callable[[RunSpec, tuple[nnx.GraphDef, nnx.State]], list[Problem]]] = []


def check_run(
    run: RunSpec, *, abstract: tuple[nnx.GraphDef, nnx.State] | None = None, memory: bool = True
) -> list[Problem]:
    """Every problem with a run's settings, each naming the field, the value and the fix.

    Args:
        run: the run (`RunSpec`); its mesh may be axis sizes alone (a planner's candidate).
            Its ``train.run_dir`` and ``checkpoint`` are checked for being writable and free.
        abstract: the abstract model (``state.abstract_model(ctor)``): with it, every
            parameter's layout and the model's pipeline parts are checked too, and a run
            without other problems is checked against its mesh's devices (`DEVICE_CHECKS`:
            the memory per device, `meshtrain.fit`).
        memory: check against the devices too (off for a compile that allocates nothing).

    Returns:
        The problems; an empty list when the run can start.
    """
    run = run.resolved()
    model, data, rules = run.model_config, run.data, run.rules
    sizes, pipeline, k = run.sizes, run.pipeline, run.train.accum_steps
    spec = run.data_spec
    problems = run.precision.model_problems(run.model)
    problems += offload_problems(run)
    problems += pair_problems(run)  # features that do not run together (meshtrain.composition)
    problems += no_effect_problems(run)  # settings whose feature is off (meshtrain.effect)
    problems += replica_problems(run.sync, rules, sizes)  # gossip's graph, federated clients
    problems += client_problems(getattr(data, "client_alpha", None), run.sync.local)
    algorithm = getattr(rules, "context_parallel", "ring")
    problems += context_problems(sizes, algorithm, seq_len=spec.seq_len, kind=spec.kind)
    ways = rules.batch_ways(sizes)
    if spec.batch_size % (ways * k):
        problems.append(
            Problem(
                "data.batch_size",
                spec.batch_size,
                f"does not divide into accum_steps={k} microbatches across "
                f"{' × '.join(rules.batch_axes(sizes)) or 'batch axes'} = {ways} devices; "
                f"use a multiple of {ways * k}",
            )
        )
    layout_problems = []
    if model is not None:
        vocab = _tokenizer_problems(model, data)
        # the tokenizer's line names the cause; the model's "data has N ids" would repeat it
        problems += vocab + [
            p for p in model.check(spec) if not (vocab and p.field.endswith(".vocab_size"))
        ]
        if callable(getattr(model, "check_layout", None)):  # optional (see ModelConfig)
            layout_problems = model.check_layout(sizes, rules)
    stages = []
    if sizes.get(PIPE, 1) > 1:
        axes = " × ".join(rules.batch_axes(sizes)) or "batch axes"
        stages = _pipeline_problems(model, abstract, pipeline, sizes, spec, ways, axes, k)
    # The model's own layout line names the config field to change; the per-parameter lines
    # would only repeat it, one per tensor (as they would the pipeline's layers line).
    split = any(p.field == _layers_field(model) for p in stages)
    problems += layout_problems or _model_layout_problems(abstract, rules, sizes, split)
    problems += stages
    if spec.packed:
        problems += _packing_problems(abstract)
    problems += directory_problems(run_dir=run.train.run_dir, checkpoint=run.checkpoint)
    if memory and abstract is not None and not problems:
        problems += [p for device_check in DEVICE_CHECKS for p in device_check(run, abstract)]
    return problems


def _tokenizer_problems(model, data) -> list[Problem]:
    """A tokenizer with more tokens than the model's vocabulary."""
    tok, vocab = getattr(data, "tokenizer", None), getattr(model, "vocab_size", None)
    if not hasattr(tok, "vocab_size"):  # a DataConfig names its tokenizer only
        return []
    if tok is None or tok.name == "bytes" or not isinstance(vocab, int) or tok.vocab_size <= vocab:
        return []  # bytes: the model's own line says it
    name = model_name(model)
    return [
        Problem(
            "data.tokenizer",
            tok.name,
            f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary has "
            f"{vocab}; raise --{name}.vocab-size to {tok.vocab_size}, or use a tokenizer of "
            f"at most {vocab} tokens",
        )
    ]


def _packing_problems(abstract) -> list[Problem]:
    """A model that cannot take packed batches (segment ids and positions)."""
    if abstract is None or takes_packed(module := nnx.merge(*abstract)):
        return []
    return [
        Problem(
            "data.packing",
            True,
            f"model {type(module).__name__}'s __call__ does not take the segment_ids= and "
            "positions= keywords a packed batch passes; add them (see "
            "meshtrain.models.GPT.__call__) or train on plain windows (--data.no-packing)",
        )
    ]


def _model_layout_problems(abstract, rules: Rules, sizes, layers_said=False) -> list[Problem]:
    """Parameters (and optimizer state) the rules cannot lay out on a mesh of `sizes`; with
    `layers_said`, not the stacked layers' split over pipe (the pipeline's line names it)."""
    if abstract is None:
        return []
    _, state = abstract
    if layers_said:
        unsplit = {"layers": None}
        rules = dataclasses.replace(
            rules,
            params={**rules.params, **unsplit},
            optimizer=None if rules.optimizer is None else {**rules.optimizer, **unsplit},
        )
    problems = state_problems(state, rules.params, sizes, strategy=rules.name)
    if rules.optimizer is not None:
        problems += state_problems(state, rules.optimizer, sizes, strategy=rules.name)
    return list(dict.fromkeys(problems))  # the optimizer's table often repeats the parameters'


def _pipeline_problems(model, abstract, pipeline, sizes, spec, ways, axes, k) -> list[Problem]:
    """What keeps the model from being pipelined over ``pipe`` stages."""
    pipe = sizes[PIPE]
    layers = getattr(model, "pipeline_layers", None)
    if abstract is not None:
        module = nnx.merge(*abstract)
        parts = pipeline_parts(module)
        if parts is None:
            return [
                Problem(
                    "mesh.pipe",
                    pipe,
                    "this model cannot be pipelined: it has no pipeline_parts() method (see "
                    "meshtrain.models.PipelineParts); set pipe=1",
                )
            ]
        if spec.packed and not parts.packed:
            return [
                Problem(
                    "data.packing",
                    True,
                    f"model {type(module).__name__}'s pipeline_parts() takes no packed batches "
                    "(PipelineParts.packed=False); give its embed and run_blocks the segment ids "
                    "and positions, set pipe=1, or train on plain windows (--data.no-packing)",
                )
            ]
        leaves = nnx.to_flat_state(nnx.state(getattr(module, parts.blocks)))
        layers = leaves[0][1].get_value().shape[0] if leaves else layers
    elif model is not None and layers is None:
        return [
            Problem(
                "mesh.pipe",
                pipe,
                f"model {type(model).__name__} cannot be pipelined (it has no stacked layers "
                "to cut into stages); set pipe=1",
            )
        ]
    return pipeline_problems(
        pipeline,
        pipe=pipe,
        batch_size=spec.batch_size // k,
        batch_ways=ways,
        batch_axes=axes,
        layers=layers,
        layers_field=_layers_field(model),
        accum_steps=k,
    )


def _layers_field(model) -> str:
    """The config field of the model's stacked layers (``gpt.n_layers``), or ``layers``."""
    if model is None or not hasattr(model, "n_layers"):
        return "layers"
    return f"{model_name(model)}.n_layers"


def offload_problems(run: RunSpec) -> list[Problem]:
    """Host offload (the optimizer state, or a remat policy's residuals) on a backend without
    the host memory it needs, as one `Problem`."""
    from jax.sharding import Mesh

    from meshtrain.layout.memory import HOST
    from meshtrain.models.remat import offloads
    from meshtrain.offload import config as offload_config

    devices = list(run.mesh.devices.flat) if isinstance(run.mesh, Mesh) else None
    problems = run.offload.backend_problems(devices)
    remat = getattr(run.model_config, "remat", "none")
    if offloads(remat) and HOST not in offload_config.memory_kinds(devices):
        message = (
            f"this backend has no {HOST} memory to offload residuals to; choose a policy "
            "that keeps them on the device (save-dots, save:NAME,...)"
        )
        problems.append(Problem(f"{model_name(run.model_config)}.remat", remat, message))
    return problems
