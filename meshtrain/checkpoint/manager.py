"""`CheckpointManager`: asynchronous atomic orbax saves, restores with fallback past bad steps."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from meshtrain import validate
from meshtrain._compat import orbax_finish_tmp_cleanup, orbax_state_handler_without_replica_slices
from meshtrain.checkpoint import integrity
from meshtrain.checkpoint.integrity import ChangedBytes
from meshtrain.checkpoint.targets import layout_mismatch
from meshtrain.problem import Problem
from meshtrain.state import TrainState

UNREADABLE_SUFFIX = ".unreadable"


class _Mismatch(ValueError):
    """The saved layout does not fit the target: another model wrote it, not a damaged save."""


class CheckpointWarning(UserWarning):
    """A checkpoint step could not be read and was skipped."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig(validate.Checked):
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

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        v = validate
        return (
            v.non_negative("save_every", self.save_every, example=100, note="0: only at the end")
            + v.positive("keep_last", self.keep_last, example=3)
            + v.non_negative("keep_every", self.keep_every, example=1000, note="0: none")
        )


class Restored(NamedTuple):
    """What `CheckpointManager.restore` read."""

    step: int
    state: TrainState
    data: dict | None  # the data iterator's position
    meta: dict  # config, mesh, seed


def _barrier(name: str) -> None:
    """Waits until every process of a multi-process job reaches `name` (no-op in one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _short(error: BaseException) -> str:
    """An exception as one short line (changed bytes without the exception's name)."""
    text = " ".join(str(error).split())
    kind = "" if isinstance(error, ChangedBytes) else f"{type(error).__name__}: "
    return f"{kind}{text[:240]}{'…' if len(text) > 240 else ''}"


class CheckpointManager:
    """Saves and restores train states in one directory (a thin layer over orbax's manager).

    In a multi-process job every process opens the same directory and makes the same calls
    (save, restore, wait, set_aside, close): each writes its own shards, process 0 alone the
    JSON items and the step's commit, and a checkpoint restores on any process count.

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
            "state": orbax_state_handler_without_replica_slices(),
            "data": ocp.JsonCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
            "digests": ocp.JsonCheckpointHandler(),
        }
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        # Orbax removes the leftovers of interrupted saves in the background; finish that now
        # so the directory is clean once the manager is open.
        if not read_only:
            orbax_finish_tmp_cleanup(self._mgr)

    def steps(self) -> list[int]:
        """The committed steps, oldest first."""
        return sorted(self._mgr.all_steps())

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
        items, data, meta = _items(state), dict(data or {}), {"step": int(step), **(meta or {})}
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(items),
            data=ocp.args.JsonSave(data),
            meta=ocp.args.JsonSave(meta),
            digests=ocp.args.JsonSave(integrity.record(items, data, meta)),
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
            target: abstract state (`meshtrain.state.abstract_target`) carrying the new shardings.
            step: the step to read; None: the newest readable one, trying older steps when a
                newer one is truncated, incomplete or its bytes differ from the digests taken
                at save (each skip is reported with a `CheckpointWarning`; nothing is deleted).
            quiet: no warnings (the reasons are still in the error when nothing is readable).

        Returns:
            The `Restored` step, or None when the directory holds no checkpoint.

        Raises:
            ValueError: `step` (or, with step None, every step) cannot be read; the message
                gives each reason. Or the step was written by another model (its arrays'
                names or shapes differ from `target`'s): a one-line error, no warning and no
                fallback, since the step is not damaged and older steps are the same model's.
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
            except _Mismatch as e:
                raise ValueError(
                    f"checkpoint {self.path(s)} was written with {e}; resume with the same model "
                    "and optimizer settings as that run, or start afresh with another --run-dir "
                    "/ --checkpoint-dir"
                ) from None
            except Exception as e:  # any read failure: report and try the previous step
                failures.append((s, _short(e)))
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
        """Checks the saved layout against `target`, reads step `step` into it, and checks the
        bytes read against the step's digests (a step saved without them is not checked)."""
        items = self._mgr.item_metadata(step)
        record = self._record(step) if "digests" in items else None
        written = getattr(self._mgr.metadata(step), "item_handlers", None) or {}
        if record is None and "digests" in written:
            raise ChangedBytes("its digests item is missing, though the step was saved with one")
        saved = items["state"]
        if saved is None:
            raise ValueError("the 'state' item is missing")
        problem = layout_mismatch(getattr(saved, "tree", saved), target)
        if problem and record is not None and record.layout == integrity.layout(target._asdict()):
            raise ChangedBytes(
                f"its bytes changed: orbax's metadata of its state describes {problem}, but "
                "its digests record this model's arrays"
            )
        if problem:
            raise _Mismatch(problem)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(_items(target)),
            data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore(),
        )
        out = self._mgr.restore(step, args=args)
        if record is not None:
            record.check(out["state"], out["data"], out["meta"])
        return Restored(step, TrainState(**out["state"]), out["data"] or None, out["meta"])

    def _record(self, step: int) -> integrity.Record:
        """The parsed ``digests`` item of step `step`."""
        out = self._mgr.restore(step, args=ocp.args.Composite(digests=ocp.args.JsonRestore()))
        return integrity.Record(out["digests"])

    def set_aside(self, steps: list[int]) -> list[Path]:
        """Renames unreadable steps to ``<step>.unreadable`` so that new saves neither
        overwrite nor garbage-collect them; returns their new paths.

        In a multi-process job every process calls it: process 0 renames (and alone gets the
        paths back), and no process reloads the step list before the renames are done.
        """
        moved = []
        _barrier("meshtrain: checkpoint set_aside begins")  # every process is done reading
        if jax.process_index() == 0:
            for s in steps:
                src = self.path(s)
                dst = src.with_name(src.name + UNREADABLE_SUFFIX)
                n = 1
                while dst.exists():
                    dst, n = src.with_name(f"{src.name}{UNREADABLE_SUFFIX}-{n}"), n + 1
                src.rename(dst)
                moved.append(dst)
        _barrier("meshtrain: checkpoint set_aside done")  # the renames are visible to all
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


def _items(state: TrainState) -> dict:
    """The state as the checkpoint stores it: its fields, without an empty ``comm`` (so runs
    that keep no synchronisation state write, and read, the same tree as before it existed)."""
    items = state._asdict()
    if not jax.tree.leaves(items["comm"]):
        del items["comm"]
    return items
