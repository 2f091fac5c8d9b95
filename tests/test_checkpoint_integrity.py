"""Checkpoints that notice changed bytes: the digests a step records at save, checked at restore.

A step whose bytes changed (same sizes, valid JSON, arrays orbax decodes without error) must be
reported with a `CheckpointWarning` and skipped for the previous step, exactly as a truncated
one is. Real orbax checkpoints on disk; nothing mocked."""

import json
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshtrain import checkpoint as ckpt
from meshtrain._compat import orbax_state_handler_without_replica_slices
from meshtrain.checkpoint import CheckpointConfig, CheckpointManager, CheckpointWarning
from meshtrain.checkpoint.digests import array_digests
from meshtrain.data import make_arrays_dataset
from meshtrain.layout import rules_for
from meshtrain.mesh import make_mesh
from meshtrain.models import MLPConfig, build_model
from meshtrain.optim import OptimConfig, make_optimizer
from meshtrain.run import RunSpec
from meshtrain.state import abstract_target, abstract_train_state
from meshtrain.train.trainer import TrainConfig, Trainer

# orbax's reader leaves an asyncio callback behind after a failed (corrupt) read; harmless.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

# Wide enough that each kernel's shards exceed orbax's 1 KiB inline limit: those are stored in
# data files with no checksum of their own, while smaller values sit inside checksummed nodes.
MLP = MLPConfig(num_features=8, num_classes=4, d_model=64, d_hidden=128)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=1)
TX = make_optimizer(OPTIM, 10)
LAYOUTS = {"sharded": ("fsdp=8", "fsdp"), "replicated": ("data=8", "dp")}


# ---- the digest function against a NumPy reference ----


def _reference(host: np.ndarray) -> tuple[int, int]:
    """The two weighted sums of the module docstring, in NumPy (uint64, reduced mod 2**32)."""
    if host.dtype == np.bool_:
        w = host.astype(np.uint64)
    else:
        w = host.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[host.dtype.itemsize])
    w = w.astype(np.uint64).ravel()
    i = np.arange(w.size, dtype=np.uint64)
    odd = (2 * i + 1) % 2**32
    hashed = i.copy()  # the mixing function: xor-shift, multiply, xor-shift, multiply, xor-shift
    for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        hashed = ((hashed ^ (hashed >> shift)) * factor) % 2**32
    hashed = (hashed ^ (hashed >> 16)) | 1
    return int((w * odd % 2**32).sum() % 2**32), int((w * hashed % 2**32).sum() % 2**32)


def test_digests_equal_a_numpy_reference_for_every_dtype_and_sharding():
    rng = np.random.default_rng(0)
    host = {
        "f32": rng.standard_normal((3, 5, 7)).astype(np.float32),
        "bf16": rng.standard_normal((13,)).astype(jnp.bfloat16),
        "f16": rng.standard_normal((2, 9)).astype(np.float16),
        "i8": rng.integers(-128, 128, (6, 5)).astype(np.int8),
        "i32": rng.integers(-(2**31), 2**31 - 1, (11,), dtype=np.int32),
        "bool": rng.random((4, 3)) > 0.5,
        "scalar": np.float32(rng.standard_normal()),
        "fp8": rng.standard_normal((7,)).astype(jnp.float8_e4m3fn),
    }
    got = array_digests({k: jnp.asarray(v) for k, v in host.items()})
    for k, v in host.items():
        assert got[k] == _reference(np.asarray(v)), k

    # One array, four layouts on 8 devices: the same digest as the host's.
    x = rng.standard_normal((16, 24)).astype(np.float32)
    mesh = make_mesh("data=2,fsdp=4")
    specs = [P(), P("data"), P(None, "fsdp"), P("fsdp", "data")]
    for spec in specs:
        placed = jax.device_put(x, NamedSharding(mesh, spec))
        assert array_digests({"x": placed})["x"] == _reference(x), spec

    # Typed PRNG keys are digested through their key data.
    keys = jax.random.split(jax.random.key(3), 5)
    assert array_digests({"k": keys})["k"] == _reference(np.asarray(jax.random.key_data(keys)))

    # Any change to one element changes the first digest (odd weights modulo 2**32).
    for _ in range(5):
        changed = x.copy()
        flat = changed.reshape(-1).view(np.uint32)
        flat[rng.integers(flat.size)] ^= np.uint32(rng.integers(1, 2**32))
        assert array_digests({"x": jnp.asarray(changed)})["x"][0] != _reference(x)[0]

    # Words +1, -2, +1 at three neighbouring indices leave the first digest as it was (the
    # weights 2i+1 are linear in i); the second one notices.
    words = x.reshape(-1).view(np.uint32).copy()
    words[100:103] += np.array([1, -2, 1], np.int64).astype(np.uint32)
    a, b = array_digests({"x": jnp.asarray(words.view(np.float32).reshape(x.shape))})["x"]
    assert a == _reference(x)[0] and b != _reference(x)[1]


