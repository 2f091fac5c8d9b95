"""Client partitions: every example once, the same for the same seed, and the label skew the
Dirichlet concentration asks for, measured on the digits; client data in the pipeline: block r
of a batch from client r alone, the same batches from (seed, step) on any process count and
after a resume, and its settings' problems one line each."""

import dataclasses
import json

import numpy as np
import pytest

from meshtrain.check import check_run
from meshtrain.data import DataConfig, make_dataset, prepare_corpus
from meshtrain.data.batches import Windows
from meshtrain.data.clients import client_problems, dirichlet_partition, example_groups, group_skew
from meshtrain.data.images import digits
from meshtrain.layout import rules_for
from meshtrain.mesh import make_mesh
from meshtrain.models import MLPConfig
from meshtrain.problem import RunCheckError
from meshtrain.replicas import SyncConfig
from meshtrain.run import RunSpec, TrainConfig
from meshtrain.train.trainer import Trainer


def _labels():
    return digits()[1]


def test_every_example_goes_to_exactly_one_client():
    labels = _labels()
    seed = int(np.random.default_rng().integers(1 << 30))
    for alpha in (0.1, 1.0, 100.0):
        parts = dirichlet_partition(labels, 8, alpha, seed=seed)
        assert len(parts) == 8 and min(len(p) for p in parts) >= 1
        everything = np.concatenate(parts)
        np.testing.assert_array_equal(np.sort(everything), np.arange(len(labels)))


def test_the_partition_is_a_function_of_its_seed():
    labels = _labels()
    seed = int(np.random.default_rng().integers(1 << 30))
    a = dirichlet_partition(labels, 8, 0.1, seed=seed)
    b = dirichlet_partition(labels, 8, 0.1, seed=seed)
    c = dirichlet_partition(labels, 8, 0.1, seed=seed + 1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_label_skew_follows_the_concentration():
    """Over seeds 0-299 on the digits (10 labels, 8 clients), α = 0.1 skewed at least 0.51,
    α = 1 between 0.25 and 0.43, α = 100 at most 0.047 (total variation to the whole)."""
    labels = _labels()
    seed = int(np.random.default_rng().integers(1 << 30))
    skew = {
        a: group_skew(dirichlet_partition(labels, 8, a, seed=seed), labels) for a in (0.1, 1, 100)
    }
    assert skew[0.1] > 0.45 > skew[1] > 0.2 > 0.08 > skew[100]
    # α = 0.1: most clients hold mostly one or two labels
    parts = dirichlet_partition(labels, 8, 0.1, seed=seed)
    top2 = [np.sort(np.bincount(labels[p], minlength=10))[-2:].sum() / len(p) for p in parts]
    assert np.median(top2) > 0.6
    # a partition into one client is the whole dataset: no skew
    assert group_skew(dirichlet_partition(labels, 1, 0.1, seed=seed), labels) == pytest.approx(0)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"clients": 0, "alpha": 1.0}, "clients=0: must be a positive integer"),
        ({"clients": 8, "alpha": 0.0}, "alpha=0.0: the Dirichlet concentration must be > 0"),
        ({"clients": 8, "alpha": 1.0, "min_examples": 300}, "min_examples=300: 8 clients need"),
        ({"clients": 64, "alpha": 0.001, "min_examples": 20}, "alpha=0.001: in 100 draws"),
    ],
)
def test_bad_arguments_are_one_line(kw, needle):
    with pytest.raises(ValueError, match="^" + needle.split(":")[0]) as e:
        dirichlet_partition(_labels(), seed=0, **kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---- client data in the pipeline (DataConfig.client_alpha) ----------------------------------

CLIENTS, BATCH = 8, 32  # 4 rows per client


def _indexed(tmp_path, alpha, **kw):
    """The digits' labels as an arrays dataset whose one feature is each row's index."""
    labels = _labels()
    path = tmp_path / "indexed.npz"
    np.savez(path, inputs=np.arange(len(labels), dtype=np.float32)[:, None], targets=labels)
    cfg = DataConfig(source="arrays", path=str(path), batch_size=BATCH, val_fraction=0, **kw)
    return make_dataset(dataclasses.replace(cfg, client_alpha=alpha)), labels


def _rows(batches) -> list[np.ndarray]:
    """Each batch's example indices (the indexed dataset's feature)."""
    return [b["inputs"][:, 0].astype(int) for b in batches]


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_a_datasets_client_parts_cover_every_example_once_with_the_requested_skew(tmp_path):
    skew = {}
    for alpha in (0.1, 100.0):
        data, labels = _indexed(tmp_path, alpha, seed=int(np.random.default_rng().integers(99)))
        parts = data.client_partition(CLIENTS)
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))
        assert min(len(p) for p in parts) >= BATCH // CLIENTS  # every client fills its rows
        it = data.train_iter(clients=CLIENTS)
        drawn = np.stack(_rows(_take(it, 60)))  # [steps, B]
        it.close()
        # the rows each client trained on, measured: their labels against the whole set's
        seen = [drawn[:, r * 4 : (r + 1) * 4].ravel() for r in range(CLIENTS)]
        skew[alpha] = (group_skew(parts, labels), group_skew(seen, labels))
    assert skew[0.1][0] > 0.45 and skew[0.1][1] > 0.45
    assert skew[100.0][0] < 0.08 and skew[100.0][1] < 0.1  # 240 rows a client: some noise


