"""The `Trainer` loop: sharded state, the jitted step, evaluation, metrics one step late."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshtrain import checkpoint as ckpt
from meshtrain import metrics as mx
from meshtrain._log import LOG
from meshtrain.check import check_run
from meshtrain.data import Dataset
from meshtrain.layout import Rules, batch_shardings, process_rows, shard_batch
from meshtrain.models.base import batch_structs
from meshtrain.models.sampling import sample
from meshtrain.offload import host_bytes, with_offload
from meshtrain.optim import make_schedule
from meshtrain.problem import raise_if
from meshtrain.replicas import replicas, with_sync
from meshtrain.run import RunSpec, TrainConfig
from meshtrain.state import abstract_model, abstract_target, init_train_state
from meshtrain.train import events
from meshtrain.train.hooks import NonFiniteError, StopSignals, save_due
from meshtrain.train.step import jit_eval_step, jit_train_step
from meshtrain.train.stopping import AgreedStop
from meshtrain.train.watchdog import Watchdog


def perplexity(loss: float) -> float:
    """exp(`loss`), the perplexity of a mean cross-entropy in nats (inf past float range)."""
    return math.exp(loss) if loss < 700 else math.inf


def _run_of(run: RunSpec | None, simple: dict) -> RunSpec:
    """The `Trainer`'s run: `run`, or one from the simple arguments."""
    given = {k: v for k, v in simple.items() if v is not None}
    if run is not None and given:
        raise TypeError(
            f"Trainer() got run= and {', '.join(given)}; give one: Trainer(run=RunSpec("
            f"{', '.join(f'{k}=...' for k in given)}, ...)) or Trainer(model, data, mesh=..., "
            "rules=...)"
        )
    return run if run is not None else RunSpec(**given)


