"""Checkpoints: asynchronous, atomic orbax saves, and restores onto any mesh, with fallback.

A checkpoint directory holds one sub-directory per saved step (``<dir>/<step>/``), each with
three items:

- ``state``: the `TrainState` (step, parameters, optimizer state, other model variables);
- ``data``: the training data iterator's position (JSON);
- ``meta``: the full run config, the mesh it was written from, the seed (JSON).

Orbax writes each step into a temporary directory and renames it when complete, so a step
exists only once fully written; leftovers of an interrupted save are removed when a manager
opens the directory for writing. Restoring reads every array straight into the layout of an
abstract target (`jax.ShapeDtypeStruct` with the new `NamedSharding`), on any mesh and any
device count, never through one host's full copy. A step that cannot be read is reported and
skipped for the previous one; it is never deleted or overwritten (see `set_aside`).
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint import checkpoint_managers as policies

from meshtrain.sharding import Rules, abstract_model, named, state_specs
from meshtrain.train.step import TrainState

ITEMS = ("state", "data", "meta")
UNREADABLE_SUFFIX = ".unreadable"


class _Mismatch(ValueError):
    """The saved layout does not fit the target."""


class CheckpointWarning(UserWarning):
    """A checkpoint step could not be read and was skipped."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When and where checkpoints are written, and whether a run resumes from one.

    Args:
        checkpoint_dir: directory of the checkpoints; empty: ``<run_dir>/checkpoints``.
        save_every: save every this many steps (0: only at the end, and on SIGTERM/SIGINT).
        keep_last: keep the newest this many checkpoints; older ones are deleted.
        keep_every: also keep every checkpoint whose step is a multiple of this (0: none).
        async_save: write in the background while training continues.
        resume: continue from the newest readable checkpoint in the directory (a fresh start
            when there is none).
    """

    checkpoint_dir: str = ""
    save_every: int = 100
    keep_last: int = 3
    keep_every: int = 0
    async_save: bool = True
    resume: bool = False

    def __post_init__(self):
        for name, low in (("save_every", 0), ("keep_last", 1), ("keep_every", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"checkpoint {name}={value!r}: must be an integer ≥ {low}")


class Restored(NamedTuple):
    """What `CheckpointManager.restore` read."""

    step: int
    state: TrainState
    data: dict | None  # the data iterator's position
    meta: dict  # config, mesh, seed


def abstract_target(like: TrainState, shardings: TrainState) -> TrainState:
    """`like`'s shapes and dtypes with `shardings` attached: the layout a restore produces.

    Args:
        like: a state, or any pytree of arrays / `ShapeDtypeStruct`s of the same structure.
        shardings: the target `NamedSharding`s (e.g. from `init_train_state` on the new mesh).

    Returns:
        A `TrainState` of `jax.ShapeDtypeStruct`s.
    """
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like, shardings
    )


def abstract_train_state(
    ctor: Callable[[], nnx.Module], tx: optax.GradientTransformation, mesh: Mesh, rules: Rules
) -> TrainState:
    """The state `init_train_state` would build on `mesh`, as sharded shape structs.

    Nothing is allocated or compiled: this is the target for restoring a checkpoint onto a
    new mesh without first initialising a model there.

    Args:
        ctor: zero-argument model constructor.
        tx: the optax transformation.
        mesh: the target mesh.
        rules: the target logical-axis rules.

    Returns:
        A `TrainState` of `jax.ShapeDtypeStruct`s carrying `NamedSharding`s.
    """
    graphdef, state = abstract_model(ctor)
    _, param_vars, rest_vars = nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)
    param_sh = named(state_specs(param_vars, rules.params, mesh, warn=False), mesh)
    rest_sh = named(state_specs(rest_vars, rules.params, mesh, warn=False), mesh)
    opt_param_specs = state_specs(param_vars, rules.optimizer_table, mesh, warn=False)
    params, rest = nnx.to_pure_dict(param_vars), nnx.to_pure_dict(rest_vars)
    opt_state = jax.eval_shape(tx.init, params)
    opt_specs = optax.tree_map_params(
        tx,
        lambda _, spec: spec,
        opt_state,
        opt_param_specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
    replicated = NamedSharding(mesh, P())
    shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt_state, rest)
    shardings = TrainState(replicated, param_sh, named(opt_specs, mesh), rest_sh)
    return abstract_target(shapes, shardings)


def mesh_meta(mesh: jax.sharding.Mesh) -> dict:
    """The facts about a mesh a checkpoint records: axis sizes, device count, platform."""
    sizes = dict(zip(mesh.axis_names, (int(n) for n in mesh.devices.shape), strict=True))
    platform = mesh.devices.flat[0].platform
    return {"axes": sizes, "devices": int(mesh.devices.size), "platform": platform}


def _short(error: BaseException) -> str:
    """An exception as one short line."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:240]}{'…' if len(text) > 240 else ''}"


