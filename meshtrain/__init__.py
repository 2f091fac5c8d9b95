"""meshtrain: Flax NNX training on `jax.sharding` meshes, where the XLA compiler distributes.

The public API, in the order a script uses it::

    import meshtrain as mt
    mt.simulate_devices(8)                         # laptops / notebooks only
    mesh = mt.make_mesh("data=2,fsdp=2,tensor=2")
    rules = mt.rules_for("hsdp+tp", mesh)
    data = mt.make_dataset(mt.DataConfig())        # byte-level stdlib corpus
    trainer = mt.Trainer(mt.GPTConfig(), data, mesh=mesh, rules=rules)
    history = trainer.fit()

Checkpoints: pass ``checkpoint=mt.CheckpointConfig(...)`` to the `Trainer` (see
`meshtrain.checkpoint`).
"""

from meshtrain import distributed
from meshtrain.checkpoint import CheckpointConfig
from meshtrain.data import DataConfig, Dataset, make_arrays_dataset, make_dataset
from meshtrain.distributed import DistributedConfig
from meshtrain.mesh import AXES, MeshConfig, describe, make_mesh, simulate_devices
from meshtrain.models import GPT, GPTConfig, MLPClassifier, MLPConfig, build_model, sample
from meshtrain.models.layers import Embed
from meshtrain.pipeline import PipelineConfig, schedule_table
from meshtrain.sharding import (
    LOGICAL_AXES,
    STRATEGIES,
    Rules,
    constrain,
    create_sharded_model,
    process_rows,
    rules_for,
    shard_batch,
)
from meshtrain.train import (
    OptimConfig,
    TrainState,
    init_train_state,
    jit_train_step,
    make_optimizer,
    train_step,
)
from meshtrain.train.trainer import TrainConfig, Trainer

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "CheckpointConfig",
    "GPT",
    "LOGICAL_AXES",
    "STRATEGIES",
    "DataConfig",
    "Dataset",
    "DistributedConfig",
    "Embed",
    "GPTConfig",
    "MLPClassifier",
    "MLPConfig",
    "MeshConfig",
    "OptimConfig",
    "PipelineConfig",
    "Rules",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "build_model",
    "constrain",
    "create_sharded_model",
    "describe",
    "distributed",
    "init_train_state",
    "jit_train_step",
    "make_arrays_dataset",
    "make_dataset",
    "make_mesh",
    "make_optimizer",
    "process_rows",
    "rules_for",
    "sample",
    "schedule_table",
    "shard_batch",
    "simulate_devices",
    "train_step",
]
