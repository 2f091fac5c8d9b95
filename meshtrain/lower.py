"""The lower tier: everything needed to write your own training loop.

The `Trainer` (`import meshtrain as mt; mt.Trainer`) is built from exactly these pieces::

    from meshtrain import lower
    run = mt.RunSpec(model=ctor, data=data, mesh=mesh, rules=rules, sync=sync)
    tx = run.optimizer(total_steps=100)   # make_optimizer's, + the loss scale under fp16
    graphdef, state, shardings = lower.init_train_state(ctor, tx, mesh, rules)
    state, shardings = lower.with_sync(sync, tx, state, shardings, mesh, rules)  # optional
    state, shardings = lower.with_offload(run.offload, state, shardings)  # optional
    step = lower.jit_train_step(run, graphdef, tx, shardings,
                                lower.batch_shardings(batch, mesh, rules))
    rows = lower.process_rows(mesh, rules, batch_size)      # what this process reads
    state, metrics = step(state, lower.shard_batch(batch, mesh, rules))

Layout, state and step each live in their own package (`meshtrain.layout`,
`meshtrain.state`, `meshtrain.train`); this module only gathers their public pieces.
"""

from meshtrain.check import check_run
from meshtrain.checkpoint import CheckpointManager, restore
from meshtrain.layout import (
    activation_rules,
    batch_shardings,
    constrain,
    manual_region,
    override_activations,
    process_rows,
    resolve,
    shard_batch,
    split_microbatches,
)
from meshtrain.models import build_model, sample
from meshtrain.offload import to_device, with_offload
from meshtrain.pipeline import pipeline_loss, pipeline_loss_and_grads
from meshtrain.precision import with_loss_scale
from meshtrain.problem import Problem, RunCheckError
from meshtrain.replicas import with_sync
from meshtrain.run import RunSpec
from meshtrain.state import (
    TrainState,
    abstract_model,
    abstract_target,
    abstract_train_state,
    create_sharded_model,
    init_train_state,
)
from meshtrain.train import (
    cross_entropy,
    eval_loss,
    jit_eval_step,
    jit_train_step,
    make_optimizer,
    make_schedule,
    train_step,
)

__all__ = [
    "CheckpointManager",
    "Problem",
    "RunCheckError",
    "RunSpec",
    "TrainState",
    "abstract_model",
    "abstract_target",
    "abstract_train_state",
    "activation_rules",
    "batch_shardings",
    "build_model",
    "check_run",
    "constrain",
    "create_sharded_model",
    "cross_entropy",
    "eval_loss",
    "init_train_state",
    "jit_eval_step",
    "jit_train_step",
    "make_optimizer",
    "make_schedule",
    "manual_region",
    "override_activations",
    "pipeline_loss",
    "pipeline_loss_and_grads",
    "process_rows",
    "resolve",
    "restore",
    "sample",
    "shard_batch",
    "split_microbatches",
    "to_device",
    "train_step",
    "with_loss_scale",
    "with_offload",
    "with_sync",
]