def test_block_r_of_every_batch_holds_client_rs_examples_only(tmp_path):
    data, _ = _indexed(tmp_path, 0.1)
    parts = data.client_partition(CLIENTS)
    it = data.train_iter(clients=CLIENTS)
    for rows in _rows(_take(it, 20)):
        for r, block in enumerate(rows.reshape(CLIENTS, BATCH // CLIENTS)):
            assert np.isin(block, parts[r]).all() and len(set(block)) == len(block)
    it.close()


def test_client_batches_are_deterministic_and_resume_exactly(tmp_path):
    data, _ = _indexed(tmp_path, 0.3, seed=5)
    assert min(len(p) for p in data.client_partition(CLIENTS)) < 37 * 4
    first = data.train_iter(clients=CLIENTS)
    _take(first, 37)  # past the smallest client's first epoch
    state = json.loads(json.dumps(first.get_state()))
    want = _rows(_take(first, 30))
    first.close()
    again, _ = _indexed(tmp_path, 0.3, seed=5)
    replay = again.train_iter(clients=CLIENTS)
    _take(replay, 37)
    np.testing.assert_array_equal(np.stack(_rows(_take(replay, 30))), np.stack(want))
    replay.close()
    resumed = again.train_iter(clients=CLIENTS)
    resumed.set_state(state)
    np.testing.assert_array_equal(np.stack(_rows(_take(resumed, 30))), np.stack(want))
    resumed.close()
    # processes reading rows [0, 10), [10, 22), [22, 32) (cutting blocks) from the saved
    # position make up the same global batches
    pieces = []
    for rows in ((0, 10), (10, 22), (22, 32)):
        local = again.train_iter(rows, clients=CLIENTS)
        local.set_state(state)
        pieces.append(np.stack(_rows(_take(local, 30))))
        local.close()
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), np.stack(want))


def test_a_position_resumes_only_onto_the_same_client_settings(tmp_path):
    data, _ = _indexed(tmp_path, 0.3)
    it = data.train_iter(clients=CLIENTS)
    next(it)
    state = it.get_state()
    it.close()
    other, _ = _indexed(tmp_path, 1.0)
    plain, _ = _indexed(tmp_path, None)
    for iterator, needle in (
        (other.train_iter(clients=CLIENTS), "client_alpha=0.3 but this dataset has client_alpha=1"),
        (data.train_iter(clients=4), "clients=8 but this dataset has clients=4"),
        (plain.train_iter(), "client_alpha=0.3 but this dataset has no client_alpha"),
    ):
        with pytest.raises(ValueError, match=needle):
            iterator.set_state(state)
        iterator.close()


def test_groups_are_labels_documents_or_spans(tmp_path):
    tokens = np.arange(1000) % 256
    assert np.array_equal(example_groups(Windows(tokens, 10), 2), np.arange(99) * 16 // 99)
    docs = tmp_path / "docs.jsonl"
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 400, 60)
    docs.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in lengths))
    prepare_corpus([str(docs)], str(tmp_path / "corpus"), workers=1, progress=False)
    cfg = DataConfig(source="tokens", path=str(tmp_path / "corpus"), seq_len=16, batch_size=16)
    data = make_dataset(dataclasses.replace(cfg, client_alpha=0.1, val_fraction=0))
    offsets = np.asarray(data._train.corpus.doc_offsets)
    groups = example_groups(data._train, 4)
    starts = np.arange(data.num_train) * 16
    assert ((offsets[groups] <= starts) & (starts < offsets[groups + 1])).all()
    parts = data.client_partition(4)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(data.num_train))
    assert group_skew(parts, groups) > 0.5  # a document's windows stay mostly with one client


def test_client_alpha_and_its_pairs_are_one_line_each(tmp_path):
    with pytest.raises(RunCheckError) as err:
        DataConfig(client_alpha=0.0)
    assert str(err.value).startswith("data.client_alpha=0.0: must be a number > 0")
    assert "--data.client-alpha 0.1" in str(err.value) and "\n" not in str(err.value)
    data = DataConfig(source="digits", batch_size=BATCH, client_alpha=0.1)
    (line,) = client_problems(data.client_alpha, SyncConfig().local)
    assert str(line) == (
        "data.client_alpha=0.1: client data needs replicas that step apart: add "
        "--client-fraction, --gossip or --sync-every"
    )
    assert str(line) in map(str, check_run(RunSpec(data=data, mesh={"data": 8})))
    for sync in (SyncConfig(sync_every=4), SyncConfig(client_fraction=0.5, sync_every=2)):
        assert not client_problems(data.client_alpha, sync.local)
    indexed, _ = _indexed(tmp_path, 0.1)
    with pytest.raises(ValueError, match="batch_size=32: not divisible by the 6 clients"):
        indexed.train_iter(clients=6)
    with pytest.raises(
        ValueError, match=r"client_alpha=0.001: in 100 draws some of the 16 clients"
    ):
        _indexed(tmp_path, 0.001)[0].train_iter(clients=16)


def test_the_trainer_makes_each_replica_a_client():
    """Under hsdp on data=2 × fsdp=4 the replicas are the two data rows: two clients."""
    data = make_dataset(DataConfig(source="digits", batch_size=BATCH, client_alpha=0.1))
    mesh = make_mesh("data=2,fsdp=4")
    trainer = Trainer(
        run=RunSpec(
            model=MLPConfig(num_features=64, num_classes=10, d_model=16, d_hidden=32),
            data=data,
            mesh=mesh,
            rules=rules_for("hsdp", mesh),
            sync=SyncConfig(sync_every=2),
            train=TrainConfig(steps=1, progress=False),
        )
    )
    assert trainer._iter.get_state()["clients"] == 2
    want = next(data.train_iter(clients=2))
    np.testing.assert_array_equal(next(trainer._iter)["targets"], want["targets"])
