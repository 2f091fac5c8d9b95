"""Tests for meshtrain.checkpoint in this process: the manager's round trip and keep policy,
restores onto other meshes (the reshard matrix), fallback past corrupt steps, resume through the
Trainer API, and the NaN/Inf guard. Real orbax checkpoints on disk; nothing mocked."""

import dataclasses
import hashlib
import shutil
import warnings

import jax
import numpy as np
import pytest
from _helpers import state_and_step

from meshtrain import checkpoint as ckpt
from meshtrain.checkpoint import CheckpointConfig, CheckpointManager, CheckpointWarning
from meshtrain.data import make_arrays_dataset
from meshtrain.layout import rules_for, shard_batch
from meshtrain.lower import RunSpec, init_train_state
from meshtrain.mesh import make_mesh, mesh_sizes
from meshtrain.models import GPTConfig, MLPConfig, build_model
from meshtrain.models.base import batch_structs
from meshtrain.optim import OptimConfig, make_optimizer
from meshtrain.state import abstract_target, abstract_train_state
from meshtrain.train.hooks import NonFiniteError
from meshtrain.train.trainer import TrainConfig, Trainer

# orbax's reader leaves an asyncio callback behind after a failed (corrupt) read; harmless.
pytestmark = [
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    # One worker builds the module-scoped layouts for all of them (under --dist loadgroup).
    pytest.mark.xdist_group("checkpoint_layouts"),
]

GPT = GPTConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
TX = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=1), 10)
MLP = MLPConfig(num_features=8, num_classes=4, d_model=16, d_hidden=32)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=1)

# name → (mesh, devices used, strategy)
LAYOUTS = {
    "hybrid": ("data=2,fsdp=2,tensor=2", 8, "fsdp+tp"),
    "dp8": ("data=8", 8, "dp"),
    "pipe2": ("pipe=2,fsdp=4", 8, "fsdp"),
    "fsdp4": ("fsdp=4", 4, "fsdp"),
    "zero1_tp": ("data=2,tensor=2", 4, "zero1+tp"),
}


def _mesh(name):
    spec, n, strategy = LAYOUTS[name]
    mesh = make_mesh(spec, devices=jax.devices()[:n])
    return mesh, rules_for(strategy, mesh)


def _randomized(state, shardings, seed):
    """`state` with every float leaf replaced by fresh normals (so the optimizer moments are not
    all zeros), placed with `shardings`; no compiling."""
    rng = np.random.default_rng(seed)

    def leaf(x, s):
        if np.issubdtype(x.dtype, np.floating):
            host = rng.standard_normal(x.shape).astype(x.dtype)
        else:
            host = np.full(x.shape, 7, x.dtype)
        return jax.device_put(host, s)

    return jax.tree.map(leaf, state, shardings)


@pytest.fixture(scope="module")
def layouts():
    """name → (mesh, rules, randomized state, shardings) for every layout in LAYOUTS.

    The states are host-made random arrays placed with the shardings `abstract_train_state`
    gives (which `test_abstract_train_state_matches_init` checks against `init_train_state`),
    so building them compiles nothing.
    """
    out = {}
    for i, name in enumerate(LAYOUTS):
        mesh, rules = _mesh(name)
        target = abstract_train_state(lambda: build_model(GPT, seed=0), TX, mesh, rules)
        shardings = jax.tree.map(lambda x: x.sharding, target)
        out[name] = (mesh, rules, _randomized(target, shardings, seed=i), shardings)
    return out


