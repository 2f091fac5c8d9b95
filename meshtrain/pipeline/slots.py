"""What a schedule table implies for the executors: the payloads each stage sends.

A stage sends its output on after every forward except the model's last chunk's (which goes
to the loss head), and its input's cotangent back after every backward except the model's
first chunk's (which goes to the embedding). Only those payloads are useful bytes on the wire.
"""

from __future__ import annotations

import numpy as np

from meshtrain.pipeline.schedules import BWD, FWD, ScheduleTable


def sends(table: ScheduleTable) -> np.ndarray:
    """Payloads (one microbatch's [b, T, D] activation or cotangent) each stage sends per step.

    Returns:
        [p] int: stage s's count of forward sends (every FWD but the last chunk's on the last
        stage) plus backward sends (every BWD but the first chunk's on the first stage).
    """
    p, v = table.stages, table.repeats
    stage = np.broadcast_to(np.arange(p), table.phase.shape)
    last = (stage == p - 1) & (table.chunk == v - 1)
    first = (stage == 0) & (table.chunk == 0)
    fwd = (table.phase == FWD) & ~last
    bwd = (table.phase == BWD) & ~first
    return (fwd | bwd).sum(axis=0)
