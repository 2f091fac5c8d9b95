"""Each private or version-dependent name meshtrain uses (all wrapped in `meshtrain._compat`)
still exists on the installed versions: an upgrade that removes one fails here, loudly."""

import inspect
import typing

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from meshtrain import _compat
from meshtrain.mesh import make_mesh


def test_jax_reports_its_backends_started():
    jax.devices()  # conftest already started them; make sure
    assert _compat.jax_backends_started() is True


def test_jax_distributed_client_is_reachable():
    from jax._src import distributed

    assert hasattr(distributed.global_state, "client")
    assert _compat.jax_distributed_client() is None  # this process never joined a job


def test_varies_over_reads_the_manual_axes():
    mesh = make_mesh("pipe=2,data=4")
    seen = {}

    def body(x):
        seen["same"] = _compat.varies_over(x, "pipe")
        y = jax.lax.pcast(x, "pipe", to="varying")
        seen["varying"] = _compat.varies_over(y, "pipe")
        return y

    f = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("pipe"), axis_names={"pipe"})
    jax.eval_shape(f, jnp.zeros((4,)))
    assert seen == {"same": False, "varying": True}


def test_tyro_parse_error_hook_turns_each_mistake_into_a_failure():
    import dataclasses

    import tyro

    @dataclasses.dataclass(frozen=True)
    class Settings:
        steps: int = 1
        kind: typing.Literal["a", "b"] = "a"

    seen = []

    def keep(failure):
        seen.append(failure)
        raise ValueError

    for argv in (["--steps", "x"], ["--stpes", "2"], ["--kind", "c"]):
        with _compat.tyro_parse_failures(keep), pytest.raises(ValueError):
            tyro.cli(Settings, args=argv)
    assert [(f.kind, f.flags[0]) for f in seen] == [
        ("value", "--steps"),
        ("unknown", "--stpes"),
        ("choice", "--kind"),
    ]
    assert seen[0].expected is int and seen[0].default == 1 and seen[2].choices == ("a", "b")


def test_orbax_tmp_cleanup_hook_exists(tmp_path):
    assert callable(getattr(ocp.CheckpointManager, "_maybe_await_cleanup_tmp_directory", None))
    mgr = ocp.CheckpointManager(
        tmp_path, options=ocp.CheckpointManagerOptions(cleanup_tmp_directories=True)
    )
    _compat.orbax_finish_tmp_cleanup(mgr)  # returns once nothing is left to clean
    mgr.close()


@pytest.mark.parametrize(
    "module",
    [
        "meshtrain.cli",
        "meshtrain.cli.parsing",
        "meshtrain.mesh",
        "meshtrain.distributed",
        "meshtrain.checkpoint.manager",
    ],
)
def test_no_module_outside_compat_reaches_for_private_names(module):
    import importlib

    source = inspect.getsource(importlib.import_module(module))
    for private in ("jax._src", "tyro._", "_maybe_await_cleanup", "xla_bridge"):
        assert private not in source, f"{module} uses {private}: go through meshtrain._compat"
