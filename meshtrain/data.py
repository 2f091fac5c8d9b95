"""Input pipeline: byte-level LM corpora and user arrays, shuffled and batched with `grain`.

Every source becomes a table of examples (LM windows of ``seq_len + 1`` bytes, or array
rows). Training order is one grain pipeline over example *indices*,
``MapDataset.range(n).shuffle(seed).repeat().batch(batch_size)``: each element is the index
list of one GLOBAL batch, the same on every process. Each process then gathers only its rows
``[p*B/P, (p+1)*B/P)``, so the per-process slices of a step always make up the batch one
process alone would see, and a saved position (a global step) resumes on any process count.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sysconfig
import zipfile

import grain
import jax
import numpy as np

SOURCES: tuple[str, ...] = ("stdlib", "synthetic", "text", "arrays")
SYNTHETIC_BYTES = 400_000


def _is_int(value) -> bool:
    """True for Python/numpy integers, but not bools."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _positive(name: str, value) -> None:
    """Raises unless `value` (of config field `name`) is a positive integer."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"data {name}={value!r}: must be a positive integer")


def _check_common(*, batch_size, seed, val_fraction) -> None:
    """Validates the fields shared by `DataConfig` and `make_arrays_dataset`."""
    _positive("batch_size", batch_size)
    if not _is_int(seed) or not 0 <= seed < 2**32:
        raise ValueError(f"data seed={seed!r}: must be an integer in [0, 2**32)")
    number = isinstance(val_fraction, int | float | np.floating | np.integer)
    if isinstance(val_fraction, bool) or not number or not 0.0 <= val_fraction < 1.0:
        raise ValueError(
            f"data val_fraction={val_fraction!r}: must be a number in [0, 1), "
            "e.g. 0.05; use 0 to hold nothing out"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where batches come from.

    Args:
        source: "stdlib" (this interpreter's standard-library source, byte-level LM),
            "synthetic" (a learnable random byte stream from `seed`), "text" (the bytes of
            the file at `path`) or "arrays" (an .npz at `path` with arrays "inputs" and
            "targets"; see `make_arrays_dataset`).
        path: the file for "text" and "arrays"; an error with the other sources, which read
            no file.
        seq_len: tokens per example for the byte-level sources. "arrays" ignores it and
            takes the length from the arrays.
        batch_size: GLOBAL batch size, summed over processes; divisible by the process count.
        seed: shuffle seed (and generator seed for "synthetic"), in [0, 2**32).
        val_fraction: share held out for evaluation, in [0, 1): the corpus tail, or the
            last rows of the arrays.
        max_bytes: cap on the stdlib corpus size.
    """

    source: str = "stdlib"
    path: str = ""
    seq_len: int = 128
    batch_size: int = 32
    seed: int = 0
    val_fraction: float = 0.05
    max_bytes: int = 4_000_000

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(
                f"data source={self.source!r}: unknown source; choose one of {', '.join(SOURCES)}"
            )
        if not isinstance(self.path, str):
            raise ValueError(f"data path={self.path!r}: must be a string")
        if self.source in ("text", "arrays") and not self.path:
            what = "a text file" if self.source == "text" else "an .npz with inputs and targets"
            raise ValueError(f"data source={self.source!r} needs path=...: give {what}")
        if self.path and self.source not in ("text", "arrays"):
            reader = "arrays" if self.path.endswith(".npz") else "text"
            raise ValueError(
                f"data.path={self.path!r} is given but source={self.source!r} reads no file; "
                f"add --data.source {reader} (source={reader!r}) to train on it, or drop the path"
            )
        _check_common(**self._common())
        _positive("seq_len", self.seq_len)
        _positive("max_bytes", self.max_bytes)

    def _common(self) -> dict:
        """The fields `make_arrays_dataset` shares."""
        return dict(batch_size=self.batch_size, seed=self.seed, val_fraction=self.val_fraction)


def _process_shard() -> tuple[int, int]:
    """(this process's index, process count); a seam so tests can fake several processes."""
    return jax.process_index(), jax.process_count()


class _Windows:
    """LM examples: windows of seq_len+1 tokens starting at multiples of seq_len."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.count = max(0, (len(tokens) - 1) // seq_len)

    def take(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Gathers windows `idx` as int32 inputs/targets [len(idx), seq_len]."""
        w = self.tokens[idx[:, None] * self.seq_len + np.arange(self.seq_len + 1)]
        return {"inputs": w[:, :-1].astype(np.int32), "targets": w[:, 1:].astype(np.int32)}