class Trainer:
    """Trains a model on a mesh: `fit` runs the loop, `evaluate` the held-out loss.

    Args:
        model: a model config (`GPTConfig`, `MLPConfig`, any `meshtrain.models.ModelConfig`),
            or a constructor of any NNX model whose ``__call__(inputs)`` returns logits and
            whose parameters carry logical names: a function of one ``nnx.Rngs`` (such as
            the module class; it gets ``TrainConfig.seed``), or of none.
        data: a `meshtrain.data.Dataset`.
        mesh: the device mesh; None: the default mesh over all devices.
        rules: logical-axis rules, e.g. ``rules_for("fsdp", mesh)``; None:
            ``rules_for("auto", mesh)``.
        run: the whole run (`meshtrain.run.RunSpec`): optimizer, loop, pipeline, sync,
            checkpoints and loss besides the four above. Give either `run` or model, data,
            mesh and rules; both at once is refused.
        flops_per_token: training FLOPs per token (or per example); taken from the model config
            when it has ``flops_per_token``; None leaves TFLOP/s and MFU out.
        run_meta: extra JSON facts stored in every checkpoint (the CLI stores its whole job).
        params: parameters to start from instead of the initialisers' (e.g. a Hugging Face
            checkpoint's, `meshtrain.hf.load_pretrained`); a resumed checkpoint replaces them.

    With ``run.checkpoint`` and its ``resume`` the trainer starts from the newest readable
    checkpoint.

    Once built, it logs the run summary (`RunSpec.summary`, kept as `summary`) at INFO through
    the ``meshtrain`` logger: a notebook shows it, and
    ``logging.getLogger("meshtrain").setLevel(logging.WARNING)`` silences it.

    Raises:
        RunCheckError: the settings cannot work (`meshtrain.check.check_run`); every problem
            is listed, one per line, before anything is allocated or compiled.
        TypeError: `run` together with model, data, mesh or rules.
    """

    def __init__(
        self,
        model=None,
        data: Dataset | None = None,
        *,
        mesh: Mesh | None = None,
        rules: Rules | None = None,
        run: RunSpec | None = None,
        flops_per_token: float | None = None,
        run_meta: dict | None = None,
        params: dict | None = None,
    ):
        run = _run_of(run, dict(model=model, data=data, mesh=mesh, rules=rules))
        self.run = run = run.resolved()
        self.config: TrainConfig = run.train
        self.optim, self.pipeline, self.sync = run.optim, run.pipeline, run.sync
        data, mesh, rules = run.data, run.mesh, run.rules
        self.data, self.mesh, self.rules = data, mesh, rules
        self.model_config = run.model_config
        ctor, problems = run.constructor()
        problems += check_run(run, abstract=abstract_model(ctor))
        raise_if(problems)
        self.loss_fn = run.step_loss
        self.checkpoints = ckpt.open_for_run(run.checkpoint, self.config.run_dir)
        self.stop_reason: str | None = None
        self.skipped_steps = 0
        self._run_meta = run_meta or {}
        if flops_per_token is None and self.model_config is not None:
            flops_per_token = self.model_config.flops_per_token(data.seq_len or 1)
        self.flops_per_token = flops_per_token

        total = self.config.steps
        self.tx = run.optimizer(total)
        self.schedule = make_schedule(self.optim, total)
        self.graphdef, self.state, self.shardings = init_train_state(
            ctor, self.tx, mesh, rules, params
        )
        self.state, self.shardings = with_sync(
            self.sync, self.tx, self.state, self.shardings, mesh, rules
        )
        self.state, self.shardings = with_offload(run.offload, self.state, self.shardings)
        self._rows = process_rows(mesh, rules, data.batch_size)  # this process's batch rows
        clients = replicas(mesh, rules)[1] if data.client_alpha else None  # one per replica
        self._iter = data.train_iter(self._rows, clients=clients)
        self._batch_sharding = batch_shardings(batch_structs(data), mesh, rules)
        self._step = jit_train_step(
            run,
            self.graphdef,
            self.tx,
            self.shardings,
            self._batch_sharding,
            schedule=self.schedule,
        )
        self._eval = jit_eval_step(
            self.graphdef,
            mesh,
            rules,
            self.shardings,
            self._batch_sharding,
            loss_fn=self.loss_fn,
            pipeline=self.pipeline,
            precision=run.precision.matmul_precision,
        )
        self._eval_data = None
        self.history: list[dict] = []
        self._watchdog = Watchdog(1.0, 0.0)  # fit() replaces it with the configured one
        self._reported_first = False
        if run.checkpoint is not None and run.checkpoint.resume:
            self.resume()
        self.summary: list[str] = self._summary()
        for line in self.summary:
            LOG.info(line)

    def _summary(self) -> list[str]:
        """The run summary with what the built state adds: parameters, host bytes."""
        state, shardings = self.state, self.shardings
        n_params = sum(x.size for x in jax.tree.leaves(state.params))
        held = None
        if self.run.offload.active:
            held = host_bytes(state.opt_state, shardings.opt_state)
        return self.run.summary(n_params=n_params, host_bytes=held)

    @property
    def model(self) -> nnx.Module:
        """The model with the current parameters (shares the state's arrays)."""
        return nnx.merge(self.graphdef, self.state.params, self.state.rest)

    @property
    def tokens_per_step(self) -> int:
        """Tokens (LM) or examples (classifier) consumed by one optimizer step."""
        return self.data.batch_size * (self.data.seq_len or 1)

    def meta(self) -> dict:
        """The JSON facts every checkpoint of this run records: configs, mesh, rules, seed."""

        def as_dict(cfg):
            return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None

        model = self.model_config
        return {
            "config": {
                "model": {"kind": type(model).__name__, **as_dict(model)} if model else None,
                "train": as_dict(self.config),
                "optim": as_dict(self.optim),
                "sync": as_dict(self.sync),
                "precision": as_dict(self.run.precision),
                "checkpoint": as_dict(self.checkpoints.config) if self.checkpoints else None,
                **self._run_meta,
            },
            "mesh": ckpt.mesh_meta(self.mesh),
            "rules": self.rules.name,
            "rng": {"seed": self.config.seed},
        }

    def evaluate(self) -> float:
        """Mean loss over the held-out batches."""
        if self._eval_data is None:
            batches = self.data.eval_batches(self.config.eval_batches, self._rows)
            self._eval_data = [shard_batch(b, self.mesh, self.rules) for b in batches]
        losses = [self._eval(self.state, b) for b in self._eval_data]
        return float(np.mean(jax.device_get(losses)))

    def fit(self, until: int | None = None) -> list[dict]:
        """Runs the remaining steps; returns the logged metrics, one dict per logged step.

        Metrics of step i are read after step i+1 is dispatched, so the host never waits for
        the device except to stay one step behind. With checkpoints, the state is saved every
        ``save_every`` steps and at the end. A SIGTERM/SIGINT to any process stops every
        process after one agreed step, which each saves synchronously (`stop_reason` names
        the signal; `meshtrain.train.stopping`); a second one exits at once. A step that does
        not complete within the watchdog's bound ends the process (`meshtrain.train.watchdog`).

        Args:
            until: stop after this step (default: ``config.steps``).

        Raises:
            NonFiniteError: ``max_bad_steps`` consecutive steps had a non-finite loss or
                gradient; the message names the last good checkpoint.
        """
        cfg = self.config
        main = jax.process_index() == 0
        run_dir = Path(cfg.run_dir) if cfg.run_dir and main else None
        dtype = getattr(self.model_config, "dtype", "float32")
        peak = mx.peak_flops_per_device(self.mesh.devices.flat[0], dtype)
        start = int(jax.device_get(self.state.step))
        end = cfg.steps if until is None else min(until, cfg.steps)
        pending = None
        last_ready = None
        self._bad_streak, self._last_good = 0, start
        self.stop_reason = None
        self._reported_first = False
        if main:
            where = str(Path(cfg.run_dir).absolute()) if cfg.run_dir else ""
            saves = str(self.checkpoints.directory) if self.checkpoints else ""
            events.report("start", step=start, run_dir=where, checkpoints=saves)
        with (
            mx.MetricsWriter(run_dir, tensorboard=cfg.tensorboard, append=start > 0) as writer,
            mx.Progress(cfg.steps, enabled=cfg.progress and main) as bar,
            StopSignals() as signals,
            AgreedStop(signals, self.checkpoints) as stop,
            Watchdog(
                cfg.hang_factor,
                cfg.hang_floor_s,
                run_dir=cfg.run_dir,
                rank=jax.process_index(),
                processes=jax.process_count(),
            ) as self._watchdog,
        ):
            for step in range(start, end):
                batch = shard_batch(next(self._iter), self.mesh, self.rules)
                self.state, metrics = self._step(self.state, batch)
                if pending is not None:
                    last_ready = self._record(*pending, last_ready, peak, writer, bar)
                pending = (step + 1, metrics)
                stop_at = stop.poll(step + 1)
                if stop_at is not None and step + 1 >= stop_at:
                    self.stop_reason = stop.reason
                    break
                if self.checkpoints and save_due(self.checkpoints.config.save_every, step + 1, end):
                    # Skipped (non-finite) steps are not saved, so that the keep policy never
                    # pushes the last good checkpoint out during a bad streak.
                    if not (self._bad_streak or int(metrics["skipped"])):
                        self.save()
            if pending is not None:
                self._record(*pending, last_ready, peak, writer, bar, force=True)
            if self.checkpoints:
                self.save(wait=True)
            if self.stop_reason:
                saved = int(jax.device_get(self.state.step))
                events.report("stop", rank=jax.process_index(), step=saved)
        return self.history

    def save(self, *, wait: bool = False) -> Path | None:
        """Checkpoints the current state, data position and `meta` (no-op if already saved).

        Returns:
            The checkpoint's directory, or None without checkpoints.
        """
        if self.checkpoints is None:
            return None
        step = int(jax.device_get(self.state.step))
        if step in self.checkpoints.steps():
            path = self.checkpoints.path(step)
        else:
            path = self.checkpoints.save(
                step, self.state, data=self._iter.get_state(), meta=self.meta(), wait=wait
            )
        if wait:
            self.checkpoints.wait()
        return path

    def resume(self) -> int | None:
        """Restores the newest readable checkpoint onto this trainer's mesh and data position.

        Unreadable newer steps are reported, skipped and set aside (renamed, never deleted).

        Returns:
            The restored step, or None when there is no checkpoint (the state is unchanged).
        """
        if self.checkpoints is None:
            raise ValueError("resume() needs checkpoints: pass checkpoint=CheckpointConfig(...)")
        target = abstract_target(self.state, self.shardings)
        restored = self.checkpoints.restore(target)
        if restored is None:
            return None
        newer = [s for s in self.checkpoints.steps() if s > restored.step]
        if newer:
            self.checkpoints.set_aside(newer)
        self.state = restored.state
        if restored.data:
            self._iter.set_state(restored.data)
        return restored.step

    def _record(self, step, metrics, last_ready, peak, writer, bar, force=False):
        """Reads step `step`'s metrics (blocking on it), times it, logs and evaluates.

        Returns:
            The time step `step` was seen done, the start of the next step's timing; None
            after an evaluation.
        """
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        cfg = self.config
        self._count_skipped(step, values)
        if last_ready is not None:
            rate = mx.step_rate(
                step_time=now - last_ready,
                tokens_per_step=self.tokens_per_step,
                flops_per_step=(self.flops_per_token or 0.0) * self.tokens_per_step,
                n_devices=self.mesh.devices.size,
                peak_flops=peak,
            )
            values.update(step_time=rate.step_time, tokens_per_s=rate.tokens_per_s)
            if self.flops_per_token:
                values.update(tflops_per_device=rate.tflops_per_device, mfu=rate.mfu)
        eval_now = step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)
        dog = self._watchdog
        dog.step_done(step)
        if not self._reported_first and jax.process_index() == 0:
            events.report("first_step", step=step)
        self._reported_first = True
        if eval_now and self.data.num_val:
            with dog.suspended() if self._eval_data is None else contextlib.nullcontext():
                values["eval_loss"] = self.evaluate()  # the first one compiles: not timed
            dog.step_done(step, timed=False)
            held_out = {"loss": values["eval_loss"]}
            if self.data.kind == "lm":  # exp of the mean cross-entropy per token, in nats
                values["eval_perplexity"] = held_out["perplexity"] = perplexity(held_out["loss"])
            writer.write(step, held_out, prefix="eval")
        if force or eval_now or step % cfg.log_every == 0 or step == 1:
            entry = {"step": step, **values}
            self.history.append(entry)
            writer.write(step, values)
        bar.update(step, values)
        # The evaluation ran after step+1 was dispatched, so step+1's time would include it:
        # that step gets no rate.
        return None if "eval_loss" in values else now

    def _count_skipped(self, step: int, values: dict) -> None:
        """Counts skipped (non-finite) steps; stops after ``max_bad_steps`` in a row."""
        if values.get("skipped"):
            self.skipped_steps += 1
            self._bad_streak += 1
        else:
            self._bad_streak, self._last_good = 0, step
        if self.skipped_steps:
            values["skipped_steps"] = self.skipped_steps
        if self._bad_streak >= self.config.max_bad_steps:
            raise NonFiniteError.after(self._bad_streak, step, self._last_good, self.checkpoints)

    def generate(
        self, prompt: str, n_new: int = 200, *, temperature: float = 0.8, seed: int = 0
    ) -> str:
        """Continues `prompt` with `n_new` sampled tokens (language models on byte-level data).

        The context window is the data's ``seq_len``. Sampling one sequence is latency-bound,
        so a model under 256 MiB is first copied to one device; larger ones sample in place,
        sharded.
        """
        if self.data.kind != "lm":
            raise ValueError(
                f"generate() needs a language model on token data, not {self.data.kind!r}"
            )
        model = self.model
        graphdef, state = nnx.split(model)
        if jax.process_count() > 1:  # every process samples the same text from a full copy
            from jax.experimental import multihost_utils

            state = multihost_utils.process_allgather(state, tiled=True)
            model = nnx.merge(graphdef, jax.device_put(state, jax.local_devices()[0]))
        elif sum(x.nbytes for x in jax.tree.leaves(state)) < 256 * 2**20:
            model = nnx.merge(graphdef, jax.device_put(state, self.mesh.devices.flat[0]))
        tokens = sample(
            model,
            jnp.asarray(self.data.encode(prompt)),
            n_new,
            key=jax.random.key(seed),
            temperature=temperature,
            window=self.data.seq_len,
            vocab_size=self.data.vocab_size,
        )
        return self.data.decode(np.asarray(tokens))