def _path(keys) -> str:
    """A pytree path as ``a/b/0/c``, the same whether a level is a dict, list or NamedTuple."""
    parts = []
    for k in keys:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _layout_mismatch(saved: Any, target: TrainState) -> str | None:
    """Compares the saved tree's paths, shapes and dtypes with the target's; None if they fit."""
    saved_leaves = {
        _path(p): (tuple(m.shape), str(m.dtype))
        for p, m in jax.tree_util.tree_leaves_with_path(saved)
    }
    want = {
        _path(p): (tuple(x.shape), str(x.dtype))
        for p, x in jax.tree_util.tree_leaves_with_path(target._asdict())
    }
    problems = [f"{k} missing from the checkpoint" for k in want if k not in saved_leaves]
    problems += [f"{k} not in the model" for k in saved_leaves if k not in want]
    problems += [
        f"{k} is {saved_leaves[k][1]}{list(saved_leaves[k][0])} in the checkpoint, "
        f"{want[k][1]}{list(want[k][0])} in the model"
        for k in want
        if k in saved_leaves and saved_leaves[k] != want[k]
    ]
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return "the model does not match: " + "; ".join(problems[:3]) + more


class CheckpointManager:
    """Saves and restores train states in one directory (a thin layer over orbax's manager).

    Args:
        directory: the checkpoint directory (created on the first save).
        config: save / keep / async settings; ``config.checkpoint_dir`` is ignored here.
        read_only: open for restoring only: nothing is created, cleaned or deleted.
    """

    def __init__(
        self, directory: str | Path, config: CheckpointConfig | None = None, *, read_only=False
    ):
        self.config = config or CheckpointConfig()
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        keep = [policies.LatestN(self.config.keep_last)]
        if self.config.keep_every:
            keep.append(policies.EveryNSteps(self.config.keep_every))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=None if read_only else policies.AnyPreservationPolicy(keep),
            enable_async_checkpointing=self.config.async_save,
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "data": ocp.JsonCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        }
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        # Orbax removes the leftovers of interrupted saves in the background; finish that now
        # so the directory is clean once the manager is open (a private hook, hence getattr).
        finish_cleanup = getattr(self._mgr, "_maybe_await_cleanup_tmp_directory", None)
        if finish_cleanup is not None and not read_only:
            finish_cleanup()

    def steps(self) -> list[int]:
        """The committed steps, oldest first."""
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> Path:
        """The directory of step `step`."""
        return self.directory / str(step)

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        data: Mapping | None = None,
        meta: Mapping | None = None,
        wait: bool = False,
    ) -> Path:
        """Writes `state` (and the data position and metadata) as step `step`.

        With ``async_save`` this returns once the arrays are copied off the devices; the
        files are written in the background and the step appears when complete.

        Args:
            step: the step number (the directory name).
            state: the train state.
            data: the data iterator position (`BatchIterator.get_state`).
            meta: JSON-serialisable facts: config, mesh, seed.
            wait: block until this step is committed to disk.

        Returns:
            The step's directory (present once committed).
        """
        if self.read_only:
            raise ValueError(f"checkpoint directory {self.directory} was opened read-only")
        if step in self._mgr.all_steps():
            raise ValueError(
                f"checkpoint step {step} already exists in {self.directory}; refusing to "
                "overwrite it"
            )
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state._asdict()),
            data=ocp.args.JsonSave(dict(data or {})),
            meta=ocp.args.JsonSave({"step": int(step), **(meta or {})}),
        )
        self._mgr.save(step, args=args, force=True)
        if wait:
            self._mgr.wait_until_finished()
        return self.path(step)

    def restore(
        self, target: TrainState, step: int | None = None, *, quiet: bool = False
    ) -> Restored | None:
        """Reads a step into the layout of `target`, falling back past unreadable steps.

        Args:
            target: abstract state (`abstract_target`) carrying the new shardings.
            step: the step to read; None: the newest readable one, trying older steps when a
                newer one is truncated, incomplete or does not match the model (each skip
                is reported with a `CheckpointWarning`; nothing is deleted).
            quiet: no warnings (the reasons are still in the error when nothing is readable).

        Returns:
            The `Restored` step, or None when the directory holds no checkpoint.

        Raises:
            ValueError: `step` (or, with step None, every step) cannot be read; the message
                gives each reason.
        """
        self.wait()
        steps = self.steps()
        if step is not None and step not in steps:
            raise ValueError(
                f"checkpoint step {step} not found in {self.directory}; it holds {steps or 'none'}"
            )
        candidates = [step] if step is not None else steps[::-1]
        failures = []
        for s in candidates:
            try:
                return self._read(s, target)
            except Exception as e:  # any read failure: report and try the previous step
                failures.append((s, e if isinstance(e, _Mismatch) else _short(e)))
                if step is None and not quiet:
                    older = [c for c in candidates if c < s]
                    then = f"falling back to step {older[0]}" if older else "no older step left"
                    warnings.warn(
                        f"checkpoint {self.path(s)} cannot be read ({failures[-1][1]}); {then}. "
                        "Nothing was deleted.",
                        CheckpointWarning,
                        stacklevel=2,
                    )
        if not candidates:
            return None
        reasons = "; ".join(f"step {s}: {why}" for s, why in failures)
        raise ValueError(f"no readable checkpoint in {self.directory}: {reasons}")

    def _read(self, step: int, target: TrainState) -> Restored:
        """Checks the saved layout against `target`, then reads step `step` into it."""
        saved = self._mgr.item_metadata(step)["state"]
        if saved is None:
            raise _Mismatch("the 'state' item is missing")
        problem = _layout_mismatch(getattr(saved, "tree", saved), target)
        if problem:
            raise _Mismatch(problem)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(target._asdict()),
            data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore(),
        )
        out = self._mgr.restore(step, args=args)
        return Restored(step, TrainState(**out["state"]), out["data"] or None, out["meta"])

    def set_aside(self, steps: list[int]) -> list[Path]:
        """Renames unreadable steps to ``<step>.unreadable`` so that new saves neither
        overwrite nor garbage-collect them; returns their new paths."""
        moved = []
        if jax.process_index() == 0:
            for s in steps:
                src = self.path(s)
                dst = src.with_name(src.name + UNREADABLE_SUFFIX)
                n = 1
                while dst.exists():
                    dst, n = src.with_name(f"{src.name}{UNREADABLE_SUFFIX}-{n}"), n + 1
                src.rename(dst)
                moved.append(dst)
        self._mgr.reload()
        return moved

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are committed."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        self._mgr.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def restore(directory: str | Path, target: TrainState, step: int | None = None) -> Restored:
    """Reads a checkpoint from `directory` onto the layout of `target`, changing nothing there.

    Args:
        directory: a checkpoint directory written by `CheckpointManager` (or the Trainer).
        target: abstract state carrying the new shardings (see `abstract_target`).
        step: the step to read; None: the newest readable one.

    Returns:
        The `Restored` step.
    """
    with CheckpointManager(directory, read_only=True) as mgr:
        restored = mgr.restore(target, step)
    if restored is None:
        raise ValueError(f"no checkpoint found in {Path(directory).absolute()}")
    return restored