# ---- checkpoints on disk ----


def _layout(name):
    """(abstract state, shardings) of the MLP and its Adam state laid out as `name`."""
    mesh_spec, strategy = LAYOUTS[name]
    mesh = make_mesh(mesh_spec)
    like = abstract_train_state(
        lambda: build_model(MLP, seed=0), TX, mesh, rules_for(strategy, mesh)
    )
    return like, jax.tree.map(lambda x: x.sharding, like)


def _random_host(like, seed):
    """Fresh random host values shaped as `like` (float leaves normal, others small ints)."""
    rng = np.random.default_rng(seed)

    def leaf(x):
        if np.issubdtype(x.dtype, np.floating):
            return rng.standard_normal(x.shape).astype(x.dtype)
        return rng.integers(0, 100, x.shape).astype(x.dtype)

    return jax.tree.map(leaf, like)


def _placed(host, shardings):
    return jax.tree.map(jax.device_put, host, shardings)


def _assert_bit_equal(restored, host, what):
    got, want = jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(host)
    assert len(got) == len(want), what
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        np.testing.assert_array_equal(a, b, err_msg=what)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """Steps 1 and 2 of the sharded layout in one directory, and the host values of each."""
    like, shardings = _layout("sharded")
    root = tmp_path_factory.mktemp("integrity") / "ck"
    saved = {}
    with CheckpointManager(root) as mgr:
        for step in (1, 2):
            host = _random_host(like, seed=step)
            data, meta = {"next_index": 17 * step}, {"note": f"written at step {step}"}
            mgr.save(step, _placed(host, shardings), data=data, meta=meta)
            saved[step] = (host, data, {"step": step, **meta})
    return root, saved


def _xor(path, offset, values):
    """Xors the bytes of `path` from `offset` on with `values` (non-zero), keeping its size."""
    blob = bytearray(path.read_bytes())
    for k, v in enumerate(values):
        blob[offset + k] ^= v
    path.write_bytes(bytes(blob))


def _xor_at(path, text, index, value):
    """Xors the byte at `index` within the first occurrence of `text` in `path` with `value`."""
    _xor(path, path.read_bytes().index(text) + index, [value])


