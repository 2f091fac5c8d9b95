"""`prepare_corpus`: tokenise text files, JSONL and Parquet, in parallel, into a directory that
the ``tokens`` source streams from (`meshtrain.data.tokens`).

The directory holds

- ``tokens.bin``: every document's token ids, each document followed by the tokenizer's EOS
  id (when it has one), as raw little-endian integers of the smallest unsigned type that
  holds the vocabulary (``uint8``, ``uint16`` or ``uint32``);
- ``documents.bin``: int64 offsets of the documents into ``tokens.bin``, ``D + 1`` of them
  (the first is 0, the last the token count);
- the tokenizer (``tokenizer.json`` for a Hugging Face one; nothing for ``bytes``);
- ``manifest.json``: the tokenizer's name, vocabulary, EOS id and fingerprint, the dtype, the
  counts, the largest token id (``max_id``), the inputs and ``input_hash``, a hash of the
  tokenizer, the options and every input's content, and the ``digests`` of every file a run
  reads and of the manifest itself (`meshtrain.data.digest`). A second run whose hash matches
  the manifest, over files that still have their digests, does nothing.

Documents: each line of a JSONL file (its `field`), each row of a Parquet file (its `column`),
and each text file as a whole. A text file is handed to the workers in pieces cut just after
a lone newline between two non-blank characters: a pre-token boundary for byte-level BPE
tokenizers (GPT-2's and Llama 3's split patterns), so the pieces' tokens are the whole
file's (`meshtrain.data.inputs`). Text is read as UTF-8 with invalid bytes replaced by U+FFFD;
empty documents are skipped. The workers are `meshtrain.data.workers`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence

import numpy as np

from meshtrain.data import digest
from meshtrain.data.destination import destination_problems
from meshtrain.data.inputs import (
    Unit,
    check_jsonl_head,
    check_parquet,
    expand_inputs,
    input_kind,
    jsonl_units,
    parquet_units,
    text_units,
)
from meshtrain.data.token_files import TokenFiles
from meshtrain.data.tokenizer import Tokenizer, load_tokenizer
from meshtrain.data.workers import run_units
from meshtrain.problem import raise_if

FORMAT = "meshtrain-tokens/2"  # a manifest that records digests
EARLIER_FORMAT = "meshtrain-tokens/1"  # one that does not: its corpus opens unchecked
# The token files' layout, hashed into `input_hash`: unchanged since /1, so preparing an
# earlier corpus again (to add digests) keeps its hash, and resuming a run on it still works.
LAYOUT = "meshtrain-tokens/1"
MANIFEST, TOKENS, DOCUMENTS = "manifest.json", "tokens.bin", "documents.bin"
# Tokenizer files an earlier run may have left (a Hugging Face, SentencePiece or tiktoken one).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer.tiktoken",
    "tiktoken_config.json",
)
CHUNK_BYTES = 1 << 20  # text handed to a worker at a time


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds ids below `vocab_size`."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"tokenizer vocab_size={vocab_size}: too large for uint32 token ids")


def _content_hash(files: list[str], tokenizer: Tokenizer, field: str, column: str) -> str:
    """A hash of the token layout, tokenizer, options and every input's bytes."""
    h = hashlib.sha256()
    h.update(json.dumps([LAYOUT, tokenizer.fingerprint, field, column]).encode())
    for path in files:
        h.update(f"\0{input_kind(path)}\0{os.path.getsize(path)}\0".encode())
        with open(path, "rb") as f:
            while block := f.read(1 << 23):
                h.update(block)
    return h.hexdigest()


def read_manifest(directory: str) -> dict | None:
    """The manifest of a prepared directory, or None when it has none (or an unreadable one)."""
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    formats = (FORMAT, EARLIER_FORMAT)
    return manifest if isinstance(manifest, dict) and manifest.get("format") in formats else None


