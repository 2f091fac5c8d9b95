"""Helpers shared by several test files (jax is imported lazily: conftest.py reads
`FAST_COMPILE` before jax initialises)."""

import contextlib
import json
import os
import pathlib
import subprocess
import sys

import _cache_guard

# Compiling dominates the suite (tiny models, few steps); LLVM's -O0 for XLA's CPU code roughly
# halves each compile. It changes neither the HLO nor its partitioning, only how fast the
# generated loops run. The last flag keeps XLA's CPU scheduler from reordering for concurrency,
# without which jaxlib 0.12 crashes running collectives read back from the compilation cache
# (`_cache_guard`, which writes no program with collectives compiled without it).
FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
    + _cache_guard.SCHEDULER_OFF
)
# The tiny GPT's ``meshtrain train`` job on synthetic tokens: nothing held out, no samples, no
# progress bar (the caller adds the mesh, the steps and where it saves).
TINY_JOB = [
    "--gpt.d-model", "32", "--gpt.n-layers", "2", "--gpt.max-seq-len", "16",
    "--data.source", "synthetic", "--data.seq-len", "16", "--data.batch-size", "8",
    "--data.val-fraction", "0", "--sample-tokens", "0", "--no-progress",
]  # fmt: skip
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_INITIAL: dict = {}


@contextlib.contextmanager
def count_compiles():
    """Counts XLA backend compiles inside the block; yields a list whose length is the count."""
    import jax

    seen = []

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            seen.append(kwargs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def fresh_env(devices: int | None = None) -> dict[str, str]:
    """The environment of a fresh Python process (a CLI run, a notebook kernel, a benchmark) as
    a user starts one: this process's variables on the CPU platform, and ``XLA_FLAGS`` with no
    device count (the process simulates its own devices; `devices` sets one for a script that
    expects it from the user), only the cheap compiles of `FAST_COMPILE`."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    count = f"--xla_force_host_platform_device_count={devices} " if devices else ""
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": count + FAST_COMPILE}


def load_benchmark(name: str):
    """The module of ``benchmarks/NAME.py``, imported from its file as its own tests use it
    (the benchmarks are scripts, not a package): registered under `name` (its dataclasses look
    their module up there), with the benchmarks' folder importable while it loads (its
    `_common`)."""
    import importlib.util

    folder = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(folder))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    return module


def fit_briefly(model, data, mesh, strategy: str, steps: int, pipeline=None, **train):
    """`steps` steps of AdamW (lr 1e-2, no warmup) through `meshtrain.Trainer`, nothing
    evaluated, saved or shown (`train`: more `TrainConfig` fields); the losses and the final
    parameters on the host."""
    import jax
    import numpy as np

    import meshtrain as mt

    quiet = {"run_dir": "", "progress": False, "eval_every": 0, "log_every": 1}
    run = mt.RunSpec(
        model=model,
        data=data,
        mesh=mesh,
        rules=mt.rules_for(strategy, mesh),
        optim=mt.OptimConfig(lr=1e-2, warmup_steps=0),
        train=mt.TrainConfig(steps=steps, **quiet, **train),
        pipeline=pipeline or mt.PipelineConfig(),
    )
    trainer = mt.Trainer(run=run)
    losses = [e["loss"] for e in trainer.fit()]
    return losses, jax.tree.map(np.asarray, jax.device_get(trainer.state.params))


def one_json_line(script, *args, devices: int | None = None, timeout: int = 300) -> dict:
    """Runs a benchmark script (a path, or ``-m module``'s words) with `args` in a fresh process
    from the repository root, as a user would, and returns the one JSON line it prints; the
    test fails on a non-zero exit or any other line on stdout."""
    command = [sys.executable, *([str(script)] if isinstance(script, pathlib.Path) else script)]
    proc = subprocess.run(
        [*command, *args],
        cwd=pathlib.Path(__file__).resolve().parents[1],
        env=fresh_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stdout, got {proc.stdout!r}"
    return json.loads(lines[0])


def token_batches(n: int, vocab: int, rows: int, length: int, seed: int = 0) -> list[dict]:
    """`n` batches of random next-token examples: ``rows`` × ``length`` inputs and their
    targets (the same tokens one on), drawn from one generator seeded `seed`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, vocab, (rows, length + 1), np.int32)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def packed_layout(rng, rows: int, seq: int, *, longest: int | None = None, pad: bool = True):
    """Random ``(segment_ids, positions)`` [rows, seq] int32 of packed rows: documents of 1 to
    `longest` tokens (default ``seq // 3 - 1``: at least three a row), then (with `pad`) some
    padding, segment 0."""
    import numpy as np

    longest = longest or seq // 3 - 1
    seg = np.zeros((rows, seq), np.int32)
    pos = np.zeros((rows, seq), np.int32)
    for r in range(rows):
        end = seq - int(rng.integers(1, seq // 4)) if pad else seq
        start, doc = 0, 1
        while start < end:
            n = min(int(rng.integers(1, longest + 1)), end - start)
            seg[r, start : start + n], pos[r, start : start + n] = doc, np.arange(n)
            start, doc = start + n, doc + 1
    return seg, pos


def copied(state):
    """A copy of `state` on its own buffers, with the same shardings: for a step that donates
    its input, so that a state built once can start several runs."""
    import jax

    return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), state)