def open_for_run(config: CheckpointConfig | None, run_dir: str) -> CheckpointManager | None:
    """Opens a run's checkpoint directory for writing, before anything compiles.

    Returns:
        The manager, or None when `config` is None.

    Raises:
        ValueError: no directory is set, or it already holds checkpoints and the run does not
            resume (a fresh run never writes over an earlier one).
    """
    if config is None:
        return None
    directory = config.checkpoint_dir or (str(Path(run_dir) / "checkpoints") if run_dir else "")
    if not directory:
        raise ValueError(
            "checkpoint_dir='' and run_dir='': checkpoints need a directory; set one of them"
        )
    mgr = CheckpointManager(directory, config)
    steps = mgr.steps()
    if steps and not config.resume:
        mgr.close()
        raise ValueError(
            f"checkpoint directory {mgr.directory} already holds steps {steps}; pass "
            "--resume (CheckpointConfig(resume=True)) to continue that run, or choose another "
            "--run-dir / --checkpoint-dir"
        )
    return mgr


def due(config: CheckpointConfig, step: int, end: int) -> bool:
    """True when the periodic schedule saves after step `step` (the final step saves anyway)."""
    return bool(config.save_every) and step % config.save_every == 0 and step < end


def run_meta(trainer: Any, extra: Mapping | None = None) -> dict:
    """The JSON facts a trainer's checkpoint records: configs, mesh, rules, seed."""

    def as_dict(cfg):
        return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None

    model = trainer.model_config
    return {
        "config": {
            "model": {"kind": type(model).__name__, **(as_dict(model) or {})} if model else None,
            "train": as_dict(trainer.config),
            "optim": as_dict(trainer.optim),
            "checkpoint": as_dict(trainer.checkpoints.config) if trainer.checkpoints else None,
            **dict(extra or {}),
        },
        "mesh": mesh_meta(trainer.mesh),
        "rules": trainer.rules.name,
        "rng": {"seed": trainer.config.seed},
    }


