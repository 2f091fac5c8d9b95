"""The ``tokens`` source: a directory `prepare_corpus` wrote, streamed from memory maps.

Opening a corpus streams each of its files once through its digest, to refuse bytes that
changed since `prepare_corpus` wrote them (`meshtrain.data.digest`); nothing else is read up
front but the manifest: a batch reads only its own windows of ``tokens.bin`` (and, packed, the
few document offsets inside them), so a corpus far larger than memory trains, and each process
reads only its rows of the global batch (the order and the per-process rows are
`meshtrain.data.batches`', as for every source).
"""

from __future__ import annotations

import os

import numpy as np

from meshtrain.data.batches import Dataset
from meshtrain.data.config import DataConfig, min_size
from meshtrain.data.manifest_values import checked_manifest, fix
from meshtrain.data.packing import pack_rows
from meshtrain.data.prepare import DOCUMENTS, MANIFEST, TOKENS, corpus_problem, read_manifest
from meshtrain.data.tokenizer import Tokenizer, load_tokenizer
from meshtrain.filevalues import read_json


class TokenCorpus:
    """A prepared directory, opened read-only (memory-mapped), its files checked against the
    digests its manifest records (a manifest of an earlier version records none).

    Args:
        directory: what `prepare_corpus` wrote.
        field: the config field to name in errors.

    Raises:
        ValueError: one line when the directory holds no prepared corpus, or its files do not
            match the manifest (a truncated file, or one whose bytes changed since).
    """

    def __init__(self, directory: str, field: str = "data.path"):
        where = f"{field}={directory!r}"
        if not os.path.isdir(directory):
            raise ValueError(
                f"{where}: no such directory; give the directory `meshtrain prepare` wrote"
            )
        manifest = read_manifest(directory)
        if manifest is None and os.path.isfile(os.path.join(directory, MANIFEST)):
            read_json(os.path.join(directory, MANIFEST), fix(directory))  # names where it breaks
            raise ValueError(
                f"{where}: {os.path.join(directory, MANIFEST)} is damaged (not a manifest "
                f"`meshtrain prepare` wrote); restore it, or prepare the corpus again: "
                f"meshtrain prepare FILES --out {directory}"
            )
        if manifest is None:
            raise ValueError(
                f"{where}: no readable {MANIFEST}; prepare it first: meshtrain prepare FILES "
                f"--out {directory}"
            )
        manifest = checked_manifest(directory, manifest)  # each value as a flag's
        problem = corpus_problem(directory, manifest)
        if problem:
            raise ValueError(
                f"{where}: {problem}; restore the file, or run meshtrain prepare again on the "
                "corpus's inputs to rebuild it"
            )
        self.directory, self.manifest = directory, manifest
        self.num_tokens, self.num_documents = manifest["num_tokens"], manifest["num_documents"]
        dtype = np.dtype(manifest["dtype"])
        path = os.path.join(directory, TOKENS)
        self.tokens = np.memmap(path, dtype, "r", shape=(self.num_tokens,))
        self.doc_offsets = np.memmap(
            os.path.join(directory, DOCUMENTS), np.int64, "r", shape=(self.num_documents + 1,)
        )

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the corpus was prepared with (saved beside it), EOS as recorded."""
        info = self.manifest["tokenizer"]
        tok = load_tokenizer("bytes" if info["name"] == "bytes" else self.directory)
        if tok.fingerprint != info["fingerprint"]:
            raise ValueError(
                f"data.path={self.directory!r}: the tokenizer saved there is not the one "
                f"{MANIFEST} names; run meshtrain prepare again"
            )
        tok.eos_id = info["eos_id"]
        return tok


class TokenWindows:
    """LM examples over tokens ``[lo, hi)`` of a corpus: windows of seq_len+1 tokens starting
    at multiples of seq_len, packed (with segment ids and positions) or plain.

    ``bytes_read`` counts every byte of the corpus files a `take` has read.
    """

    def __init__(self, corpus: TokenCorpus, lo: int, hi: int, seq_len: int, packed: bool):
        self.corpus, self.lo, self.seq_len, self.packed = corpus, lo, seq_len, packed
        self.count = max(0, (hi - lo - 1) // seq_len)
        self.bytes_read = 0

    def take(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Reads windows `idx`: int32 inputs/targets [len(idx), seq_len] (and, packed,
        segment_ids and positions)."""
        starts = self.lo + np.asarray(idx, dtype=np.int64) * self.seq_len
        w = self.corpus.tokens[starts[:, None] + np.arange(self.seq_len + 1)]  # [B, T+1]
        self.bytes_read += w.nbytes
        batch = {"inputs": w[:, :-1].astype(np.int32), "targets": w[:, 1:].astype(np.int32)}
        if self.packed:
            seg, pos, read = pack_rows(starts, self.corpus.doc_offsets, self.seq_len)
            self.bytes_read += read
            batch.update(segment_ids=seg, positions=pos)
        return batch

    def groups(self) -> np.ndarray:
        """The document each window starts in (the groups of client partitions)."""
        starts = self.lo + np.arange(self.count, dtype=np.int64) * self.seq_len
        return np.searchsorted(self.corpus.doc_offsets, starts, side="right") - 1