class _Rows:
    """Array examples: rows of (inputs, targets)."""

    def __init__(self, inputs: np.ndarray, targets: np.ndarray):
        self.inputs, self.targets, self.count = inputs, targets, len(inputs)

    def take(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Gathers rows `idx`."""
        return {"inputs": self.inputs[idx], "targets": self.targets[idx]}


class BatchIterator:
    """Infinite iterator of process-local training batches with a resumable position."""

    def __init__(self, grain_iter: grain.DatasetIterator, fingerprint: dict):
        self._it, self._fingerprint = grain_iter, fingerprint

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        """Returns this process's rows of the next global batch."""
        return next(self._it)

    def get_state(self) -> dict:
        """Returns the position: grain's iterator state plus a fingerprint, all plain JSON."""
        inner = {k: int(v) for k, v in self._it.get_state().items()}
        return {"grain": inner, **self._fingerprint}

    def set_state(self, state: dict) -> None:
        """Resumes at a `get_state` position (JSON round trips are fine).

        Args:
            state: a position; the next batch is the one that followed it. ValueError if it
                is from a dataset with another seed, batch size or example count.
        """
        for key, want in self._fingerprint.items():
            if state.get(key) != want:
                raise ValueError(
                    f"data iterator state has {key}={state.get(key)!r} but this dataset has "
                    f"{key}={want!r}; resume with the same data config"
                )
        self._it.set_state(dict(state["grain"]))

    def close(self) -> None:
        """Stops grain's prefetch thread."""
        self._it.close()


class Dataset:
    """Training and evaluation batches from one source (build with `make_dataset`).

    Attributes:
        kind: "lm" (inputs/targets int32 [B, T]) or "classify" (inputs float32 [B, F],
            targets int32 [B]).
        vocab_size: 256 for byte-level sources; token/class count for arrays.
        num_features: F for "classify", None for "lm".
        seq_len: T for "lm", None for "classify".
        batch_size: the global batch size; local_batch_size: rows per batch on this process.
        num_train, num_val: training / held-out example counts.
    """

    def __init__(self, kind: str, vocab_size: int, train, val, batch_size: int, seed: int):
        assert train.count >= batch_size, "the builders check the size and name the source"
        self.kind, self.vocab_size, self.batch_size, self.seed = kind, vocab_size, batch_size, seed
        self._train, self._val, self.num_train, self.num_val = train, val, train.count, val.count
        width = train.take(np.zeros(1, dtype=int))["inputs"].shape[1]
        self.seq_len: int | None = width if kind == "lm" else None
        self.num_features: int | None = width if kind == "classify" else None
        lo, hi = self._bounds()
        self.local_batch_size = hi - lo

    def _bounds(self) -> tuple[int, int]:
        """This process's row range [lo, hi) within a global batch."""
        index, count = _process_shard()
        if self.batch_size % count:
            raise ValueError(
                f"data batch_size={self.batch_size}: not divisible by jax.process_count()="
                f"{count}; use a multiple of {count}"
            )
        return index * self.batch_size // count, (index + 1) * self.batch_size // count

    def _rows(self, rows: tuple[int, int] | None) -> tuple[int, int]:
        """`rows` checked against the batch size, or the even split over processes."""
        if rows is None:
            return self._bounds()
        lo, hi = rows
        if not (_is_int(lo) and _is_int(hi) and 0 <= lo < hi <= self.batch_size):
            raise ValueError(
                f"data rows={rows!r}: expected 0 ≤ lo < hi ≤ batch_size={self.batch_size}"
            )
        return lo, hi

    def train_iter(self, rows: tuple[int, int] | None = None) -> BatchIterator:
        """Starts an infinite, deterministic stream of training batches.

        Each epoch is a fresh grain shuffle of all examples (from `seed` and the epoch
        number); batches run on across epoch boundaries.

        Args:
            rows: the rows ``[lo, hi)`` of each global batch to read (see
                `meshtrain.layout.process_rows`); None splits evenly over processes.

        Returns:
            a `BatchIterator` of process-local batches.
        """
        lo, hi = self._rows(rows)
        take = self._train.take
        ds = grain.MapDataset.range(self._train.count).shuffle(seed=self.seed).repeat()
        ds = ds.batch(self.batch_size, drop_remainder=True).map(lambda i: take(i[lo:hi]))
        options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
        fp = {"seed": self.seed, "batch_size": self.batch_size, "num_train": self.num_train}
        return BatchIterator(iter(ds.to_iter_dataset(options)), fp)

    def eval_batches(
        self, n: int, rows: tuple[int, int] | None = None
    ) -> list[dict[str, np.ndarray]]:
        """Returns `n` fixed held-out batches (process-local rows), the same on every call.

        Held-out examples go in order, wrapping around if there are fewer than n*batch_size.

        Args:
            n: number of batches.
            rows: the rows ``[lo, hi)`` of each batch to read; None splits evenly over processes.

        Returns:
            `n` batch dicts shaped like training batches.
        """
        if not _is_int(n) or n < 1:
            raise ValueError(f"eval_batches n={n!r}: must be a positive integer")
        if self._val.count == 0:
            raise ValueError("data: no held-out examples (val_fraction=0); set val_fraction > 0")
        lo, hi = self._rows(rows)
        idx = np.arange(n * self.batch_size).reshape(n, self.batch_size) % self._val.count
        return [self._val.take(row[lo:hi]) for row in idx]

    def encode(self, text: str) -> np.ndarray:
        """Returns the UTF-8 bytes of `text` as int32 tokens (LM only).

        Args:
            text: any string.
        """
        self._require_lm("encode")
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, tokens) -> str:
        """Returns byte tokens as text, invalid UTF-8 replaced by U+FFFD (LM only).

        Args:
            tokens: array-like of integers in [0, 256).
        """
        self._require_lm("decode")
        arr = np.asarray(tokens).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError("decode: tokens must be byte values in [0, 256)")
        return bytes(arr.astype(np.uint8)).decode("utf-8", errors="replace")

    def _require_lm(self, what: str) -> None:
        """Raises unless this is an LM dataset."""
        if self.kind != "lm":
            raise ValueError(f"{what}: only for LM datasets, this one is {self.kind!r}")


