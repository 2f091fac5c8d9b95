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

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.layout import batch_shardings
from meshtrain.models.base import batch_structs
from meshtrain.offload import transfer_bytes, with_offload
from meshtrain.optim import make_schedule
from meshtrain.replicas import with_sync
from meshtrain.run import RunSpec
from meshtrain.state import TrainState, abstract_model, abstract_target, state_layout
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


def compile_step(run: RunSpec, *, fast_codegen: bool = True):
    """Compiles the train step of a run without allocating its state.

    Args:
        run: the run (`RunSpec`); its mesh must be a `Mesh` of real devices (the program is
            compiled for them); its model is traced abstractly only.
        fast_codegen: skip the backend's LLVM optimisations (see the module docstring).

    Returns:
        ``(compiled, info)``: the compiled step and a dict with ``compile_s``, ``stderr`` (what
        XLA printed while compiling), ``state`` (the abstract `TrainState`) and ``transfers``
        (host↔device bytes per device per step of offloaded activations,
        `meshtrain.offload.transfer_bytes`).
    """
    step, state, batch = step_parts(run)
    t0 = time.perf_counter()
    with captured_stderr() as err:
        traced = step.trace(state, batch)
        compiled = traced.lower().compile(FAST_CODEGEN if fast_codegen else None)
    info = {"compile_s": time.perf_counter() - t0, "stderr": err[0], "state": state}
    info["transfers"] = transfer_bytes(traced.jaxpr, run.resolved().mesh.devices.size)
    return compiled, info


def step_parts(run: RunSpec):
    """``(jitted step, abstract state, abstract batch)`` of a run: what `compile_step` traces
    (also to lower it for another platform)."""
    run = run.resolved()
    mesh, rules, steps = run.mesh, run.rules, run.train.steps
    tx, schedule = run.optimizer(steps), make_schedule(run.optim, steps)
    ctor, _ = run.constructor()
    graphdef, abstract = abstract_model(ctor)
    graphdef, param_vars, rest_vars = nnx.split(nnx.merge(graphdef, abstract), nnx.Param, ...)
    params, rest, opt_state, shardings = state_layout(param_vars, rest_vars, tx, mesh, rules)
    shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt_state, rest)
    state, shardings = with_sync(
        run.sync, tx, abstract_target(shapes, shardings), shardings, mesh, rules
    )
    _, shardings = with_offload(run.offload, None, shardings)
    state = abstract_target(state, shardings)
    batch = batch_structs(run.data_spec)
    batch_sh = batch_shardings(batch, mesh, rules)
    batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sh[k]) for k, v in batch.items()
    }
    step = jit_train_step(run, graphdef, tx, shardings, batch_sh, schedule=schedule)
    return step, state, batch
