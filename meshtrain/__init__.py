"""meshtrain: Flax NNX training on `jax.sharding` meshes, where the XLA compiler distributes.

Two tiers. This module is the top one, in the order a script uses it::

    import meshtrain as mt
    mt.simulate_devices(8)                         # laptops / notebooks only
    mesh = mt.make_mesh("data=2,fsdp=2,tensor=2")
    rules = mt.rules_for("hsdp+tp", mesh)
    data = mt.make_dataset(mt.DataConfig())        # byte-level stdlib corpus
    trainer = mt.Trainer(mt.GPTConfig(), data, mesh=mesh, rules=rules)
    history = trainer.fit()

Your own model names its dimensions with `mt.constrain` and `mt.Embed`-style logical names.
The whole run (optimizer, loop, pipeline, sync, checkpoints) is one `mt.RunSpec`:
``mt.Trainer(run=mt.RunSpec(model=..., data=..., checkpoint=mt.CheckpointConfig(...)))``.
The lower tier, `meshtrain.lower`, has the pieces the `Trainer` is built from, for writing
your own loop.
"""

from meshtrain import (
    distributed,
    fit,  # noqa: F401  (adds the memory per device to the run check)
    lower,
)
from meshtrain.checkpoint import CheckpointConfig
from meshtrain.comm import inspect
from meshtrain.data import (
    DataConfig,
    Dataset,
    load_tokenizer,
    make_arrays_dataset,
    make_dataset,
    prepare_corpus,
)
from meshtrain.distributed import DistributedConfig
from meshtrain.layout import LOGICAL_AXES, STRATEGIES, Rules, constrain, rules_for
from meshtrain.mesh import AXES, MeshConfig, describe, make_mesh, simulate_devices
from meshtrain.models import CNN, GPT, CNNConfig, GPTConfig, MLPClassifier, MLPConfig, families
from meshtrain.models.layers import Embed
from meshtrain.offload import Offload
from meshtrain.pipeline import PipelineConfig, schedule_table
from meshtrain.precision import Precision
from meshtrain.problem import RunCheckError
from meshtrain.replicas import SyncConfig
from meshtrain.run import RunSpec
from meshtrain.train import OptimConfig, TrainConfig, Trainer

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "CNN",
    "CNNConfig",
    "CheckpointConfig",
    "DataConfig",
    "Dataset",
    "DistributedConfig",
    "Embed",
    "GPT",
    "GPTConfig",
    "LOGICAL_AXES",
    "MLPClassifier",
    "MLPConfig",
    "MeshConfig",
    "Offload",
    "OptimConfig",
    "PipelineConfig",
    "Precision",
    "Rules",
    "RunCheckError",
    "RunSpec",
    "STRATEGIES",
    "SyncConfig",
    "TrainConfig",
    "Trainer",
    "constrain",
    "describe",
    "distributed",
    "families",
    "inspect",
    "load_tokenizer",
    "lower",
    "make_arrays_dataset",
    "make_dataset",
    "make_mesh",
    "prepare_corpus",
    "rules_for",
    "schedule_table",
    "simulate_devices",
]
