"""Pipeline parallelism over the ``pipe`` mesh axis: gpipe, circular and 1F1B, in pure SPMD.

Any model that offers `meshtrain.models.PipelineParts` (the GPT and the MoE do) can be
pipelined: its stacked blocks are cut into ``pipe × repeats`` contiguous chunks, one region
manual over ``pipe`` runs the schedule, and the embedding and head run outside it, partitioned
by the compiler; a packed batch's segment ids and positions travel with the microbatches.
The train state is the same pytree as without a pipeline: the rules put the ``layers``
dimension on ``pipe``, so each stage already holds its own layers.

- `config`: `PipelineConfig` and `pipeline_problems` (the checks before compiling);
- `schedules`: the schedule tables, bubble counts and Gantt charts;
- `slots`: what a table implies: ring buffers and each slot's permutes;
- `split`: a backward cut into its input and weight passes (zb-h1);
- `spmd`: the executors inside the manual region (with `hand_scheduled`, `passes`, `chunk`,
  `collectives` and `buffers`, their pieces);
- `run`: the pipelined loss and gradients of a model (with `cut`, the model in pieces,
  `layers`, its layers as the stages hold them, and `specs`, the blocks' specs in the region);
- `step`: what the train step asks of a pipeline (its mesh, the pipelined gradient function).

    from meshtrain.pipeline import PipelineConfig, schedule_table
    schedule_table("1f1b", p=4, m=8).plot()
    Trainer(run=RunSpec(..., mesh=make_mesh("pipe=2,data=2,tensor=2"),
                        pipeline=PipelineConfig(schedule="1f1b", microbatches=8)))
"""

from meshtrain.pipeline.config import PipelineConfig, pipeline_problems
from meshtrain.pipeline.run import pipeline_loss, pipeline_loss_and_grads
from meshtrain.pipeline.schedules import (
    BWD,
    FWD,
    IDLE,
    SCHEDULES,
    ScheduleTable,
    schedule_table,
)

__all__ = [
    "BWD",
    "FWD",
    "IDLE",
    "SCHEDULES",
    "PipelineConfig",
    "ScheduleTable",
    "pipeline_loss",
    "pipeline_loss_and_grads",
    "pipeline_problems",
    "schedule_table",
]