def tokens_dataset(config: DataConfig) -> Dataset:
    """The ``tokens`` source: train windows, and held-out windows from `eval_path` (another
    prepared directory, with the same tokenizer) or the corpus tail (`val_fraction`).

    ValueError, naming the directory, its size and the size it needs, when it is too small.
    """
    corpus = TokenCorpus(config.path)
    tok = _checked_tokenizer(corpus, config)
    t, b, n = config.seq_len, config.batch_size, corpus.num_tokens
    packed = config.packing
    held = None
    if config.eval_path:
        held = TokenCorpus(config.eval_path, "data.eval_path")
        if held.manifest["tokenizer"]["fingerprint"] != corpus.manifest["tokenizer"]["fingerprint"]:
            raise ValueError(
                f"data.eval_path={config.eval_path!r}: prepared with another tokenizer than "
                f"data.path={config.path!r}; prepare both with the same --tokenizer"
            )
        train = TokenWindows(corpus, 0, n, t, packed)
        val = TokenWindows(held, 0, held.num_tokens, t, packed)
        if val.count == 0:
            raise ValueError(
                f"data.eval_path={config.eval_path!r} holds {held.num_tokens} tokens, fewer "
                f"than seq_len+1={t + 1}; give a larger held-out corpus or lower seq_len"
            )
        fraction = 0.0
    else:
        fraction = config.val_fraction
        split = n - int(n * fraction)
        train = TokenWindows(corpus, 0, split, t, packed)
        val = TokenWindows(corpus, split, n, t, packed)
    if train.count < b or (fraction and val.count == 0):
        need = min_size(b * t + 1, t + 1, fraction)
        raise ValueError(
            f"data.path={config.path!r} holds {n} tokens; batch_size={b} windows of "
            f"seq_len+1={t + 1} (and a val_fraction={fraction} tail of one) need at least "
            f"{need}; prepare more text, or lower batch_size or seq_len"
        )
    # The ids the corpus holds bound the vocabulary too (the run check compares it with the
    # model's): a manifest's max_id, where it records one, above the tokenizer's count.
    ids = [c.manifest.get("max_id", -1) + 1 for c in (corpus, held) if c is not None]
    ds = Dataset("lm", max(tok.vocab_size, *ids), train, val, b, config.seed)
    ds.tokenizer = tok
    ds.fingerprint["corpus"] = corpus.manifest["input_hash"][:16]
    return ds


def _checked_tokenizer(corpus: TokenCorpus, config: DataConfig) -> Tokenizer:
    """The corpus's tokenizer; ValueError when `config.tokenizer` names a different one."""
    tok = corpus.tokenizer()
    if config.tokenizer != "bytes":
        wanted = load_tokenizer(config.tokenizer)
        if wanted.fingerprint != tok.fingerprint:
            raise ValueError(
                f"data.tokenizer={config.tokenizer!r} is not the tokenizer data.path="
                f"{config.path!r} was prepared with ({tok.name}); drop --data.tokenizer (the "
                "corpus's own is used) or prepare the corpus with this one"
            )
    return tok
