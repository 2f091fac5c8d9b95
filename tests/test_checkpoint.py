"""Tests for meshtrain.checkpoint: save, restore onto other meshes, resume, refusals, meta."""

import hashlib
import json

import jax
import numpy as np
import pytest

from meshtrain import checkpoint
from meshtrain.data import DataConfig, make_dataset
from meshtrain.mesh import make_mesh
from meshtrain.models import GPTConfig, build_model
from meshtrain.sharding import rules_for, shard_batch
from meshtrain.train.optim import OptimConfig, make_optimizer
from meshtrain.train.step import batch_shardings, init_train_state, jit_train_step
from meshtrain.train.trainer import batch_shapes

GPT = GPTConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
TX = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=1), 10)
META = {"mesh": "data=2,fsdp=2,tensor=2", "steps": 3, "nested": {"lr": 0.01, "tags": ["a", "b"]}}


def _ctor():
    return build_model(GPT, seed=0)


@pytest.fixture(scope="module")
def data():
    return make_dataset(DataConfig(source="synthetic", seq_len=32, batch_size=16))


def _setup(data, mesh, strategy):
    """Fresh sharded state on `mesh`, its shardings, and a jitted train step."""
    rules = rules_for(strategy, mesh)
    graphdef, state, shardings = init_train_state(_ctor, TX, mesh, rules)
    step = jit_train_step(
        graphdef, TX, mesh, rules, shardings, batch_shardings(batch_shapes(data), mesh, rules)
    )
    return rules, state, shardings, step


def _snapshot(root):
    """Relative path → content hash of every file under `root`."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def fresh(data):
    """A freshly initialised state on data=8 (dp) and its shardings."""
    _, state, shardings, _ = _setup(data, make_mesh("data=8"), "dp")
    return state, shardings


@pytest.mark.slow
def test_restore_onto_other_meshes_and_resume(data, tmp_path):
    # Train 3 steps on data=2,fsdp=2,tensor=2 (fsdp+tp), save, and take one more step there.
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    rules, state, _, step = _setup(data, mesh, "fsdp+tp")
    it = data.train_iter()
    for _ in range(3):
        state, _ = step(state, shard_batch(next(it), mesh, rules))
    path = checkpoint.save(tmp_path / "checkpoint-3", state, meta=META)
    assert path.is_absolute() and (path / "meta.json").is_file()
    host = jax.device_get(state)
    batch = next(it)
    _, metrics = step(state, shard_batch(batch, mesh, rules))
    ref_loss = float(metrics["loss"])

    for mesh_spec, n_devices, strategy in [("fsdp=4", 4, "fsdp"), ("data=8", 8, "dp")]:
        mesh = make_mesh(mesh_spec, devices=jax.devices()[:n_devices])
        rules, like, shardings, step = _setup(data, mesh, strategy)
        restored = checkpoint.restore(path, like, shardings)

        assert jax.tree.structure(restored) == jax.tree.structure(like)
        got = jax.tree_util.tree_leaves_with_path(restored)
        assert len(got) == len(jax.tree.leaves(host)) == len(jax.tree.leaves(shardings))
        for (where, leaf), want, sharding in zip(
            got, jax.tree.leaves(host), jax.tree.leaves(shardings), strict=True
        ):
            name = f"{mesh_spec}: {jax.tree_util.keystr(where)}"
            assert leaf.dtype == want.dtype and leaf.shape == want.shape, name
            np.testing.assert_array_equal(np.asarray(leaf), want, err_msg=name)  # exact
            assert leaf.sharding == sharding, (name, leaf.sharding, sharding)
            assert set(leaf.sharding.device_set) == set(mesh.devices.flat), name
        assert int(restored.step) == 3
        # A sharded leaf really is laid out the new way (not just labelled so).
        kernel = restored.params["head"]["kernel"]
        assert len(kernel.addressable_shards) == n_devices
        if strategy == "fsdp":
            assert kernel.addressable_shards[0].data.shape == (GPT.d_model // 4, GPT.vocab_size)
        else:
            assert kernel.sharding.is_fully_replicated

        # One more step on the new mesh matches one more step on the original mesh
        # (float32, another reduction order: 1e-6 relative).
        new_state, metrics = step(restored, shard_batch(batch, mesh, rules))
        np.testing.assert_allclose(float(metrics["loss"]), ref_loss, rtol=1e-6, err_msg=mesh_spec)
        assert int(new_state.step) == 4


def test_save_refuses_an_existing_path_and_keeps_it(fresh, tmp_path):
    state, shardings = fresh
    path = checkpoint.save(tmp_path / "ckpt", state, meta=META)
    host = jax.device_get(state)
    before = _snapshot(path)
    assert "meta.json" in before and len(before) > 2
    other = state._replace(params=jax.tree.map(lambda x: x + 1, state.params))
    with pytest.raises(ValueError, match="already exists"):
        checkpoint.save(path, other, meta={"other": True})
    assert _snapshot(path) == before
    assert checkpoint.read_meta(path) == META
    # ... and what is there still restores to the saved values.
    restored = checkpoint.restore(path, state, shardings)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)

    # An existing empty directory is refused too: nothing is ever written into it.
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="already exists"):
        checkpoint.save(empty, state)
    assert list(empty.iterdir()) == []


def test_restore_from_a_non_checkpoint_raises(fresh, tmp_path):
    state, shardings = fresh
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    for where in (tmp_path, tmp_path / "missing"):
        with pytest.raises(ValueError, match="is this a meshtrain checkpoint"):
            checkpoint.restore(where, state, shardings)


def test_read_meta_round_trips(fresh, tmp_path, monkeypatch):
    state, _ = fresh
    path = checkpoint.save(tmp_path / "a", state, meta=META)
    assert checkpoint.read_meta(path) == META
    assert json.loads((path / "meta.json").read_text()) == META
    # A relative path and a str work as well as the absolute Path that save returns.
    monkeypatch.chdir(tmp_path)
    assert checkpoint.read_meta("a") == META
    assert checkpoint.read_meta(str(path)) == META
