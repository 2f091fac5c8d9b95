"""Tests for meshtrain.data: corpora, batching, determinism, resume, sharding, validation."""

import json
import time

import numpy as np
import pytest

from meshtrain import data
from meshtrain.data import DataConfig, make_arrays_dataset, make_dataset

SMALL = dict(source="stdlib", max_bytes=60_000, seq_len=16, batch_size=8)


def _take(it, n):
    """The next n batches of an iterator."""
    return [next(it) for _ in range(n)]


def _rows(batches):
    """All (inputs, targets) rows of a list of LM batches, as bytes windows."""
    return [
        bytes(np.append(x, y[-1]).astype(np.uint8))
        for b in batches
        for x, y in zip(b["inputs"], b["targets"], strict=True)
    ]


def _windows(tokens: bytes, seq_len: int) -> list[bytes]:
    """All non-overlapping windows of seq_len+1 bytes, starting at multiples of seq_len."""
    return [tokens[s : s + seq_len + 1] for s in range(0, len(tokens) - seq_len, seq_len)]


def _split(corpus: bytes, val_fraction: float) -> int:
    """Index where the held-out tail starts."""
    return len(corpus) - int(len(corpus) * val_fraction)


def _cond_entropy_bits(tokens: np.ndarray) -> float:
    """Empirical entropy of a byte given the two bytes before it."""
    t = tokens.astype(np.int64)
    ctx = t[:-2] * 256 + t[1:-1]
    joint = ctx * 256 + t[2:]
    _, jc = np.unique(joint, return_counts=True)
    _, cc = np.unique(ctx, return_counts=True)
    n = len(joint)
    return float(-(jc / n * np.log2(jc / n)).sum() + (cc / n * np.log2(cc / n)).sum())


def test_stdlib_corpus():
    data.stdlib_corpus.cache_clear()
    text = data.stdlib_corpus(200_000)
    data.stdlib_corpus.cache_clear()
    assert data.stdlib_corpus(200_000) == text
    assert 0 < len(text) <= 200_000
    assert len(data.stdlib_corpus(1000)) == 1000
    assert data.stdlib_corpus(300_000)[:200_000] == text  # a bigger cap extends, same order
    ascii_share = np.mean(np.frombuffer(text, dtype=np.uint8) < 128)
    assert ascii_share > 0.98
    assert b"def " in text and b"import " in text and b"site-packages/" not in text


def test_construction_is_fast():
    data.stdlib_corpus.cache_clear()
    start = time.perf_counter()
    ds = make_dataset(DataConfig())
    assert time.perf_counter() - start < 2.0
    assert ds.kind == "lm" and ds.vocab_size == 256 and ds.num_features is None


def test_lm_batches_are_shifted_train_windows():
    cfg = DataConfig(**SMALL)
    ds = make_dataset(cfg)
    batches = _take(ds.train_iter(), 5)
    for b in batches:
        assert b["inputs"].shape == b["targets"].shape == (8, 16)
        assert b["inputs"].dtype == b["targets"].dtype == np.int32
        np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    corpus = data.stdlib_corpus(cfg.max_bytes)
    train = set(_windows(corpus[: _split(corpus, cfg.val_fraction)], cfg.seq_len))
    assert ds.num_train == len(_windows(corpus[: _split(corpus, cfg.val_fraction)], 16))
    assert all(row in train for row in _rows(batches))


