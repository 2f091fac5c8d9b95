"""Each private or version-dependent name meshtrain uses (all wrapped in `meshtrain._compat`)
still exists on the installed versions: an upgrade that removes one fails here, loudly."""

import inspect
import typing

import jax
import jax.numpy as jnp
import numpy as np
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


def _lowered_while(fn) -> int:
    """How many programs jax lowers while `fn` runs (persistent cache hits included)."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return len(seen)


def test_a_save_writes_replicated_shards_whole_without_slicing_them(tmp_path):
    """Orbax's default handler slices each replicated shard among its replicas (a program per
    shape, per save); meshtrain's writes each shard from one replica, and reads back the same."""
    from meshtrain.checkpoint import CheckpointManager
    from meshtrain.state import TrainState

    mesh = make_mesh("data=4,tensor=2")
    rng = np.random.default_rng(0)
    put = lambda a, spec: jax.device_put(a, jax.NamedSharding(mesh, spec))  # noqa: E731
    params = {
        "w": put(rng.standard_normal((8, 6), np.float32), P(None, "tensor")),  # 4 replicas
        "b": put(rng.standard_normal((12,), np.float32), P()),  # 8 replicas
    }
    state = TrainState(step=put(np.int32(3), P()), params=params, opt_state=(), rest={})

    default = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    tree = {"params": params}
    assert _lowered_while(lambda: default.save(tmp_path / "orbax", ocp.args.StandardSave(tree)))

    mgr = CheckpointManager(tmp_path / "ck")
    mgr.save(0, state, wait=True)  # compiles the digest program, once per state layout
    assert _lowered_while(lambda: mgr.save(1, state, wait=True)) == 0
    back = mgr.restore(
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    )
    mgr.close()
    for got, want in zip(jax.tree.leaves(back.state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding == want.sharding


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
    for private in (
        "jax._src",
        "tyro._",
        "_maybe_await_cleanup",
        "xla_bridge",
        "_use_replica_parallel",
    ):
        assert private not in source, f"{module} uses {private}: go through meshtrain._compat"


def test_cudnn_packed_attention_reaches_jax_private_packed_layout():
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    params = list(inspect.signature(cudnn.dot_product_attention).parameters)
    positional = ["query", "key", "value", "bias", "mask", "q_seqlen", "kv_seqlen", "q_offsets"]
    assert params[: len(positional) + 1] == [*positional, "kv_offsets"]
    assert {"scale", "mask_type", "qkv_layout"} <= set(params)
    assert cudnn.MaskType.PADDING_CAUSAL and cudnn.MaskType.PADDING
    assert "cudnn_packed_attention" in dir(_compat)
