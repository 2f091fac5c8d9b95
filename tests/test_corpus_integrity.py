"""A prepared corpus records digests of its files and is refused, in one line naming the file,
when a run opens it after any of its bytes changed; an intact one, or one of the earlier format
without digests, opens and reads as before."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import numpy as np
import pytest
from _helpers import load_benchmark

from meshtrain import cli
from meshtrain.data import DataConfig, make_dataset, prepare_corpus, train_bpe
from meshtrain.data.digest import RunningDigest, file_digest
from meshtrain.data.text import stdlib_corpus

ROOT = Path(__file__).resolve().parents[1]
CHANGED = "changed since `meshtrain prepare` wrote it"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A JSONL of fresh random standard-library slices, and a small BPE trained on them."""
    root = tmp_path_factory.mktemp("inputs")
    text = stdlib_corpus(400_000).decode("utf-8", errors="replace")
    rng = random.Random(random.randrange(10**6))
    docs = [text[s : s + rng.randrange(1, 800)] for s in rng.sample(range(len(text) - 800), 60)]
    with open(root / "docs.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    train_bpe(docs, vocab_size=300).save(str(root / "tok"))
    return root


def _config(path: Path) -> DataConfig:
    """The ``tokens`` source on `path`: plain windows of 16 tokens, 4 to a batch."""
    return DataConfig(source="tokens", path=str(path), seq_len=16, batch_size=4, packing=False)


def _prepare(inputs: Path, out: Path) -> dict:
    docs, tok = str(inputs / "docs.jsonl"), str(inputs / "tok")
    return prepare_corpus([docs], str(out), tokenizer=tok, progress=False, workers=1)


def _flip(path: Path, rng: random.Random) -> None:
    """Xors one byte at a random offset of `path` with a random non-zero value."""
    data = bytearray(path.read_bytes())
    data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(data))


def _windows(out: Path, n: int) -> list[dict]:
    """The first `n` training batches of the corpus in `out`, with the windows they drew."""
    ds = make_dataset(_config(out))
    drawn, take = [], ds._train.take

    def logged(idx):
        drawn.append(np.asarray(idx).copy())
        return take(idx)

    ds._train.take = logged
    it = ds.train_iter()
    batches = [next(it) for _ in range(n)]
    it.close()
    return [{**b, "idx": i} for b, i in zip(batches, drawn, strict=False)]


def test_the_file_digest_is_the_crc32_of_the_whole_file(tmp_path):
    rng = np.random.default_rng(random.randrange(10**6))
    block = int(rng.integers(64, 512))
    size = block * int(rng.integers(3, 9)) + int(rng.integers(1, block))
    data = rng.integers(0, 256, size=size).astype(np.uint8).tobytes()
    assert len(data) % block
    path = tmp_path / "random.bin"
    path.write_bytes(data)
    want = f"{zlib.crc32(data):08x}"
    assert file_digest(str(path), block_bytes=block) == want
    assert file_digest(str(path)) == want  # one block holds it all
    running, cuts = RunningDigest(), sorted(rng.integers(0, len(data), size=5).tolist())
    for lo, hi in zip([0, *cuts], [*cuts, len(data)], strict=True):
        running.update(data[lo:hi])
    assert running.hexdigest() == want


def test_an_intact_corpus_records_its_files_and_opens_with_the_same_batches(inputs, tmp_path):
    manifest = _prepare(inputs, tmp_path)
    files = manifest["digests"]["files"]
    assert sorted(files) == ["documents.bin", "tokenizer.json", "tokens.bin"]
    for name, want in files.items():
        assert want == f"{zlib.crc32((tmp_path / name).read_bytes()):08x}", name
    whole = np.fromfile(tmp_path / "tokens.bin", manifest["dtype"])
    for batch in _windows(tmp_path, 3):
        rows = whole[batch["idx"][:, None] * 16 + np.arange(17)]
        np.testing.assert_array_equal(batch["inputs"], rows[:, :-1])
        np.testing.assert_array_equal(batch["targets"], rows[:, 1:])