def _snapshot(root):
    """Relative path → content hash of every file under `root`."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _assert_same(restored, want_host, shardings, what):
    """Every leaf equal (exactly) to the host copy and laid out with `shardings`."""
    got = jax.tree_util.tree_leaves_with_path(restored)
    assert len(got) == len(jax.tree.leaves(want_host)) == len(jax.tree.leaves(shardings))
    for (where, leaf), want, sharding in zip(
        got, jax.tree.leaves(want_host), jax.tree.leaves(shardings), strict=True
    ):
        name = f"{what}: {jax.tree_util.keystr(where)}"
        assert leaf.shape == want.shape and leaf.dtype == want.dtype, name
        np.testing.assert_array_equal(np.asarray(leaf), want, err_msg=name)
        assert leaf.sharding == sharding, (name, leaf.sharding, sharding)
        # The shards really have the new layout (not a full copy labelled so).
        for shard in leaf.addressable_shards:
            assert shard.data.shape == sharding.shard_shape(leaf.shape), name


def test_abstract_train_state_matches_init():
    mesh, rules = _mesh("hybrid")
    ctor = lambda: build_model(GPT, seed=0)  # noqa: E731
    target = abstract_train_state(ctor, TX, mesh, rules)
    _, state, shardings = init_train_state(ctor, TX, mesh, rules)
    assert jax.tree.structure(target) == jax.tree.structure(state)
    for t, x, s in zip(*map(jax.tree.leaves, (target, state, shardings)), strict=True):
        assert (
            (t.shape, t.dtype, t.sharding)
            == (x.shape, x.dtype, s)
            == (x.shape, x.dtype, x.sharding)
        )


def test_round_trip_keep_policy_and_atomic_commit(layouts, tmp_path):
    mesh, _, state, shardings = layouts["hybrid"]
    config = CheckpointConfig(keep_last=2, keep_every=2)
    saved = {}
    with CheckpointManager(tmp_path / "ck", config) as mgr:
        for step in range(1, 6):
            state = _randomized(state, shardings, seed=100 + step)
            saved[step] = jax.device_get(state)
            data = {"grain": {"next_index": step * 3}, "seed": 0}
            mgr.save(step, state, data=data, meta={"note": f"step {step}", "nested": [1, {"a": 2}]})
        mgr.wait()
        # Latest 2 (4, 5) plus every 2nd (2, 4); 1 and 3 were deleted by the keep policy.
        assert mgr.steps() == [2, 4, 5]
        with pytest.raises(ValueError, match="already exists"):
            mgr.save(5, state)
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["2", "4", "5"], names  # no temporary directories left behind
    for step in (5, 2):
        target = abstract_target(state, shardings)
        restored = ckpt.restore(tmp_path / "ck", target, step=None if step == 5 else step)
        assert restored.step == step
        _assert_same(restored.state, saved[step], shardings, f"step {step}")
        assert restored.data == {"grain": {"next_index": step * 3}, "seed": 0}
        assert restored.meta == {"step": step, "note": f"step {step}", "nested": [1, {"a": 2}]}


# source → target: a device-count change both ways, DP onto FSDP+TP, pipelined onto
# unpipelined and back, ZeRO-1 onto FSDP.
RESHARDS = [
    ("hybrid", "fsdp4"),
    ("dp8", "hybrid"),
    ("pipe2", "dp8"),
    ("hybrid", "pipe2"),
    ("zero1_tp", "pipe2"),
    ("fsdp4", "zero1_tp"),
]


@pytest.fixture(scope="module")
def saved_layouts(layouts, tmp_path_factory):
    """name → checkpoint directory holding that layout's state at step 7."""
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for name in {src for src, _ in RESHARDS}:
        mesh, _, state, _ = layouts[name]
        with CheckpointManager(root / name) as mgr:
            mgr.save(7, state, meta={"mesh": ckpt.mesh_meta(mesh)})
        out[name] = root / name
    return out


@pytest.mark.parametrize(("source", "target"), RESHARDS, ids=lambda x: x)
@pytest.mark.pair("dp", "resume-relayout")
@pytest.mark.pair("fsdp", "resume-relayout")
@pytest.mark.pair("zero1", "resume-relayout")
@pytest.mark.pair("tp", "resume-relayout")
def test_restore_onto_another_layout(layouts, saved_layouts, source, target):
    src_mesh, _, src_state, _ = layouts[source]
    mesh, _, like, shardings = layouts[target]
    restored = ckpt.restore(saved_layouts[source], abstract_target(like, shardings))
    assert restored.step == 7
    _assert_same(restored.state, jax.device_get(src_state), shardings, f"{source}→{target}")
    # The checkpoint records the mesh it was written from.
    assert restored.meta["mesh"]["axes"] == mesh_sizes(src_mesh)
    assert restored.meta["mesh"]["devices"] == src_mesh.devices.size
    # Every restored array lives on the target mesh's devices only.
    for leaf in jax.tree.leaves(restored.state):
        assert leaf.sharding.device_set == set(mesh.devices.flat)
    if "pipe" in LAYOUTS[target][0]:  # each stage holds its own half of the stacked blocks
        layers = jax.tree.leaves(restored.state.params["blocks"])[0]
        assert layers.addressable_shards[0].data.shape[0] == GPT.n_layers // 2