def files_match(directory: str, manifest: dict) -> str:
    """ "" when the token and document files have the sizes `manifest` states, else the reason."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    want = {
        TOKENS: manifest["num_tokens"] * itemsize,
        DOCUMENTS: (manifest["num_documents"] + 1) * 8,
    }
    for name, size in want.items():
        path = os.path.join(directory, name)
        have = os.path.getsize(path) if os.path.isfile(path) else None
        if have != size:
            what = "is missing" if have is None else f"holds {have} bytes"
            return f"{name} {what} but {MANIFEST} says {size}"
    return ""


def corpus_problem(directory: str, manifest: dict) -> str:
    """ "" when the manifest and the files it describes are as `prepare_corpus` wrote them, else
    the first difference, in words: a manifest whose content lost its digest, a file of another
    size (`files_match`), a file whose bytes lost their digest (`meshtrain.data.digest`).

    A manifest of the earlier format, without digests, is checked for the sizes only.
    """
    if manifest.get("format") == FORMAT or "digests" in manifest:
        name = os.path.join(directory, MANIFEST)
        problem = digest.manifest_problem(manifest, name, (TOKENS, DOCUMENTS))
        if problem:
            return problem
    problem = files_match(directory, manifest)
    if problem:
        return f"the token files are corrupt ({problem})"
    return digest.files_problem(directory, manifest) if "digests" in manifest else ""


# Text pieces that `inputs.text_units` would cut apart, and their whole.
_PROBES = (("x = 1\n", "y = 2\n"), ("Hello world.\n", "Next line\n"))


def cuts_cleanly(tok: Tokenizer) -> bool:
    """Whether `tok` gives a text cut after a lone newline the tokens it gives the whole: true
    for byte-level BPEs, false for one that marks its input's start (SentencePiece's dummy
    prefix), which then gets each text file whole."""
    return all(tok.encode(a + b) == tok.encode(a) + tok.encode(b) for a, b in _PROBES)


def prepare_corpus(
    inputs: Sequence[str] | str,
    out_dir: str,
    *,
    tokenizer: str | Tokenizer = "bytes",
    field: str = "text",
    column: str = "text",
    workers: int = 0,
    progress: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
    overwrite: bool = False,
) -> dict:
    """Tokenises `inputs` into `out_dir` for ``DataConfig(source="tokens", path=out_dir)``.

    Nothing happens when `out_dir` already holds this exact result (same tokenizer, options
    and input contents, and files that still have the digests its manifest records; a corpus
    of an earlier version, without digests, is rebuilt). `out_dir` must be new, empty,
    or hold an earlier corpus of the same input files (which is then rebuilt); a directory
    holding another corpus or other files takes the corpus only with `overwrite`, and a
    training run's directory or one inside the inputs never does
    (`meshtrain.data.destination`).

    Args:
        inputs: files or directories: ``.jsonl``/``.ndjson`` (one document per line, its
            `field`), ``.parquet`` (one document per row, its `column`), anything else text
            (one document per file).
        out_dir: the output directory (created if needed).
        tokenizer: a `load_tokenizer` spec (``"bytes"``, a tokenizer.json path) or a `Tokenizer`.
        field: the JSONL field holding the text.
        column: the Parquet column holding the text.
        workers: tokenising processes; 1 tokenises in this process; 0 picks one per CPU
            core for inputs of at least 4 chunks a core, fewer (down to 1) for less.
        progress: show a progress bar (rich) of input bytes done.
        chunk_bytes: bytes of text or JSONL handed to a worker at a time.
        overwrite: write into a directory holding another corpus (replaced) or other files
            (kept beside the corpus).

    Returns:
        the manifest (a dict), with ``"up_to_date": True`` when nothing needed doing.

    Raises:
        ValueError: one line for a missing input, an output directory it may not write
            into, a JSONL line without `field`, a Parquet column that is not text, or inputs
            with no text at all; raised before anything in `out_dir` is written or deleted.
    """
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    files = _input_files(inputs, workers)
    old = read_manifest(out_dir) if os.path.isdir(out_dir) else None
    _check_destination(out_dir, inputs, files, old, overwrite)
    rows = _check_documents(files, field, column)
    key = _content_hash(files, tok, field, column)
    if old and _up_to_date(out_dir, old, key):
        return {**old, "up_to_date": True}

    _clear(out_dir, tok)
    dtype = token_dtype(tok.vocab_size)
    units = _units(files, column, rows, chunk_bytes, cuts_cleanly(tok))
    total = sum(os.path.getsize(p) for p in files)
    if not workers:  # one per core, but only as many as the input keeps busy
        workers = max(1, min(os.cpu_count() or 1, total // (4 * chunk_bytes)))
    written = _write_tokens(out_dir, units, tok, field, dtype, workers, progress, total)
    if written.tokens == 0:
        _remove(*_temporary(out_dir))
        raise ValueError(
            f"prepare: the corpus is empty: {len(files)} input file(s) hold no text to tokenise; "
            "give files with text (JSONL: a non-empty --field; Parquet: a non-empty --column)"
        )
    for tmp, name in zip(_temporary(out_dir), (TOKENS, DOCUMENTS), strict=True):
        os.replace(tmp, os.path.join(out_dir, name))
    manifest = _manifest(tok, dtype, written, total, files, field, column, key)
    manifest = digest.with_digests(manifest, _file_digests(out_dir, written))
    _write_manifest(out_dir, manifest)
    return {**manifest, "up_to_date": False}


def _input_files(inputs: list[str], workers: int) -> list[str]:
    """The files the inputs name; a ValueError for none, or for a bad worker count."""
    files = expand_inputs(inputs)
    if not files:
        raise ValueError(f"prepare: the inputs {list(inputs)!r} hold no files; give text files")
    if not isinstance(workers, int) or workers < 0:
        raise ValueError(f"prepare: workers={workers!r}: must be an integer >= 0 (0 = per core)")
    return files


def _up_to_date(out_dir: str, old: dict, key: str) -> bool:
    """Whether `out_dir`, whose manifest is `old`, holds the corpus of input hash `key`, in this
    format, unchanged."""
    if old.get("format") != FORMAT or old.get("input_hash") != key:
        return False
    return not corpus_problem(out_dir, old)


def _check_destination(
    out_dir: str, inputs: list[str], files: list[str], old: dict | None, overwrite: bool
) -> None:
    """Raises unless `out_dir` may take the corpus (`meshtrain.data.destination`)."""
    earlier = [i.get("path", "") for i in old.get("inputs", [])] if old else None
    written = (MANIFEST, TOKENS, DOCUMENTS, *TOKENIZER_FILES)
    raise_if(
        destination_problems(
            out_dir, inputs, files, written=written, earlier_inputs=earlier, overwrite=overwrite
        )
    )


def _check_documents(files: list[str], field: str, column: str) -> dict[str, int]:
    """Checks each JSONL file's head for `field` and each Parquet file's `column`; the Parquet
    files' row counts."""
    rows = {}
    for path in files:
        if input_kind(path) == "parquet":
            rows[path] = check_parquet(path, column)
        elif input_kind(path) == "jsonl":
            check_jsonl_head(path, field)
    return rows


