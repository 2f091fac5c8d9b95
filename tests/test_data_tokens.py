"""`prepare` and the ``tokens`` source: the same tokens as in memory, a no-op second run,
streaming that reads only the batch's rows, per-process rows, exact resume, packing, and bad
input in one line."""

import json
import math
import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshtrain import data
from meshtrain.data import DataConfig, make_dataset, prepare_corpus, train_bpe
from meshtrain.data.packing import pack_rows
from meshtrain.data.text import stdlib_corpus


def _docs(seed: int, n: int) -> list[str]:
    """`n` random slices of the stdlib corpus, as documents of 0 to 600 characters."""
    corpus = stdlib_corpus(300_000).decode("utf-8", errors="replace")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = rng.randrange(len(corpus) - 700)
        out.append(corpus[s : s + rng.choice([0, rng.randrange(1, 600)])])
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A text file, a JSONL and a Parquet file of fresh documents, and a BPE trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    seed = random.randrange(10**6)
    text, rows, cells = "\n".join(_docs(seed, 30)), _docs(seed + 1, 40), _docs(seed + 2, 30)
    (root / "a.txt").write_text(text, encoding="utf-8")
    with open(root / "b.jsonl", "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"id": i, "body": row}) + ("\n\n" if i == 3 else "\n"))
    pq.write_table(
        pa.table({"n": list(range(len(cells))), "body": cells}),
        root / "c.parquet",
        row_group_size=7,
    )
    tok = train_bpe([text, *rows, *cells], vocab_size=320)
    tok.save(str(root / "tok"))
    return {"root": root, "docs": [text, *rows, *cells], "tok": tok}


def _reference(tok, docs) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and document offsets, tokenising each non-empty document in memory."""
    ids = [tok.encode(d) + [tok.eos_id] for d in docs if d]
    return np.concatenate(ids), np.cumsum([0] + [len(i) for i in ids])


def _read(out, manifest) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.fromfile(out / "tokens.bin", dtype=manifest["dtype"])
    return tokens, np.fromfile(out / "documents.bin", dtype=np.int64)


def _prepare(files, out, **kw):
    root = files["root"]
    inputs = [str(root / n) for n in ("a.txt", "b.jsonl", "c.parquet")]
    kw = {"tokenizer": str(root / "tok"), "field": "body", "column": "body", **kw}
    return prepare_corpus(inputs, str(out), progress=False, chunk_bytes=1024, **kw)


@pytest.fixture(scope="module")
def prepared(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    return out, _prepare(files, out, workers=1)


def test_prepare_text_jsonl_parquet_equals_tokenising_in_memory(files, prepared, tmp_path):
    want_tokens, want_offsets = _reference(files["tok"], files["docs"])
    out, manifest = prepared
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["vocab_size"] == 320
    assert manifest["num_tokens"] == len(want_tokens)
    assert manifest["num_documents"] == len(want_offsets) - 1
    tokens, offsets = _read(out, manifest)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_array_equal(offsets, want_offsets)
    # Two worker processes (text cut into 1 KiB pieces across them): the same bytes.
    pooled = _prepare(files, tmp_path, workers=2)
    assert pooled["tokens_sha256"] == manifest["tokens_sha256"]
    np.testing.assert_array_equal(_read(tmp_path, pooled)[1], want_offsets)


def test_a_second_prepare_is_a_no_op_until_an_input_changes(files, tmp_path):
    first = _prepare(files, tmp_path, workers=1)
    stamp = os.stat(tmp_path / "tokens.bin").st_mtime_ns
    again = _prepare(files, tmp_path, workers=1)
    assert again["up_to_date"] and not first["up_to_date"]
    assert os.stat(tmp_path / "tokens.bin").st_mtime_ns == stamp
    changed, out = tmp_path / "in.txt", tmp_path / "out"
    changed.write_text("hello there\n")
    one = prepare_corpus([str(changed)], str(out), progress=False)
    changed.write_text("hello therE\n")
    two = prepare_corpus([str(changed)], str(out), progress=False)
    assert not one["up_to_date"] and not two["up_to_date"]
    assert one["input_hash"] != two["input_hash"]
    assert np.fromfile(out / "tokens.bin", np.uint8)[-1] == ord("\n")


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A byte-level corpus of ~1 MB in many documents, 16× the memory cap the test sets."""
    root = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(random.randrange(10**6))
    with open(root / "docs.jsonl", "w") as f:
        while f.tell() < 1_000_000:
            n = int(rng.integers(1, 300))
            f.write(json.dumps({"text": bytes(rng.integers(97, 123, n).astype(np.uint8)).decode()}))
            f.write("\n")
    prepare_corpus([str(root / "docs.jsonl")], str(root / "out"), workers=1, progress=False)
    return root / "out"


CAP = 32 * 1024  # the loader may read this much of a ~1 MB corpus over the batches below
SMALL = dict(source="tokens", seq_len=32, batch_size=8, seed=3, val_fraction=0.01)


def _record(ds) -> list[tuple[np.ndarray, int]]:
    """Logs each read of `ds`'s training windows: (window indices, bytes it read)."""
    log, take = [], ds._train.take

    def recorded(idx):
        before = ds._train.bytes_read
        out = take(idx)
        log.append((np.asarray(idx).copy(), ds._train.bytes_read - before))
        return out

    ds._train.take = recorded
    return log


def test_streaming_reads_only_the_windows_of_its_batches(big):
    ds = make_dataset(DataConfig(path=str(big), **SMALL))
    size = os.path.getsize(big / "tokens.bin")
    assert size > 16 * CAP  # the corpus is far larger than the cap
    log = _record(ds)
    it = ds.train_iter()
    batches = [next(it) for _ in range(20)]
    it.close()  # grain may have read a batch or two ahead: those count too
    assert ds._train.bytes_read <= CAP
    whole = np.fromfile(big / "tokens.bin", np.uint8)  # the test's own copy, to compare
    for (idx, read), batch in zip(log, batches, strict=False):
        rows = whole[idx[:, None] * 32 + np.arange(33)]
        np.testing.assert_array_equal(batch["inputs"], rows[:, :-1])
        np.testing.assert_array_equal(batch["targets"], rows[:, 1:])
        assert 8 * 33 <= read <= 8 * 33 + 8 * 8 * 16  # windows, and offsets inside them


def test_two_processes_read_disjoint_rows_whose_union_is_the_global_batch(big, monkeypatch):
    config = DataConfig(path=str(big), **SMALL)
    whole = make_dataset(config)
    full = _record(whole)
    want = [next(it) for it in [whole.train_iter()] for _ in range(4)]
    parts, logs = [], []
    for p in range(2):
        monkeypatch.setattr(data.batches, "process_shard", lambda p=p: (p, 2))
        ds = make_dataset(config)
        assert ds.local_batch_size == 4
        logs.append(_record(ds))
        it = ds.train_iter()
        parts.append([next(it) for _ in range(4)])
    for step in range(4):
        for key in want[step]:
            got = np.concatenate([parts[0][step][key], parts[1][step][key]])
            np.testing.assert_array_equal(got, want[step][key])
        # each process read only its own windows: disjoint, and together the global batch's
        mine = [set(logs[p][step][0].tolist()) for p in range(2)]
        assert not mine[0] & mine[1] and mine[0] | mine[1] == set(full[step][0].tolist())
        assert logs[0][step][1] + logs[1][step][1] == full[step][1]


def test_resume_is_bit_exact_and_refuses_another_corpus(big, prepared):
    config = DataConfig(path=str(big), **SMALL)
    it = make_dataset(config).train_iter()
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(3)]
    again = make_dataset(config).train_iter()
    again.set_state(state)
    for w in want:
        got = next(again)
        assert set(got) == set(w) == {"inputs", "targets", "segment_ids", "positions"}
        for key in w:
            np.testing.assert_array_equal(got[key], w[key])
    with pytest.raises(ValueError, match="corpus="):
        again.set_state({**state, "corpus": "another"})