def test_a_checkpoint_of_another_model_is_one_line_without_warnings_and_changes_nothing(
    layouts, saved_layouts, tmp_path
):
    mesh, rules, like, shardings = layouts["hybrid"]
    target = abstract_target(like, shardings)
    kernel = target.params["head"]["kernel"]
    wrong = jax.ShapeDtypeStruct((kernel.shape[0] * 2, kernel.shape[1]), kernel.dtype)
    target.params["head"]["kernel"] = jax.ShapeDtypeStruct(
        wrong.shape, wrong.dtype, sharding=jax.sharding.NamedSharding(kernel.sharding.mesh, jax.P())
    )
    before = _snapshot(saved_layouts["hybrid"])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError) as err:
        warnings.simplefilter("always")
        ckpt.restore(saved_layouts["hybrid"], target)
    assert not [w for w in caught if issubclass(w.category, CheckpointWarning)], caught
    message = str(err.value)
    assert "\n" not in message and len(message) < 500, message
    assert "was written with a different model" in message, message
    assert "1 of " in message and "parameters differ" in message, message
    assert f"head/kernel is [{kernel.shape[0]}, {kernel.shape[1]}] in the checkpoint" in message
    assert f"[{wrong.shape[0]}, {wrong.shape[1]}] in the model" in message, message
    assert "same model and optimizer settings" in message and "--run-dir" in message, message
    assert _snapshot(saved_layouts["hybrid"]) == before

    # The newest step is another model's (d_model 64), an older one fits: the run stops there
    # rather than falling back, so the newer step is not set aside as if it were damaged.
    wide = abstract_train_state(
        lambda: build_model(dataclasses.replace(GPT, d_model=64), seed=0), TX, mesh, rules
    )
    root = tmp_path / "ck"
    with CheckpointManager(root) as mgr:
        mgr.save(1, like)
        mgr.save(2, _randomized(wide, jax.tree.map(lambda x: x.sharding, wide), seed=3))
    before = _snapshot(root)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError) as err:
        warnings.simplefilter("always")
        with CheckpointManager(root, CheckpointConfig(resume=True)) as mgr:
            mgr.restore(abstract_target(like, shardings))
    assert not [w for w in caught if issubclass(w.category, CheckpointWarning)], caught
    message = str(err.value)
    assert f"checkpoint {root / '2'} was written with a different model" in message, message
    assert "norm/scale is [64] in the checkpoint, [32] in the model" in message, message
    assert "; and 10 more)" in message, message  # the rest summarised
    assert _snapshot(root) == before and sorted(p.name for p in root.iterdir()) == ["1", "2"]


