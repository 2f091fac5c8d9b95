"""Context parallelism inside pipeline stages, beyond the equality with one device (the cover
cases in tests/test_composition_cover.py prove every schedule with every algorithm):

- the ring's shift inside a stage lowers to a collective-permute for a GPU and to a gather on
  the CPU, whose runtime cannot run a permute in a branch only some stages take;
- the refusal of a hand-scheduled schedule beside tensor still names a live XLA limitation:
  the refused layout, run with the check bypassed, still aborts in XLA's SPMD partitioner
  (when it stops aborting, this test fails, and the refusal should go).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from meshtrain import context_parallel as cp
from meshtrain.layout import activation_rules, rules_for

MESH = AbstractMesh((2, 2), ("pipe", "seq"), (AxisType.Auto,) * 2)
B, T, H, K = 2, 16, 2, 8


def _stage_with_ring(q):
    """A slot of a hand-scheduled stage, reduced: one stage runs the ring, the other idles."""

    def body(q):
        def attend(x):
            return cp.context_attention(x, x, x, np.arange(T), mesh=MESH, algorithm="ring")

        first = jax.lax.axis_index("pipe") == 0
        return jax.lax.cond(first, attend, lambda x: x, q[0])[None]

    return jax.shard_map(
        body, mesh=MESH, in_specs=P("pipe"), out_specs=P("pipe"), axis_names={"pipe"}
    )(q)


def _module(platform: str) -> str:
    arg = jax.ShapeDtypeStruct((2, B, T, H, K), jnp.float32)
    with jax.sharding.use_abstract_mesh(MESH), activation_rules(MESH, rules_for("dp", MESH)):
        return export.export(jax.jit(_stage_with_ring), platforms=[platform])(arg).mlir_module()


def test_the_ring_in_a_stage_permutes_on_a_gpu_and_gathers_on_the_cpu():
    gpu, cpu = _module("cuda"), _module("cpu")
    assert "collective_permute" in gpu and "all_gather" not in gpu
    assert "all_gather" in cpu and "collective_permute" not in cpu


ABORTS = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    import conftest  # noqa: F401  (8 simulated devices)
    import test_composition_cover as cover
    cover.check_run = lambda run: []  # past the refusal
    case = cover.Case("pipe=2,seq=2,tensor=2", "dp+tp", schedule="1f1b", context="allgather")
    state, _, step = cover._setup(case, case.mesh, case.strategy, None, 1)
    step(state, cover._batches(case, case.config().vocab_size, 1)[0])
    print("TRAINED")
    """
)


def test_a_hand_scheduled_stage_with_tensor_and_seq_still_aborts_the_partitioner():
    done = subprocess.run(
        [sys.executable, "-c", ABORTS], capture_output=True, text=True, timeout=600
    )
    assert "TRAINED" not in done.stdout, "XLA compiles it now: lift the refusal in rules.py"
    assert done.returncode != 0
    assert "spmd_partitioner_util" in done.stderr, done.stderr[-2000:]
