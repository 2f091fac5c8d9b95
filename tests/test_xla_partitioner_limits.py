"""The XLA limitations two rows of the composition table stand on (`meshtrain.composition`'s
REGION rows for the replicas' own step beside context parallelism): XLA's SPMD partitioner
aborts (a failed check in spmd_partitioner_util, which ends the process) on a gather inside a
region manual over the replicas when

- the gather is split over seq and tensor at once (the embedding's lookup: the table split
  over tensor, the tokens over seq), or
- the gather runs along seq while fsdp splits the rows (packed documents' ids reordered with
  the tokens, an MoE's dispatch).

Each program runs in a fresh process. When one of them compiles, jax has lifted the limit: the
row can go, and its cells' proof joins tests/test_composition_cover.py.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest
from _helpers import fresh_env

_PROGRAM = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from meshtrain.layout import varying
from meshtrain.mesh import make_mesh

wsc = jax.lax.with_sharding_constraint
mesh = make_mesh({mesh!r})
with jax.set_mesh(mesh):
{body}
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"),
                      axis_names={{"data"}})
    print(jax.jit(f)(operand, index).sum())
"""

# The embedding's lookup: a table split over tensor, its rows placed split over seq.
_OVER_SEQ_AND_TENSOR = """
    operand = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("tensor")))
    index = jax.device_put(jnp.zeros((8, 16), jnp.int32), NamedSharding(mesh, P("data")))

    def body(table, tokens):
        x = varying(table, ("data",))[tokens]
        return wsc(x, P(None, "seq", None)).sum(-1)
"""

# Tokens reordered along seq (a permutation gather) while fsdp splits the rows.
_ALONG_SEQ_ROWS_OVER_FSDP = """
    operand = jnp.zeros(())
    index = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(("data", "fsdp"), "seq")))
    order = np.r_[0:4, 12:16, 4:8, 8:12]

    def body(_, x):
        x = wsc(x, P("fsdp", "seq"))[:, order]
        return wsc(x, P("fsdp", "seq")) * 2
"""


@pytest.mark.parametrize(
    ("mesh", "body"),
    [
        pytest.param("data=2,seq=2,tensor=2", _OVER_SEQ_AND_TENSOR, id="over-seq-and-tensor"),
        pytest.param("data=2,fsdp=2,seq=2", _ALONG_SEQ_ROWS_OVER_FSDP, id="along-seq-rows-fsdp"),
    ],
)
def test_the_partitioner_still_aborts_on_these_gathers_in_a_region_over_the_replicas(mesh, body):
    program = _PROGRAM.format(mesh=mesh, body=textwrap.indent(textwrap.dedent(body), "    "))
    proc = subprocess.run(
        [sys.executable, "-c", program],
        cwd=pathlib.Path(__file__).resolve().parents[1],
        env=fresh_env(devices=8),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0, "it compiles now: drop the composition row that cites it"
    assert "spmd_partitioner_util" in proc.stderr, proc.stderr[-4000:]