class NonFiniteError(RuntimeError):
    """Training stopped: too many consecutive steps had a non-finite loss or gradient."""

    @classmethod
    def after(
        cls, streak: int, step: int, last_good: int, checkpoints: CheckpointManager | None
    ) -> NonFiniteError:
        """The error for `streak` bad steps ending at `step`; names the last good checkpoint."""
        where = "no checkpoints are kept"
        if checkpoints is not None:
            checkpoints.wait()
            good = [s for s in checkpoints.steps() if s <= last_good]
            where = (
                f"last good checkpoint: {checkpoints.path(good[-1])} (step {good[-1]})"
                if good
                else f"no checkpoint at or before step {last_good} in {checkpoints.directory}"
            )
        return cls(
            f"{streak} consecutive steps ({step - streak + 1}–{step}) had a non-finite loss or "
            f"gradient; their updates were skipped and training stopped after step {step}; "
            f"{where}"
        )


class StopSignals:
    """Turns the first SIGTERM/SIGINT into a request to stop after the current step.

    Inside the ``with`` block, the first signal sets `received` (its name); a second one
    exits the process at once with status 128 + signal number. Outside the main thread
    (where Python cannot install handlers) it does nothing.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        """Records the first signal; a second one exits immediately."""
        if self.received is not None:
            print(f"meshtrain: second {signal.Signals(signum).name}: exiting now", flush=True)
            import os

            os._exit(128 + signum)
        self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