def initial_values(cfg) -> dict:
    """A model config's initial values on the host, as a pure dict (built once per config and
    shared, so every layout and run of a test starts from the same numbers)."""
    if cfg not in _INITIAL:
        import jax
        import numpy as np
        from flax import nnx

        from meshtrain.models import build_model

        state = jax.jit(lambda: nnx.to_pure_dict(nnx.state(build_model(cfg))))()
        _INITIAL[cfg] = jax.tree.map(np.asarray, state)
    return _INITIAL[cfg]


def model_from(cfg, values):
    """A constructor of `cfg`'s model whose variables are `values` (host arrays, a pure dict
    as `initial_values` gives): no random initialiser runs under the layout that calls it."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from meshtrain.models import build_model

    def ctor():
        graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, values))
        return nnx.merge(graphdef, state)

    return ctor


def state_and_step(ctor, tx, mesh, rules, example, params=None, **step_kw):
    """The train state of `ctor`'s model laid out on `mesh` (`params`: its initial values, as
    `init_train_state` takes them) and its jitted step under a plain run spec, built for
    batches shaped as `example` (``step_kw``: `jit_train_step`'s keywords, the schedule).

    Returns:
        ``(graphdef, state, shardings, step)``; the step takes batches already sharded.
    """
    from meshtrain.layout import batch_shardings
    from meshtrain.lower import init_train_state, jit_train_step
    from meshtrain.run import RunSpec

    graphdef, state, shardings = init_train_state(ctor, tx, mesh, rules, params)
    batch_sh = batch_shardings(example, mesh, rules)
    step = jit_train_step(
        RunSpec(mesh=mesh, rules=rules), graphdef, tx, shardings, batch_sh, **step_kw
    )
    return graphdef, state, shardings, step


def losses_and_params(step, state, batches, mesh, rules):
    """Runs `step` over the host `batches` (sharded one by one): the losses, the final host
    parameters and the final state."""
    import jax
    import numpy as np

    from meshtrain.layout import shard_batch

    losses = []
    for batch in batches:
        state, metrics = step(state, shard_batch(batch, mesh, rules))
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.tree.map(np.asarray, state.params), state


def params_history(step, state, batches, mesh, rules):
    """Runs `step` over the host `batches`, none of them skipped: the host parameters before
    the first and after each step, and the final state."""
    import jax

    from meshtrain.layout import shard_batch

    history = [jax.device_get(state.params)]
    for b in batches:
        state, metrics = step(state, shard_batch(b, mesh, rules))
        assert int(metrics["skipped"]) == 0
        history.append(jax.device_get(state.params))
    return history, state