def _segments_by_hand(start: int, offsets: np.ndarray, seq_len: int):
    """Segment ids and positions of one row, token by token."""
    doc = [int(np.searchsorted(offsets, start + i, side="right")) - 1 for i in range(seq_len + 1)]
    seg, pos, numbers = [], [], {}
    for i in range(seq_len):
        if doc[i] != doc[i + 1]:
            seg.append(0)
        else:
            seg.append(numbers.setdefault(doc[i], len(numbers) + 1))
        pos.append(start + i - max(int(offsets[doc[i]]), start))
    return seg, pos


def test_packing_segments_and_positions_match_a_hand_count():
    rng = np.random.default_rng(random.randrange(10**6))
    lengths = rng.choice([1, 2, 3, 7, 40, 90], size=200)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    t = 32
    starts = rng.integers(0, offsets[-1] - t - 1, size=50)
    seg, pos, read = pack_rows(starts, offsets, t)
    assert read > 0 and seg.dtype == pos.dtype == np.int32
    for i, s in enumerate(starts):
        want_seg, want_pos = _segments_by_hand(int(s), offsets, t)
        np.testing.assert_array_equal(seg[i], want_seg)
        np.testing.assert_array_equal(pos[i], want_pos)
        assert pos[i].max() < t


def test_packed_rows_mask_the_eos_and_plain_windows_drop_the_keys(files, prepared):
    out, manifest = prepared
    eos = files["tok"].eos_id
    config = DataConfig(source="tokens", path=str(out), seq_len=64, batch_size=4)
    packed = next(make_dataset(config).train_iter())
    # An input is masked (segment 0) exactly where its target starts another document:
    # after this tokenizer's EOS.
    np.testing.assert_array_equal(packed["segment_ids"] == 0, packed["inputs"] == eos)
    ds = make_dataset(
        DataConfig(source="tokens", path=str(out), seq_len=64, batch_size=4, packing=False)
    )
    plain = next(ds.train_iter())
    assert set(plain) == {"inputs", "targets"} and ds.batch_keys == ("inputs", "targets")
    np.testing.assert_array_equal(plain["inputs"], packed["inputs"])
    assert ds.vocab_size == 320 and ds.decode(ds.encode("def f(x):")) == "def f(x):"