def _largest_array_file(step_dir):
    """The largest OCDBT data file of the state (``state/**/d/*``)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.parent.name == "d" and p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def _middle_64_bytes(step_dir):
    path = _largest_array_file(step_dir)
    values = np.random.default_rng(5).integers(1, 256, 64).tolist()
    _xor(path, path.stat().st_size // 2 - 32, values)


_DOWNS_0 = b'"key": "downs", "key_type": 2}, {"key": "0"'

# name → (damage to the newest step's directory, what the warning names)
CHANGES = {
    "array-data": (_middle_64_bytes, r"arrays? .*differs? from (its|their) digests? at save"),
    # A key of the state's tree in orbax's metadata (a layer index, 0 → 1): without digests
    # this reads as a checkpoint of another optimizer and stops the run.
    "orbax-state-metadata": (
        lambda d: _xor_at(d / "state" / "_METADATA", _DOWNS_0, len(_DOWNS_0) - 2, 1),
        r"orbax's metadata of its state describes a different optimizer",
    ),
    # A digit of the data position (next_index 34 → 35).
    "data-position": (
        lambda d: _xor_at(d / "data" / "metadata", b"34", 1, ord("4") ^ ord("5")),
        r"its data item differs from its digest at save",
    ),
    "meta": (
        lambda d: _xor_at(d / "meta" / "metadata", b"step 2", 5, ord("2") ^ ord("7")),
        r"its meta item differs from its digest at save",
    ),
    "digests-unparsable": (
        lambda d: (d / "digests" / "metadata").write_text(json.dumps({"version": 1})),
        r"its digests item cannot be parsed",
    ),
    "digests-deleted": (
        lambda d: shutil.rmtree(d / "digests"),
        r"its digests item is missing",
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_changed_bytes_fall_back_to_the_previous_step_bit_exactly(two_steps, tmp_path, change):
    src, saved = two_steps
    root = tmp_path / "ck"
    shutil.copytree(src, root)
    damage, names = CHANGES[change]
    damage(root / "2")
    like, shardings = _layout("sharded")
    pattern = rf"checkpoint {root / '2'} cannot be read \(.*{names}.*\); falling back to step 1"
    with pytest.warns(CheckpointWarning, match=pattern):
        restored = ckpt.restore(root, abstract_target(like, shardings))
    host, data, meta = saved[1]
    assert restored.step == 1 and restored.data == data and restored.meta == meta
    _assert_bit_equal(restored.state, host, change)


def test_untouched_steps_restore_bit_exactly_without_a_warning(two_steps):
    root, saved = two_steps
    like, shardings = _layout("sharded")
    record = json.loads((root / "2" / "digests" / "metadata").read_text())
    assert record["version"] == 1 and "params/out/kernel" in record["arrays"]
    assert record["arrays"]["params/out/kernel"][2:] == [[64, 4], "float32"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        for step in (2, 1):
            restored = ckpt.restore(root, abstract_target(like, shardings), step=step)
            host, data, meta = saved[step]
            assert restored.step == step and restored.data == data and restored.meta == meta
            _assert_bit_equal(restored.state, host, f"step {step}")


def test_digests_do_not_depend_on_the_layout_saved_or_restored(tmp_path):
    """The same values saved sharded over 8 devices and replicated on 8 record the same
    digests, and each restores onto the other layout without a warning."""
    host = _random_host(_layout("sharded")[0], seed=7)
    for name in LAYOUTS:
        with CheckpointManager(tmp_path / name) as mgr:
            mgr.save(3, _placed(host, _layout(name)[1]))
    records = [
        json.loads((tmp_path / n / "3" / "digests" / "metadata").read_text()) for n in LAYOUTS
    ]
    assert records[0] == records[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        for source, target in (("sharded", "replicated"), ("replicated", "sharded")):
            like, shardings = _layout(target)
            restored = ckpt.restore(tmp_path / source, abstract_target(like, shardings))
            _assert_bit_equal(restored.state, host, f"{source} → {target}")


def test_a_checkpoint_saved_without_digests_restores_unchecked(tmp_path):
    """A step written before digests existed (three items, no ``digests``) restores as before."""
    like, shardings = _layout("sharded")
    host = _random_host(like, seed=9)
    handlers = {
        "state": orbax_state_handler_without_replica_slices(),
        "data": ocp.JsonCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }
    items = _placed(host, shardings)._asdict()
    del items["comm"]
    with ocp.CheckpointManager(tmp_path / "old", item_handlers=handlers) as mgr:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(items),
            data=ocp.args.JsonSave({"next_index": 5}),
            meta=ocp.args.JsonSave({"step": 4}),
        )
        mgr.save(4, args=args)
    assert not (tmp_path / "old" / "4" / "digests").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        restored = ckpt.restore(tmp_path / "old", abstract_target(like, shardings))
    assert restored.step == 4 and restored.data == {"next_index": 5}
    _assert_bit_equal(restored.state, host, "without digests")


def test_a_resumed_trainer_sets_a_changed_step_aside(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)

    def trainer(resume):
        mesh = make_mesh("fsdp=8")
        return Trainer(
            run=RunSpec(
                model=MLP,
                data=make_arrays_dataset(x, y, batch_size=16, val_fraction=0),
                mesh=mesh,
                rules=rules_for("fsdp", mesh),
                optim=OPTIM,
                train=TrainConfig(
                    steps=2, eval_every=0, log_every=1, run_dir=str(tmp_path), progress=False
                ),
                checkpoint=CheckpointConfig(save_every=1, resume=resume),
            )
        )

    first = trainer(resume=False)
    first.fit(until=1)
    at_one = jax.device_get(first.state)
    first.fit()
    first.checkpoints.close()
    directory = tmp_path / "checkpoints"
    _middle_64_bytes(directory / "2")
    with pytest.warns(CheckpointWarning, match=r"2 cannot be read \(its bytes changed"):
        second = trainer(resume=True)
    second.checkpoints.close()
    assert int(second.state.step) == 1
    _assert_bit_equal(second.state, at_one, "resumed")
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2.unreadable"]