def _clear(out_dir: str, tok: Tokenizer) -> None:
    """Creates `out_dir` and saves `tok` there, after removing the manifest (none until the new
    files are whole) and any other run's tokenizer."""
    os.makedirs(out_dir, exist_ok=True)
    for name in (MANIFEST, *TOKENIZER_FILES):
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    tok.save(out_dir)


def _units(
    files: list[str], column: str, rows: dict[str, int], chunk_bytes: int, cut: bool
) -> Iterator[tuple[Unit, int]]:
    """The work units of every input, in order, with their input bytes."""
    for path in files:
        kind = input_kind(path)
        if kind == "parquet":
            yield from parquet_units(path, column, rows[path])
        elif kind == "jsonl":
            yield from jsonl_units(path, chunk_bytes)
        else:
            yield from text_units(path, chunk_bytes, cut)


def _temporary(out_dir: str) -> tuple[str, str]:
    """Where the token and document files are written before they are whole."""
    return os.path.join(out_dir, TOKENS + ".tmp"), os.path.join(out_dir, DOCUMENTS + ".tmp")


def _write_tokens(
    out_dir: str,
    units: Iterator[tuple[Unit, int]],
    tok: Tokenizer,
    field: str,
    dtype: np.dtype,
    workers: int,
    progress: bool,
    total: int,
) -> TokenFiles:
    """Tokenises the units on `workers` into the temporary token and document files (removed
    again on any error)."""
    tokens_tmp, docs_tmp = _temporary(out_dir)
    try:
        with (
            open(tokens_tmp, "wb") as tok_file,
            open(docs_tmp, "wb") as doc_file,
            _progress_bar(progress, total) as advance,
        ):
            written = TokenFiles(tok_file, doc_file)
            spec = "bytes" if tok.name == "bytes" else out_dir  # the workers load the saved copy
            for result, size in run_units(units, tok, spec, field, dtype, workers):
                written.write(result)
                advance(size)
    except BaseException:  # a bad line, a worker error, Ctrl-C: leave no partial files
        _remove(tokens_tmp, docs_tmp)
        raise
    return written


def _manifest(
    tok: Tokenizer,
    dtype: np.dtype,
    written: TokenFiles,
    total: int,
    files: list[str],
    field: str,
    column: str,
    key: str,
) -> dict:
    """The manifest of the corpus just written."""
    return {
        "format": FORMAT,
        "tokenizer": {
            "name": tok.name,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "fingerprint": tok.fingerprint,
        },
        "dtype": dtype.name,
        "num_tokens": written.tokens,
        "num_documents": written.documents,
        "max_id": written.max_id,
        "text_bytes": total,
        "inputs": [{"path": p, "kind": input_kind(p), "bytes": os.path.getsize(p)} for p in files],
        "field": field,
        "column": column,
        "input_hash": key,
        "tokens_sha256": written.sha256,
    }


def _file_digests(out_dir: str, written: TokenFiles) -> dict[str, str]:
    """The digest of every file a run reads: the token and document files (taken as they were
    written) and the saved tokenizer's files (read back)."""
    found = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(out_dir, n))]
    out = {n: digest.file_digest(os.path.join(out_dir, n)) for n in found}
    out[TOKENS], out[DOCUMENTS] = written.digests
    return out


def _write_manifest(out_dir: str, manifest: dict) -> None:
    """Writes the manifest whole (to a temporary file, then renamed)."""
    tmp = os.path.join(out_dir, MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, MANIFEST))


def _remove(*paths: str) -> None:
    """Deletes the files that exist among `paths`."""
    for path in paths:
        if os.path.exists(path):
            os.remove(path)


def _progress_bar(enabled: bool, total: int):
    """A context manager giving ``advance(bytes)``; a rich bar when `enabled`."""
    import contextlib

    @contextlib.contextmanager
    def bar():
        if not enabled:
            yield lambda n: None
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        columns = (
            TextColumn("prepare"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, transient=False) as p:
            task = p.add_task("prepare", total=total)
            yield lambda n: p.advance(task, n)

    return bar()