def test_eval_path_holds_out_another_prepared_corpus(files, prepared, big, tmp_path):
    out, _ = prepared
    with pytest.raises(ValueError, match="another tokenizer"):
        make_dataset(DataConfig(path=str(out), eval_path=str(big), **SMALL))
    held = tmp_path / "held"
    text = tmp_path / "held.txt"
    text.write_text("".join(_docs(9, 30)))
    prepare_corpus([str(text)], str(held), tokenizer=str(files["root"] / "tok"), progress=False)
    ds = make_dataset(DataConfig(path=str(out), eval_path=str(held), **SMALL))
    assert ds.num_train == (ds._train.corpus.num_tokens - 1) // 32  # nothing held out of train
    tokens = np.fromfile(held / "tokens.bin", np.uint16)
    batch = ds.eval_batches(1)[0]
    np.testing.assert_array_equal(batch["inputs"][1], tokens[32:64])


def test_text_source_with_a_tokenizer_tokenises_in_memory(files):
    root = files["root"]
    config = DataConfig(
        source="text",
        path=str(root / "a.txt"),
        tokenizer=str(root / "tok"),
        seq_len=16,
        batch_size=2,
    )
    ds = make_dataset(config)
    want = files["tok"].encode(files["docs"][0])
    assert ds.vocab_size == 320
    np.testing.assert_array_equal(
        ds.eval_batches(1)[0]["inputs"][0], want[-int(len(want) * 0.05) :][:16]
    )


def test_eval_path_holds_out_a_text_file_for_the_byte_sources(tmp_path):
    held = tmp_path / "held.txt"
    held.write_text("".join(_docs(11, 20)))
    ds = make_dataset(DataConfig(source="synthetic", seq_len=16, batch_size=4, eval_path=str(held)))
    want = np.frombuffer(held.read_bytes(), np.uint8)
    batch = ds.eval_batches(1)[0]
    np.testing.assert_array_equal(batch["inputs"][2], want[32:48])
    assert ds.num_train == (data.SYNTHETIC_BYTES - 1) // 16  # nothing held out of train


# ---- bad input: one line each, before anything compiles ----------------------------------


def _one_line(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message


def test_a_jsonl_without_the_field_is_one_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "a"}\n{"body": "b"}\n')
    for workers in (1, 2):  # found in this process, or in a worker process
        with pytest.raises(ValueError) as e:
            prepare_corpus([str(path)], str(tmp_path / "o"), progress=False, workers=workers)
        _one_line(e, "x.jsonl:2", "no field 'text'", "'body'", "--field")
        assert not [p for p in os.listdir(tmp_path / "o") if "tokens" in p or "documents" in p]
    with pytest.raises(ValueError) as e:  # found on the first line, before any tokenising
        prepare_corpus([str(path)], str(tmp_path / "o"), field="body", progress=False)
    _one_line(e, "x.jsonl:1", "no field 'body'")