@pytest.mark.parametrize("name", ["tokens.bin", "documents.bin", "tokenizer.json"])
def test_one_flipped_byte_is_refused_in_one_line_naming_the_file(inputs, tmp_path, name):
    _prepare(inputs, tmp_path)
    _flip(tmp_path / name, random.Random(random.randrange(10**6)))
    with pytest.raises(ValueError) as e:
        make_dataset(_config(tmp_path))
    message = str(e.value)
    assert "\n" not in message
    assert str(tmp_path / name) in message and CHANGED in message, message
    assert "restore the file" in message and "meshtrain prepare again" in message
    # Preparing again (the fix the line gives) rebuilds it rather than calling it up to date.
    assert not _prepare(inputs, tmp_path)["up_to_date"]
    make_dataset(_config(tmp_path))
    assert _prepare(inputs, tmp_path)["up_to_date"]


def test_a_changed_manifest_is_refused_in_one_line(inputs, tmp_path):
    _prepare(inputs, tmp_path)
    path = tmp_path / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "max_id": manifest["max_id"] - 1}))  # still JSON
    with pytest.raises(ValueError) as e:
        make_dataset(_config(tmp_path))
    assert "\n" not in str(e.value) and f"{path} {CHANGED}" in str(e.value), str(e.value)
    path.write_text(path.read_text()[:-3])  # no longer JSON
    with pytest.raises(ValueError) as e:
        make_dataset(_config(tmp_path))
    assert "\n" not in str(e.value) and "not valid JSON" in str(e.value), str(e.value)
    # The format's number turned back to the earlier one: the digests are still checked.
    path.write_text(json.dumps({**manifest, "format": "meshtrain-tokens/1"}))
    with pytest.raises(ValueError, match="changed since"):
        make_dataset(_config(tmp_path))


def test_an_earlier_manifest_without_digests_opens_and_preparing_again_adds_them(inputs, tmp_path):
    manifest = _prepare(inputs, tmp_path)
    want = _windows(tmp_path, 2)
    earlier = {k: v for k, v in manifest.items() if k not in ("digests", "up_to_date")}
    earlier["format"] = "meshtrain-tokens/1"
    (tmp_path / "manifest.json").write_text(json.dumps(earlier))
    for got, batch in zip(_windows(tmp_path, 2), want, strict=True):
        for key in batch:
            np.testing.assert_array_equal(got[key], batch[key])
    again = _prepare(inputs, tmp_path)  # rebuilt with digests, under the same input hash
    assert not again["up_to_date"] and "digests" in again
    assert again["input_hash"] == manifest["input_hash"]


def test_the_cli_refuses_a_changed_corpus_with_exit_2_before_training(inputs, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    _prepare(inputs, corpus)
    _flip(corpus / "tokens.bin", random.Random(random.randrange(10**6)))
    argv = [
        "train", "--data.source", "tokens", "--data.path", str(corpus),
        "--gpt.vocab-size", "300", "--gpt.d-model", "32", "--gpt.n-layers", "1",
        "--gpt.max-seq-len", "16", "--data.seq-len", "16", "--data.batch-size", "8",
        "--steps", "1", "--sample-tokens", "0", "--no-progress",
        "--run-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshtrain train: error: "), err
    assert f"{corpus / 'tokens.bin'} {CHANGED}" in lines[0], err
    assert "Traceback" not in out + err
    assert not (tmp_path / "run").exists()  # nothing trained


def test_the_soak_detects_every_flipped_byte(tmp_path):
    soak = load_benchmark("corpus_soak")
    result = soak.soak(12, random.randrange(10**6), str(tmp_path))
    assert result["silent"] == result["other"] == 0, result["not_detected"]
    assert result["detected"] + result["harmless"] == 12
