"""Ahead-of-time compiling the real train step, allocating nothing.

The step is the one the `Trainer` runs (`jit_train_step` with the same optimizer, loss,
accumulation and pipeline), lowered on abstract state and batch (`jax.ShapeDtypeStruct`s that
carry the shardings) and compiled; no parameter is created and no step runs. XLA's warnings
printed from C++ while compiling (its "Involuntary full rematerialization" fallback) are
captured from file descriptor 2 and returned with the program.

By default the backend's code generation runs unoptimised (``xla_backend_optimization_level
= 0``): what the inspector reads (the partitioned HLO, its collectives, the buffer assignment
behind `memory_analysis`) is fixed before LLVM runs, and this halves the compile time on a
CPU (checked: identical collectives and temporary bytes on a 2×2×2 GPT). Pass
``fast_codegen=False`` for a program worth running.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from meshtrain.layout import Rules, batch_shardings
from meshtrain.models.base import DataSpec, batch_structs
from meshtrain.pipeline import PipelineConfig
from meshtrain.replicas import SyncConfig, with_sync
from meshtrain.state import TrainState, abstract_model, abstract_target, state_layout
from meshtrain.train.loss import cross_entropy_with
from meshtrain.train.optim import OptimConfig, make_optimizer, make_schedule
from meshtrain.train.step import jit_train_step

FAST_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@contextlib.contextmanager
def captured_stderr():
    """Collects what C++ code writes to file descriptor 2 (and sys.stderr) meanwhile.

    Yields a list that holds the captured text once the block ends.
    """
    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            out.append(text)
            if text and "Involuntary full rematerialization" not in text:
                sys.stderr.write(text)  # pass anything else on


def compile_step(
    ctor: Callable[[], nnx.Module],
    spec: DataSpec,
    mesh: Mesh,
    rules: Rules,
    *,
    optim: OptimConfig | None = None,
    pipeline: PipelineConfig | None = None,
    accum_steps: int = 1,
    loss_impl: str = "xla",
    steps: int = 100,
    fast_codegen: bool = True,
    sync: SyncConfig | None = None,
):
    """Compiles the train step of a model on `mesh` without allocating its state.

    Args:
        ctor: zero-argument model constructor (traced abstractly only).
        spec: the data's shape (`DataSpec`).
        mesh: the device mesh (real devices: the program is compiled for them).
        rules: the layout rules.
        optim: optimizer settings (default `OptimConfig()`).
        pipeline: pipeline settings, used where ``pipe > 1``.
        accum_steps: gradient-accumulation microbatches.
        loss_impl: the cross-entropy implementation.
        steps: the run length the schedule is built for.
        fast_codegen: skip the backend's LLVM optimisations (see the module docstring).
        sync: how the replicas synchronise (`meshtrain.replicas.SyncConfig`).

    Returns:
        ``(compiled, info)``: the compiled step and a dict with ``compile_s``, ``stderr`` (what
        XLA printed while compiling) and ``state`` (the abstract `TrainState`).
    """
    optim = optim or OptimConfig()
    tx, schedule = make_optimizer(optim, steps), make_schedule(optim, steps)
    graphdef, abstract = abstract_model(ctor)
    graphdef, param_vars, rest_vars = nnx.split(nnx.merge(graphdef, abstract), nnx.Param, ...)
    params, rest, opt_state, shardings = state_layout(param_vars, rest_vars, tx, mesh, rules)
    shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt_state, rest)
    state, shardings = with_sync(
        sync, tx, abstract_target(shapes, shardings), shardings, mesh, rules
    )
    batch = batch_structs(spec)
    batch_sh = batch_shardings(batch, mesh, rules)
    batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sh[k]) for k, v in batch.items()
    }
    step = jit_train_step(
        graphdef,
        tx,
        mesh,
        rules,
        shardings,
        batch_sh,
        accum_steps=accum_steps,
        loss_fn=cross_entropy_with(loss_impl),
        schedule=schedule,
        pipeline=pipeline,
        sync=sync,
    )
    t0 = time.perf_counter()
    with captured_stderr() as err:
        compiled = step.lower(state, batch).compile(FAST_CODEGEN if fast_codegen else None)
    info = {"compile_s": time.perf_counter() - t0, "stderr": err[0], "state": state}
    return compiled, info