def test_an_empty_corpus_is_one_line(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "e.txt").write_text("")
    (tmp_path / "in" / "f.jsonl").write_text('{"text": ""}\n\n')
    with pytest.raises(ValueError) as e:
        prepare_corpus([str(tmp_path / "in")], str(tmp_path / "o"), progress=False, workers=1)
    _one_line(e, "empty", "2 input file(s)")
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_a_parquet_column_that_is_not_text_is_one_line(tmp_path):
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError) as e:
        prepare_corpus([str(tmp_path / "n.parquet")], str(tmp_path / "o"), progress=False)
    _one_line(e, "column 'text' holds int64, not text", "--column")
    with pytest.raises(ValueError) as e:
        prepare_corpus([str(tmp_path / "n.parquet")], str(tmp_path / "o"), column="body")
    _one_line(e, "no column 'body'", "columns: text")


def test_a_corrupt_token_file_is_one_line(files, tmp_path):
    out = tmp_path / "c"
    prepare_corpus([str(files["root"] / "a.txt")], str(out), progress=False, workers=1)
    with open(out / "tokens.bin", "r+b") as f:
        f.truncate(os.path.getsize(out / "tokens.bin") - 3)
    with pytest.raises(ValueError) as e:
        make_dataset(DataConfig(source="tokens", path=str(out)))
    _one_line(e, "corrupt", "tokens.bin holds", "manifest.json says", "meshtrain prepare")
    (out / "manifest.json").unlink()
    with pytest.raises(ValueError) as e:
        make_dataset(DataConfig(source="tokens", path=str(out)))
    _one_line(e, "no readable manifest.json", "meshtrain prepare")


def test_the_cli_prepares_and_refuses_bad_input_with_exit_code_2(files, tmp_path, capsys):
    from meshtrain.cli import main

    out = tmp_path / "o"
    argv = ["prepare", str(files["root"] / "b.jsonl"), "--out", str(out), "--workers", "1"]
    assert main([*argv, "--field", "body", "--no-progress"]) == 0
    assert "prepared" in capsys.readouterr().out
    assert main([*argv, "--field", "body", "--no-progress"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshtrain prepare: error:") and "--field" in err and "\n" not in err


def test_the_run_check_refuses_a_tokenizer_larger_than_the_model(prepared):
    from meshtrain.check import check_run
    from meshtrain.layout import rules_for
    from meshtrain.mesh import make_mesh
    from meshtrain.models import GPTConfig
    from meshtrain.run import RunSpec
    from meshtrain.train import TrainConfig

    ds = make_dataset(DataConfig(source="tokens", path=str(prepared[0]), seq_len=16, batch_size=8))
    mesh = make_mesh("data=8")
    rules = rules_for("dp", mesh)
    run = RunSpec(data=ds, mesh=mesh, rules=rules, train=TrainConfig(run_dir=""))
    problems = check_run(run.replace(model=GPTConfig(vocab_size=256)))
    assert [p.field for p in problems] == ["data.tokenizer"]
    line = str(problems[0])
    assert "320 tokens" in line and "256" in line and "--gpt.vocab-size to 320" in line
    assert not check_run(run.replace(model=GPTConfig(vocab_size=320)))


@pytest.mark.slow  # two compiles (train and eval step): ~30 s on the loaded 2-core machine
def test_a_gpt_trains_on_packed_tokens_and_reports_perplexity(prepared):
    import jax

    import meshtrain as mt

    ds = make_dataset(
        DataConfig(
            source="tokens", path=str(prepared[0]), seq_len=16, batch_size=8, val_fraction=0.1
        )
    )
    mesh = mt.make_mesh("data=2", devices=jax.devices()[:2])  # fewer devices compile faster
    model = mt.GPTConfig(vocab_size=320, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
    config = mt.TrainConfig(steps=2, progress=False, run_dir="", eval_batches=1)
    run = mt.RunSpec(model=model, data=ds, mesh=mesh, rules=mt.rules_for("dp", mesh), train=config)
    history = mt.Trainer(run=run).fit()
    last = history[-1]
    assert math.isfinite(last["loss"])
    assert last["eval_perplexity"] == pytest.approx(math.exp(last["eval_loss"]), rel=1e-12)