def test_each_epoch_is_a_fresh_permutation():
    cfg = DataConfig(**{**SMALL, "max_bytes": 8_000})
    ds = make_dataset(cfg)
    corpus = data.stdlib_corpus(cfg.max_bytes)
    n = ds.num_train
    rows = _rows(_take(ds.train_iter(), -(-2 * n // cfg.batch_size)))
    first, second = rows[:n], rows[n : 2 * n]
    expected = sorted(_windows(corpus[: _split(corpus, cfg.val_fraction)], cfg.seq_len))
    assert sorted(first) == expected and sorted(second) == expected
    assert first != second
    assert first != sorted(first)


def test_same_seed_same_batches_different_seed_differs():
    a = _take(make_dataset(DataConfig(**SMALL, seed=3)).train_iter(), 4)
    b = _take(make_dataset(DataConfig(**SMALL, seed=3)).train_iter(), 4)
    c = _take(make_dataset(DataConfig(**SMALL, seed=4)).train_iter(), 4)
    assert _rows(a) == _rows(b)
    assert _rows(a) != _rows(c)


@pytest.mark.parametrize("k", [0, 1, 7])
def test_get_set_state_resumes_exactly(k):
    ds = make_dataset(DataConfig(**SMALL, seed=5))
    it = ds.train_iter()
    _take(it, k)
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 5)
    fresh = make_dataset(DataConfig(**SMALL, seed=5)).train_iter()
    _take(fresh, 3)  # moved elsewhere first; set_state must override
    fresh.set_state(state)
    assert _rows(_take(fresh, 5)) == _rows(expected)
    other = make_dataset(DataConfig(**SMALL, seed=6)).train_iter()
    with pytest.raises(ValueError, match="seed=5"):
        other.set_state(state)


def test_eval_batches_are_fixed_and_held_out():
    cfg = DataConfig(**SMALL, val_fraction=0.1)
    ds = make_dataset(cfg)
    first, again = ds.eval_batches(3), ds.eval_batches(3)
    assert len(first) == 3
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"], b["targets"])
        assert a["inputs"].shape == (8, 16)
    corpus = data.stdlib_corpus(cfg.max_bytes)
    split = _split(corpus, cfg.val_fraction)
    val = _windows(corpus[split:], cfg.seq_len)
    assert ds.num_val == len(val)
    assert _rows(first) == [val[i % len(val)] for i in range(24)]
    assert all(corpus.find(row, split) >= split for row in _rows(first))
    with pytest.raises(ValueError, match="positive integer"):
        ds.eval_batches(0)
    no_val = make_dataset(DataConfig(**SMALL, val_fraction=0.0))
    with pytest.raises(ValueError, match="val_fraction"):
        no_val.eval_batches(1)


def test_eval_disjoint_from_a_full_train_epoch(tmp_path):
    path = tmp_path / "numbered.txt"
    path.write_text("".join(f"row {i:05d};" for i in range(3000)))  # no window repeats
    ds = make_dataset(DataConfig(source="text", path=str(path), seq_len=12, batch_size=10))
    train = set(_rows(_take(ds.train_iter(), -(-ds.num_train // 10))))
    held_out = set(_rows(ds.eval_batches(-(-ds.num_val // 10))))
    assert len(train) == ds.num_train and len(held_out) == ds.num_val
    assert not train & held_out


def test_text_source_and_codec(tmp_path):
    text = "".join(f"line {i}: héllo wörld {i * i}\n" for i in range(400))
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    ds = make_dataset(DataConfig(source="text", path=str(path), seq_len=24, batch_size=4))
    raw = text.encode("utf-8")
    train = set(_windows(raw[: _split(raw, 0.05)], 24))
    assert all(row in train for row in _rows(_take(ds.train_iter(), 3)))
    tokens = ds.encode("héllo")
    assert tokens.dtype == np.int32 and len(tokens) == 6
    assert ds.decode(tokens) == "héllo"
    assert ds.decode([104, 0xC3]) == "h\ufffd"
    with pytest.raises(ValueError, match="256"):
        ds.decode([300])


def test_synthetic_source_is_learnable():
    ds = make_dataset(DataConfig(source="synthetic", seq_len=64, batch_size=16, seed=1))
    corpus = np.frombuffer(data.synthetic_corpus(1), dtype=np.uint8)
    assert 100_000 <= len(corpus) <= 1_000_000
    assert _cond_entropy_bits(corpus) < 2.0  # far below 8 bits for uniform bytes
    assert data.synthetic_corpus(1) == data.synthetic_corpus(1) != data.synthetic_corpus(2)
    b = next(ds.train_iter())
    assert b["inputs"].shape == (16, 64) and ds.vocab_size == 256


def _classify_arrays(n=100, features=5, classes=3):
    """Inputs whose first column is the row number; targets derived from it."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, features))
    x[:, 0] = np.arange(n)
    return x, np.arange(n) % classes


def _check_classify(ds, n=100, batch=10):
    """Batches are consistent rows of the arrays; eval is the tail."""
    assert ds.kind == "classify" and ds.vocab_size == 3 and ds.num_features == 5
    seen = []
    for b in _take(ds.train_iter(), 9):
        assert b["inputs"].shape == (batch, 5) and b["inputs"].dtype == np.float32
        assert b["targets"].shape == (batch,) and b["targets"].dtype == np.int32
        np.testing.assert_array_equal(b["inputs"][:, 0].astype(int) % 3, b["targets"])
        seen.extend(b["inputs"][:, 0].astype(int))
    assert sorted(seen) == list(range(90))
    ev = ds.eval_batches(2)
    np.testing.assert_array_equal(ev[0]["inputs"][:, 0], np.arange(90, 100))
    np.testing.assert_array_equal(ev[0]["inputs"], ev[1]["inputs"])


def test_arrays_classify_from_numpy_and_npz(tmp_path):
    x, y = _classify_arrays()
    _check_classify(make_arrays_dataset(x, y, batch_size=10, val_fraction=0.1))
    path = tmp_path / "d.npz"
    np.savez(path, inputs=x, targets=y)
    _check_classify(
        make_dataset(DataConfig(source="arrays", path=str(path), batch_size=10, val_fraction=0.1))
    )


def test_arrays_lm(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=(40, 9))
    x, y = tokens[:, :-1], tokens[:, 1:]
    ds = make_arrays_dataset(x, y, batch_size=4, seed=2, val_fraction=0.25, seq_len=8)
    assert ds.kind == "lm" and ds.seq_len == 8 and ds.num_features is None
    assert ds.vocab_size == tokens.max() + 1
    rows = {bytes(r.astype(np.uint8)) for r in tokens[:30]}
    for b in _take(ds.train_iter(), 10):
        assert b["inputs"].dtype == np.int32 and b["inputs"].shape == (4, 8)
        assert set(_rows([b])) <= rows
    np.testing.assert_array_equal(ds.eval_batches(1)[0]["inputs"], x[30:34])
    path = tmp_path / "lm.npz"
    np.savez(path, inputs=x, targets=y)
    from_file = make_dataset(DataConfig(source="arrays", path=str(path), batch_size=4, seed=2))
    assert from_file.kind == "lm" and from_file.seq_len == 8


@pytest.mark.parametrize("count", [2, 4])
def test_process_slices_form_the_global_batch(monkeypatch, count):
    cfg = DataConfig(**SMALL, seed=9)
    it = make_dataset(cfg).train_iter()
    _take(it, 2)
    state = it.get_state()
    global_batches = _take(it, 3)
    global_eval = make_dataset(cfg).eval_batches(2)
    local, local_eval = [], []
    for p in range(count):
        monkeypatch.setattr(data.batches, "process_shard", lambda p=p: (p, count))
        ds = make_dataset(cfg)
        assert ds.local_batch_size == cfg.batch_size // count
        pit = ds.train_iter()
        pit.set_state(state)  # a single-process position resumes on any process count
        local.append(_take(pit, 3))
        local_eval.append(ds.eval_batches(2))
    for step, want in enumerate(global_batches):
        got = np.concatenate([local[p][step]["inputs"] for p in range(count)])
        np.testing.assert_array_equal(got, want["inputs"])
    for step, want in enumerate(global_eval):
        got = np.concatenate([local_eval[p][step]["targets"] for p in range(count)])
        np.testing.assert_array_equal(got, want["targets"])
    monkeypatch.setattr(data.batches, "process_shard", lambda: (0, 3))
    with pytest.raises(ValueError, match="not divisible by jax.process_count"):
        make_dataset(cfg)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(source="bogus"), "source='bogus'.*stdlib, synthetic, text, arrays"),
        (dict(source="text"), "source='text': needs --data.path"),
        (dict(source="arrays"), "source='arrays': needs --data.path"),
        (dict(batch_size=0), "batch_size=0: must be a positive integer"),
        (dict(batch_size=True), "batch_size=True"),
        (dict(seq_len=0), "seq_len=0: must be a positive integer"),
        (dict(val_fraction=1.0), r"val_fraction=1.0: must be a number in \[0, 1\)"),
        (dict(val_fraction=-0.1), "val_fraction=-0.1"),
        (dict(seed=-1), "seed=-1"),
        (dict(max_bytes=0), "max_bytes=0"),
        # A path with a source that reads no file names the source that would read it.
        (dict(path="notes.txt"), r"path='notes.txt'.*source='stdlib'.*--data.source text"),
        (dict(source="synthetic", path="xy.npz"), r"--data.source arrays"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


def test_dataset_errors(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("x" * 1000)
    cfg = DataConfig(source="text", path=str(small), seq_len=32, batch_size=64)
    with pytest.raises(ValueError, match=r"has 29 train windows of seq_len\+1=33.*batch_size=64"):
        make_dataset(cfg)
    cfg = DataConfig(source="text", path=str(small), seq_len=64, batch_size=2, val_fraction=0.01)
    with pytest.raises(ValueError, match="held-out tail has 10 bytes"):
        make_dataset(cfg)
    with pytest.raises(ValueError, match="no such file"):
        make_dataset(DataConfig(source="text", path=str(tmp_path / "missing.txt")))
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros(3))
    with pytest.raises(ValueError, match=r"lacks \['inputs', 'targets'\]"):
        make_dataset(DataConfig(source="arrays", path=str(bad)))


def _one_line(error) -> str:
    """The message of a ValueError, checked to be one line without numpy's pickle advice."""
    message = str(error.value)
    assert "\n" not in message and "pickle" not in message, message
    return message


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (b"hello there\n", "it looks like text"),
        (b"", "it is empty"),
        (b"PK\x03\x04 not really a zip", "a damaged zip"),
        ("npy", "a single .npy array"),
    ],
)
def test_arrays_source_on_a_file_that_is_not_an_npz(tmp_path, content, what):
    path = tmp_path / ("x.npy" if content == "npy" else "notes.txt")
    if content == "npy":
        np.save(path, np.zeros(3))
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        make_dataset(DataConfig(source="arrays", path=str(path)))
    message = _one_line(err)
    assert message.startswith(f"data.path={str(path)!r} is not an .npz archive"), message
    assert what in message and "np.savez(path, inputs=..., targets=...)" in message, message
    objects = tmp_path / "objects.npz"
    np.savez(objects, inputs=np.array([object()] * 3), targets=np.zeros(3, int))
    with pytest.raises(ValueError) as err:
        make_dataset(DataConfig(source="arrays", path=str(objects)))
    assert "'inputs' holds Python objects" in _one_line(err)


def test_an_empty_or_tiny_file_names_the_file_its_size_and_the_fix(tmp_path):
    def refusal(name, content):
        """The one-line message that refuses a text file holding `content`."""
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError) as err:
            make_dataset(DataConfig(source="text", path=str(path)))
        return str(path), _one_line(err)

    path, message = refusal("empty.txt", b"")
    # Defaults: 32 windows of 129 bytes for training plus a 5 % tail of at least 129 bytes.
    assert f"data.path={path!r} is empty (0 bytes)" in message, message
    assert "at least 4312 bytes" in message, message
    path, message = refusal("tiny.txt", b"hello there\n")
    assert f"data.path={path!r} holds 12 bytes" in message, message
    assert "at least 4312 bytes" in message and "lower seq_len" in message, message
    # The size the message asks for is enough, and one byte less is not.
    need = tmp_path / "need.txt"
    need.write_bytes(b"x" * 4312)
    make_dataset(DataConfig(source="text", path=str(need)))
    need.write_bytes(b"x" * 4311)
    with pytest.raises(ValueError, match="at least 4312 bytes"):
        make_dataset(DataConfig(source="text", path=str(need)))
    # The same for an .npz with too few rows.
    rows = tmp_path / "rows.npz"
    np.savez(rows, inputs=np.zeros((0, 3)), targets=np.zeros(0, int))
    with pytest.raises(ValueError) as err:
        make_dataset(DataConfig(source="arrays", path=str(rows), batch_size=4))
    message = _one_line(err)
    assert f"data.path={str(rows)!r} has no rows" in message and "at least 20 rows" in message
    np.savez(rows, inputs=np.zeros((3, 3)), targets=np.zeros(3, int))
    with pytest.raises(ValueError) as err:
        make_dataset(DataConfig(source="arrays", path=str(rows), batch_size=4, val_fraction=0))
    message = _one_line(err)
    assert f"data.path={str(rows)!r} has 3 rows" in message and "batch_size=4" in message
    assert "at least 4 rows" in message, message
    np.savez(rows, inputs=np.zeros((19, 3)), targets=np.zeros(19, int))
    with pytest.raises(ValueError, match="holds out none.*at least 20 rows"):
        make_dataset(DataConfig(source="arrays", path=str(rows), batch_size=4))
    np.savez(rows, inputs=np.zeros((20, 3)), targets=np.zeros(20, int))
    make_dataset(DataConfig(source="arrays", path=str(rows), batch_size=4))


@pytest.mark.parametrize(
    ("x", "y", "match"),
    [
        (np.zeros((10, 3)), np.zeros(9, int), "10 rows but targets has 9"),
        (np.zeros((10, 3)), np.zeros(10), "targets dtype float64 must be integer"),
        (np.zeros((10, 3)), -np.ones(10, int), "non-negative"),
        (np.zeros(10), np.zeros(10, int), "numeric"),
        (np.zeros((10, 4)), np.zeros((10, 4), int), "lm inputs must be integer"),
        (np.zeros((10, 4, 2)), np.zeros((10, 4, 2), int), "1-D class ids or 2-D token ids"),
        (np.zeros((10, 3)), np.zeros(10, int), "fewer than batch_size=16"),
    ],
)
def test_arrays_validation(x, y, match):
    with pytest.raises(ValueError, match=match):
        make_arrays_dataset(x, y, batch_size=16 if "16" in match else 2, val_fraction=0.1)


def test_arrays_misc_errors():
    x, y = _classify_arrays()
    with pytest.raises(ValueError, match="vocab_size=2"):
        make_arrays_dataset(x, y, batch_size=4, vocab_size=2)
    with pytest.raises(ValueError, match="holds out none"):
        make_arrays_dataset(x, y, batch_size=4, val_fraction=0.001)
    with pytest.raises(ValueError, match="seq_len=4: the arrays have T=8"):
        make_arrays_dataset(np.zeros((20, 8), int), np.zeros((20, 8), int), batch_size=4, seq_len=4)
    with pytest.raises(ValueError, match="only for LM"):
        make_arrays_dataset(x, y, batch_size=4).encode("hi")