def _truncate(paths):
    for p in paths:
        with open(p, "r+b") as f:
            f.truncate(max(1, p.stat().st_size // 2))


# How the newest step gets damaged: (name, function of the step directory).
CORRUPTIONS = {
    "truncated-array-data": lambda d: _truncate(sorted((d / "state" / "d").iterdir())),
    "deleted-array-manifest": lambda d: (d / "state" / "manifest.ocdbt").unlink(),
    "deleted-state-item": lambda d: shutil.rmtree(d / "state"),
    "truncated-data-position": lambda d: _truncate([d / "data" / "metadata"]),
    "deleted-meta": lambda d: (d / "meta" / "metadata").unlink(),
}


@pytest.fixture(scope="module")
def two_steps(layouts, tmp_path_factory):
    """A directory with steps 1 and 2 of the dp8 layout, and the host copy of step 1."""
    _, _, state, shardings = layouts["dp8"]
    root = tmp_path_factory.mktemp("two") / "ck"
    first = _randomized(state, shardings, seed=11)
    with CheckpointManager(root) as mgr:
        mgr.save(1, first, data={"grain": {"next_index": 1}})
        mgr.save(2, _randomized(state, shardings, seed=12), data={"grain": {"next_index": 2}})
    return root, jax.device_get(first)


@pytest.mark.parametrize("damage", list(CORRUPTIONS))
def test_corrupt_newest_step_falls_back_and_deletes_nothing(layouts, two_steps, tmp_path, damage):
    _, _, like, shardings = layouts["dp8"]
    src, first = two_steps
    root = tmp_path / "ck"
    shutil.copytree(src, root)
    CORRUPTIONS[damage](root / "2")
    before = _snapshot(root)
    with pytest.warns(CheckpointWarning, match=r"2 cannot be read .*falling back to step 1"):
        restored = ckpt.restore(root, abstract_target(like, shardings))
    assert restored.step == 1 and restored.data == {"grain": {"next_index": 1}}
    _assert_same(restored.state, first, shardings, damage)
    assert _snapshot(root) == before  # a read changes nothing

    # A run that resumes and writes again sets the unreadable step aside (renamed, intact),
    # so new saves neither overwrite it nor garbage-collect it.
    with CheckpointManager(root, CheckpointConfig(keep_last=1)) as mgr:
        moved = mgr.set_aside([2])
        assert [p.name for p in moved] == ["2.unreadable"]
        mgr.save(2, restored.state, wait=True)
        mgr.save(3, restored.state, wait=True)
        assert mgr.steps() == [3]
    after = _snapshot(root)
    for path, digest in before.items():
        if path.startswith("2/"):
            assert after["2.unreadable/" + path[2:]] == digest, path


def test_nothing_readable_is_one_clear_error(layouts, two_steps, tmp_path):
    _, _, like, shardings = layouts["dp8"]
    root = tmp_path / "ck"
    shutil.copytree(two_steps[0], root)
    for step in ("1", "2"):
        CORRUPTIONS["deleted-array-manifest"](root / step)
    with warnings.catch_warnings(record=True), pytest.raises(ValueError) as err:
        ckpt.restore(root, abstract_target(like, shardings))
    assert "no readable checkpoint" in str(err.value)
    assert "step 2:" in str(err.value) and "step 1:" in str(err.value)
    with pytest.raises(ValueError, match="no checkpoint found"):
        ckpt.restore(tmp_path / "empty", abstract_target(like, shardings))


def test_config_values_are_checked():
    for field, value in (("save_every", -1), ("keep_last", 0), ("keep_every", 1.5)):
        wording = "must be (an integer ≥|a positive integer)"
        with pytest.raises(ValueError, match=f"^{field}={value!r}: {wording}"):
            CheckpointConfig(**{field: value})


# ---- Trainer: resume through the API, refusal to write over a run, the NaN/Inf guard ----


def _arrays(nan_rows=(), n=256, seed=0):
    """A 4-class problem on 8 features; rows in `nan_rows` get a NaN feature."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + 2 * (x[:, 1] > 0)
    x[list(nan_rows), 3] = np.nan
    return make_arrays_dataset(x, y, batch_size=16, val_fraction=0)


def _mlp_trainer(data, run_dir, *, steps=6, checkpoint=None, **kw):
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    config = TrainConfig(
        steps=steps, eval_every=0, log_every=1, run_dir=str(run_dir), progress=False, **kw
    )
    return Trainer(
        run=RunSpec(
            model=MLP,
            data=data,
            mesh=mesh,
            rules=rules_for("fsdp+tp", mesh),
            optim=OPTIM,
            train=config,
            checkpoint=checkpoint,
        )
    )


def test_trainer_resume_is_bit_exact_and_refuses_to_overwrite(tmp_path):
    straight = _mlp_trainer(_arrays(), tmp_path / "a").fit()
    first = _mlp_trainer(_arrays(), tmp_path / "b", checkpoint=CheckpointConfig(save_every=2))
    head = first.fit(until=3)
    first.checkpoints.close()
    assert first.checkpoints.steps() == [2, 3]
    with pytest.raises(ValueError, match=r"already holds steps \[2, 3\]; pass --resume"):
        _mlp_trainer(_arrays(), tmp_path / "b", checkpoint=CheckpointConfig())
    second = _mlp_trainer(
        _arrays(), tmp_path / "b", checkpoint=CheckpointConfig(save_every=2, resume=True)
    )
    assert int(second.state.step) == 3
    tail = second.fit()
    second.checkpoints.close()
    losses = [e["loss"] for e in head + tail]
    assert [e["step"] for e in head + tail] == [1, 2, 3, 4, 5, 6]
    assert losses == [e["loss"] for e in straight]  # bit-identical
    restored = ckpt.restore(
        tmp_path / "b" / "checkpoints", abstract_target(second.state, second.shardings)
    )
    assert restored.step == 6
    assert restored.meta["config"]["model"]["kind"] == "MLPConfig"
    assert restored.meta["config"]["train"]["steps"] == 6
    assert restored.meta["rng"] == {"seed": 0} and restored.meta["rules"] == "fsdp+tp"
    assert restored.meta["mesh"]["axes"]["tensor"] == 2
    assert restored.data["grain"]["next_index"] == 6
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(second.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nan_batch_skips_the_update_but_its_counters_advance():
    data = _arrays()
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    rules = rules_for("fsdp+tp", mesh)
    tx = make_optimizer(OPTIM, 10)
    ctor = lambda: build_model(MLP, seed=0)  # noqa: E731
    _, state, _, step = state_and_step(ctor, tx, mesh, rules, batch_structs(data))
    batch = next(data.train_iter())
    good = jax.device_get(state)
    for poison in ("nan", "inf"):
        bad = dict(batch, inputs=batch["inputs"].copy())
        bad["inputs"][5, 2] = np.nan if poison == "nan" else np.inf
        before = jax.device_get(state)
        state, metrics = step(state, shard_batch(bad, mesh, rules))
        assert int(metrics["skipped"]) == 1, poison
        assert not np.isfinite(float(metrics["loss"])) or not np.isfinite(
            float(metrics["grad_norm"])
        )
        after = jax.device_get(state)
        assert after.step == before.step + 1  # the step counts the batch consumed
        counters = 0
        for a, b in zip(jax.tree.leaves(after[1:]), jax.tree.leaves(before[1:]), strict=True):
            if np.issubdtype(a.dtype, np.integer):  # optax's step counters follow the step
                assert a == after.step and b == before.step
                counters += 1
            else:
                np.testing.assert_array_equal(a, b)  # params, moments, variables: untouched
        assert counters == 2  # AdamW's schedule and bias-correction counts
    state, metrics = step(state, shard_batch(batch, mesh, rules))
    assert int(metrics["skipped"]) == 0 and np.isfinite(float(metrics["loss"]))
    moved = jax.device_get(state.params)
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(good.params), strict=True)
    )


def test_trainer_counts_skipped_steps_and_stops_after_k_in_a_row(tmp_path):
    # Some NaN rows: exactly the batches that hold one are skipped, and counted.
    nan_rows = range(0, 256, 37)
    data = _arrays(nan_rows)
    it = data.train_iter()
    expected = [bool(np.isnan(next(it)["inputs"]).any()) for _ in range(12)]
    assert 0 < sum(expected) < 12 and not any(all(expected[i : i + 3]) for i in range(10))
    trainer = _mlp_trainer(data, "", steps=12, max_bad_steps=3)
    history = trainer.fit()
    assert [bool(e["skipped"]) for e in history] == expected
    assert trainer.skipped_steps == sum(expected) == history[-1]["skipped_steps"]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(trainer.state))

    # Every row NaN after a good start: K bad steps in a row stop training cleanly, naming
    # the last checkpoint written before the bad steps.
    good = _mlp_trainer(_arrays(), tmp_path, steps=20, checkpoint=CheckpointConfig(save_every=1))
    good.fit(until=2)
    good.checkpoints.close()
    bad = _mlp_trainer(
        _arrays(range(256)),
        tmp_path,
        steps=20,
        max_bad_steps=3,
        checkpoint=CheckpointConfig(save_every=1, resume=True),
    )
    with pytest.raises(NonFiniteError) as err:
        bad.fit()
    bad.checkpoints.close()
    message = str(err.value)
    assert "3 consecutive steps (3–5) had a non-finite loss or gradient" in message, message
    assert f"last good checkpoint: {tmp_path / 'checkpoints' / '2'} (step 2)" in message, message