@functools.lru_cache(maxsize=8)
def stdlib_corpus(max_bytes: int = 4_000_000) -> bytes:
    """The running interpreter's standard-library ``.py`` files, concatenated (cached).

    Files go in sorted path order, skipping site-packages and test directories, each after
    a ``# ==== relative/path.py ====`` line; reading stops once `max_bytes` is reached.

    Args:
        max_bytes: cap on the result's length.

    Returns:
        at most `max_bytes` bytes, the same on every call with this interpreter.
    """
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    parts, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            try:
                with open(path, "rb") as f:
                    body = f.read(max_bytes - total)
            except OSError:
                continue
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            parts.append(f"\n# ==== {rel} ====\n".encode() + body)
            total += len(parts[-1])
            if total >= max_bytes:
                return b"".join(parts)[:max_bytes]
    return b"".join(parts)


def synthetic_corpus(seed: int, size: int = SYNTHETIC_BYTES) -> bytes:
    """A learnable byte stream: 48 random words chained by a sparse random Markov chain.

    Args:
        seed: generator seed.
        size: length in bytes.

    Returns:
        `size` bytes of lowercase words separated by spaces and newlines.
    """
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    words = [bytes(rng.choice(letters, size=rng.integers(2, 8))) for _ in range(48)]
    successors = rng.integers(0, len(words), size=(len(words), 2))
    out, state = [], 0
    for i, c in enumerate(rng.integers(0, 2, size=size // 3 + 1)):
        state = successors[state, c]
        out.append(words[state] + (b"\n" if i % 12 == 11 else b" "))
    return b"".join(out)[:size]


def _min_size(train: int, held_out: int, val_fraction: float) -> int:
    """Smallest total N whose first ``N - int(N * val_fraction)`` units reach `train` and whose
    held-out tail ``int(N * val_fraction)`` reaches `held_out` (ignored when val_fraction=0)."""
    # Lower bounds, since N(1 - f) <= N - int(N f) < N(1 - f) + 1; then step up to the exact one.
    n = max(train, math.floor((train - 1) / (1 - val_fraction)))
    if val_fraction:
        n = max(n, math.floor(held_out / val_fraction) - 1)
    while n - int(n * val_fraction) < train or (val_fraction and int(n * val_fraction) < held_out):
        n += 1
    return n


def _lm_dataset(corpus: bytes, config: DataConfig) -> Dataset:
    """Splits a byte corpus into train windows and held-out tail windows.

    ValueError, naming the corpus, its size and the size it needs, when it is too small.
    """
    tokens = np.frombuffer(corpus, dtype=np.uint8)
    n_val = int(len(tokens) * config.val_fraction)
    split, t, b = len(tokens) - n_val, config.seq_len, config.batch_size
    train, val = _Windows(tokens[:split], t), _Windows(tokens[split:], t)
    short_val = config.val_fraction > 0 and val.count == 0
    if not short_val and train.count >= b:
        return Dataset("lm", 256, train, val, b, config.seed)
    need = _min_size(b * t + 1, t + 1, config.val_fraction)
    if config.source == "text":
        what, more = f"data.path={config.path!r}", f"give a text file of at least {need} bytes"
    elif config.source == "stdlib":
        what = f"data: the stdlib corpus (max_bytes={config.max_bytes})"
        more = f"raise max_bytes to at least {need}"
    else:
        what, more = f"data: the {config.source} corpus", ""
    if not len(tokens):
        tail = f", and a val_fraction={config.val_fraction} tail of at least one"
        raise ValueError(
            f"{what} is empty (0 bytes); {more} (batch_size={b} windows of seq_len+1={t + 1} "
            f"bytes{tail if config.val_fraction else ''})"
        )
    more = f"{more}, or " if more else ""
    if short_val:
        raise ValueError(
            f"{what} holds {len(tokens)} bytes: the held-out tail has {n_val} bytes, fewer than "
            f"seq_len+1={t + 1}; {more}lower seq_len, raise val_fraction, or set val_fraction=0"
        )
    raise ValueError(
        f"{what} holds {len(tokens)} bytes: the corpus has {train.count} train windows of "
        f"seq_len+1={t + 1}, fewer than batch_size={b}; {more}lower batch_size or seq_len"
    )


def make_dataset(config: DataConfig) -> Dataset:
    """Builds the dataset `config` describes (ValueError for a missing file or too little data).

    Args:
        config: a `DataConfig`.

    Returns:
        a `Dataset`.
    """
    if config.source == "stdlib":
        return _lm_dataset(stdlib_corpus(config.max_bytes), config)
    if config.source == "synthetic":
        return _lm_dataset(synthetic_corpus(config.seed), config)
    if not os.path.isfile(config.path):
        raise ValueError(f"data.path={config.path!r}: no such file; give an existing file")
    if config.source == "text":
        with open(config.path, "rb") as f:
            return _lm_dataset(f.read(), config)
    inputs, targets = _read_npz(config.path)
    return _arrays_dataset(inputs, targets, f"data.path={config.path!r}", **config._common())


def _read_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
    """The "inputs" and "targets" arrays of an .npz; a one-line ValueError for anything else."""
    save = "np.savez(path, inputs=..., targets=...)"
    try:
        npz = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        npz = e
    if not isinstance(npz, np.lib.npyio.NpzFile):
        with open(path, "rb") as f:
            head = f.read(512)
        if not head:
            what = "it is empty (0 bytes)"
        elif isinstance(npz, np.ndarray):
            what = "it holds a single .npy array"
        elif head.startswith(b"PK"):
            what = f"it is a damaged zip: {npz}"
        else:
            try:
                head.decode("utf-8")
            except UnicodeDecodeError:
                what = "it is not a zip archive, as .npz files are"
            else:
                what = "it looks like text"
        text = ", or use --data.source text to train on a text file" if "text" in what else ""
        raise ValueError(
            f"data.path={path!r} is not an .npz archive ({what}); source='arrays' needs the "
            f"arrays saved with {save}{text}"
        )
    with npz:
        missing = {"inputs", "targets"} - set(npz.files)
        if missing:
            raise ValueError(
                f"data.path={path!r}: .npz lacks {sorted(missing)} (has {npz.files}); "
                f"save it with {save}"
            )
        arrays = []
        for name in ("inputs", "targets"):
            try:
                arrays.append(npz[name])
            except ValueError:  # numpy's advice to unpickle it
                raise ValueError(
                    f"data.path={path!r}: array {name!r} holds Python objects (dtype object), "
                    f"which are not loaded; save numeric arrays with {save}"
                ) from None
    return arrays[0], arrays[1]


def make_arrays_dataset(
    inputs: np.ndarray,
    targets: np.ndarray,
    *,
    batch_size: int,
    seed: int = 0,
    val_fraction: float = 0.05,
    seq_len: int | None = None,
    vocab_size: int | None = None,
) -> Dataset:
    """Builds a dataset from in-memory arrays; the last rows are held out.

    1-D integer `targets` make a "classify" dataset (numeric inputs [N, F], cast to
    float32); 2-D integer `inputs` and `targets` of one shape [N, T] make an "lm" dataset.

    Args:
        inputs: [N, F] numbers (classify) or [N, T] token ids (lm).
        targets: [N] class ids (classify) or [N, T] token ids (lm).
        batch_size: global batch size.
        seed: shuffle seed.
        val_fraction: share of rows held out, from the end.
        seq_len: for lm, if given, must equal T (a check).
        vocab_size: class/token count; defaults to the largest id + 1.

    Returns:
        a `Dataset`.
    """
    return _arrays_dataset(
        inputs,
        targets,
        "data",
        batch_size=batch_size,
        seed=seed,
        val_fraction=val_fraction,
        seq_len=seq_len,
        vocab_size=vocab_size,
    )


def _arrays_dataset(
    inputs, targets, what: str, *, batch_size, seed, val_fraction, seq_len=None, vocab_size=None
) -> Dataset:
    """`make_arrays_dataset`, its errors starting with `what` (where the arrays came from)."""
    _check_common(batch_size=batch_size, seed=seed, val_fraction=val_fraction)
    inputs, targets = np.asarray(inputs), np.asarray(targets)
    if len(inputs) != len(targets):
        raise ValueError(
            f"{what}: inputs has {len(inputs)} rows but targets has {len(targets)}; they must match"
        )
    if not np.issubdtype(targets.dtype, np.integer):
        raise ValueError(f"{what}: targets dtype {targets.dtype} must be integer (class/token ids)")
    if targets.ndim == 1:
        if inputs.ndim != 2 or not np.issubdtype(inputs.dtype, np.number):
            raise ValueError(
                f"{what}: classify inputs must be a numeric [N, F] array, got {inputs.dtype} "
                f"{inputs.shape}; reshape to (N, -1)"
            )
        kind, ids, inputs = "classify", targets, inputs.astype(np.float32)
    elif targets.ndim == 2:
        if inputs.shape != targets.shape or not np.issubdtype(inputs.dtype, np.integer):
            raise ValueError(
                f"{what}: lm inputs must be integer tokens shaped like targets {targets.shape}, "
                f"got {inputs.dtype} {inputs.shape}"
            )
        if seq_len is not None and seq_len != inputs.shape[1]:
            raise ValueError(f"data seq_len={seq_len}: the arrays have T={inputs.shape[1]}")
        kind, ids, inputs = "lm", np.stack([inputs, targets]), inputs.astype(np.int32)
    else:
        raise ValueError(
            f"{what}: targets must be 1-D class ids or 2-D token ids, got shape {targets.shape}"
        )
    if ids.size and ids.min() < 0:
        raise ValueError(f"{what}: class/token ids must be non-negative")
    n_ids = int(ids.max(initial=0)) + 1
    if vocab_size is not None and (not _is_int(vocab_size) or vocab_size < n_ids):
        raise ValueError(
            f"data vocab_size={vocab_size!r}: must be an integer above the largest id {n_ids - 1}"
        )
    n, n_val = len(inputs), int(len(inputs) * val_fraction)
    if not n or (val_fraction > 0 and n_val == 0) or n - n_val < batch_size:
        need = _min_size(batch_size, 1, val_fraction)
        split = f"batch_size={batch_size} for training, val_fraction={val_fraction} held out"
        if not n:
            raise ValueError(f"{what} has no rows; give at least {need} rows ({split})")
        if n - n_val < batch_size:
            raise ValueError(
                f"{what} has {n} rows, {n - n_val} after holding out {n_val}, fewer than "
                f"batch_size={batch_size}; give at least {need} rows or lower batch_size"
            )
        raise ValueError(
            f"{what}: val_fraction={val_fraction} of {n} rows holds out none; raise "
            f"val_fraction, give at least {need} rows, or set val_fraction=0"
        )
    split, targets = n - n_val, targets.astype(np.int32)
    train, val = _Rows(inputs[:split], targets[:split]), _Rows(inputs[split:], targets[split:])
    return Dataset(kind, int(vocab_size or n_ids), train, val, batch_size, seed)
