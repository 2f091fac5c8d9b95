"""Layout: how logical names become places on the mesh.

- `rules`: logical names, `Rules` tables and the strategy presets (`rules_for`);
- `resolve`: logical names → `PartitionSpec`, with one divisibility policy for everything;
- `batch`: batch shardings, the rows each process reads, microbatch splits;
- `context`: the active layout while a step is traced, and `constrain` for activations;
- `manual`: regions manual over some mesh axes (pipelines, kernels);
- `memory`: the memory kinds an array can live in (`ACCELERATOR`, `HOST`).

The axis names (`PIPE`, `DATA`, `FSDP`, `EXPERT`, `SEQ`, `TENSOR`, defined in `meshtrain.mesh`)
are re-exported here, so a model can name an axis without naming the mesh.
"""

from meshtrain.layout.batch import (
    batch_shardings,
    batch_spec,
    merge_microbatches,
    process_rows,
    shard_batch,
    split_microbatches,
)
from meshtrain.layout.context import (
    Layout,
    activation_rules,
    active,
    constrain,
    override_activations,
)
from meshtrain.layout.manual import (
    Spec,
    axis_size,
    manual_axes,
    manual_in_layout,
    manual_region,
    rows_apart,
    rows_are_apart,
    varying,
)
from meshtrain.layout.resolve import named, resolve, state_problems, state_specs
from meshtrain.layout.rules import (
    BATCH_AXES,
    LOGICAL_AXES,
    STRATEGIES,
    Entry,
    MeshAxes,
    Rules,
    alternatives,
    auto_strategy,
    axes_of,
    entry_of,
    rules_for,
    strategy_problems,
)
from meshtrain.mesh import DATA, EXPERT, FSDP, PIPE, SEQ, TENSOR  # axis names, for models

__all__ = [
    "BATCH_AXES",
    "DATA",
    "EXPERT",
    "FSDP",
    "LOGICAL_AXES",
    "PIPE",
    "SEQ",
    "STRATEGIES",
    "TENSOR",
    "Entry",
    "Layout",
    "MeshAxes",
    "Rules",
    "Spec",
    "activation_rules",
    "active",
    "alternatives",
    "axes_of",
    "entry_of",
    "axis_size",
    "batch_shardings",
    "batch_spec",
    "constrain",
    "manual_axes",
    "rows_apart",
    "rows_are_apart",
    "manual_in_layout",
    "manual_region",
    "merge_microbatches",
    "named",
    "override_activations",
    "process_rows",
    "resolve",
    "auto_strategy",
    "rules_for",
    "shard_batch",
    "split_microbatches",
    "state_problems",
    "state_specs",
    "strategy_problems",
    "varying",
]
