"""Batches: examples (LM windows or array rows), the shuffled global order, each process's
rows of it, and the resumable iterator (`Dataset`, `BatchIterator`)."""

from __future__ import annotations

import grain
import jax
import numpy as np

from meshtrain import validate
from meshtrain.data.clients import ClientOrder, client_partition, example_groups
from meshtrain.data.tokenizer import ByteTokenizer, Tokenizer
from meshtrain.problem import raise_if
from meshtrain.validate import is_int


def process_shard() -> tuple[int, int]:
    """(this process's index, process count); a seam so tests can fake several processes."""
    return jax.process_index(), jax.process_count()


class Windows:
    """LM examples: windows of seq_len+1 tokens starting at multiples of seq_len."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.count = max(0, (len(tokens) - 1) // seq_len)

    def take(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Gathers windows `idx` as int32 inputs/targets [len(idx), seq_len]."""
        w = self.tokens[idx[:, None] * self.seq_len + np.arange(self.seq_len + 1)]
        return {"inputs": w[:, :-1].astype(np.int32), "targets": w[:, 1:].astype(np.int32)}

    def groups(self) -> None:
        """No labels or documents: client partitions cut spans of the windows."""
        return None


class Rows:
    """Array examples: rows of (inputs, targets)."""

    def __init__(self, inputs: np.ndarray, targets: np.ndarray):
        self.inputs, self.targets, self.count = inputs, targets, len(inputs)

    def take(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Gathers rows `idx`."""
        return {"inputs": self.inputs[idx], "targets": self.targets[idx]}

    def groups(self) -> np.ndarray | None:
        """Each row's label (classify rows); None for token rows, which have no documents."""
        return self.targets if self.targets.ndim == 1 else None


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
        extra = sorted(set(state) - {"grain", *self._fingerprint})
        if extra:
            raise ValueError(
                f"data iterator state has {extra[0]}={state[extra[0]]!r} but this dataset has "
                f"no {extra[0]}; resume with the same data config"
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
        image_shape: [H, W, C] when the rows are flattened images (`meshtrain.data.images`),
            else None.
        tokenizer: the `Tokenizer` of a text source's "lm" dataset; None for arrays (whose
            `encode`/`decode` are byte-level) and "classify".
        batch_keys: the entries of a batch: "inputs", "targets" and, for packed token data,
            "segment_ids" and "positions" (int32 [B, T], see `meshtrain.data.packing`).
        fingerprint: what a saved data position must match to resume (seed, batch size,
            example count, and for prepared corpora the corpus's hash).
        client_alpha: draw training batches per client, each client's examples a
            Dirichlet(α) mix of the groups (`meshtrain.data.clients`); None: one shuffled
            order of all examples.
    """

    def __init__(self, kind: str, vocab_size: int, train, val, batch_size: int, seed: int):
        assert train.count >= batch_size, "the builders check the size and name the source"
        self.kind, self.vocab_size, self.batch_size, self.seed = kind, vocab_size, batch_size, seed
        self._train, self._val, self.num_train, self.num_val = train, val, train.count, val.count
        first = train.take(np.zeros(1, dtype=int))
        width = first["inputs"].shape[1]
        self.batch_keys: tuple[str, ...] = tuple(first)
        self.tokenizer: Tokenizer | None = None  # the text sources set theirs
        self.fingerprint = {"seed": seed, "batch_size": batch_size, "num_train": self.num_train}
        self.seq_len: int | None = width if kind == "lm" else None
        self.num_features: int | None = width if kind == "classify" else None
        self.image_shape: tuple[int, int, int] | None = None
        self.client_alpha: float | None = None  # `make_dataset` sets DataConfig's
        self._parts: dict[int, list[np.ndarray]] = {}
        lo, hi = self._bounds()
        self.local_batch_size = hi - lo

    def _bounds(self) -> tuple[int, int]:
        """This process's row range [lo, hi) within a global batch."""
        index, count = process_shard()
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
        if not (is_int(lo) and is_int(hi) and 0 <= lo < hi <= self.batch_size):
            raise ValueError(
                f"data rows={rows!r}: expected 0 ≤ lo < hi ≤ batch_size={self.batch_size}"
            )
        return lo, hi

    def train_iter(
        self, rows: tuple[int, int] | None = None, *, clients: int | None = None
    ) -> BatchIterator:
        """Starts an infinite, deterministic stream of training batches.

        Each epoch is a fresh grain shuffle of all examples (from `seed` and the epoch
        number); batches run on across epoch boundaries. With `client_alpha`, block r of
        each batch is drawn from client r's part instead (`client_partition`).

        Args:
            rows: the rows ``[lo, hi)`` of each global batch to read (see
                `meshtrain.layout.process_rows`); None splits evenly over processes.
            clients: the number of clients R with `client_alpha` (the data-parallel
                replicas); ignored without it.

        Returns:
            a `BatchIterator` of process-local batches.
        """
        lo, hi = self._rows(rows)
        take, fingerprint = self._train.take, dict(self.fingerprint)
        if self.client_alpha is None:
            ds = grain.MapDataset.range(self._train.count).shuffle(seed=self.seed).repeat()
            ds = ds.batch(self.batch_size, drop_remainder=True).map(lambda i: take(i[lo:hi]))
        else:
            order = ClientOrder(
                self.client_partition(clients), self.batch_size, self.seed, (lo, hi)
            )
            ds = grain.MapDataset.source(order).map(take)
            fingerprint.update(clients=clients, client_alpha=self.client_alpha)
        options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
        return BatchIterator(iter(ds.to_iter_dataset(options)), fingerprint)

    def client_partition(self, clients: int | None) -> list[np.ndarray]:
        """The training examples of each client under `client_alpha`, computed once per count.

        Args:
            clients: the number of clients R (the data-parallel replicas); it must divide the
                batch size, each client giving B/R rows of every batch.

        Returns:
            One sorted array of training-example indices per client; every example is in one.

        Raises:
            ValueError: no `client_alpha` or client count, a batch size `clients` does not
                divide, or α too small for every client to get its B/R examples.
        """
        if self.client_alpha is None:
            raise ValueError("client_partition: this dataset has no client_alpha")
        if not is_int(clients) or clients < 1:
            raise ValueError(
                f"data.client_alpha={self.client_alpha!r}: needs the client count, got "
                f"{clients!r}; pass train_iter(clients=R), R the data-parallel replicas"
            )
        if self.batch_size % clients:
            raise ValueError(
                f"data.batch_size={self.batch_size}: not divisible by the {clients} clients "
                f"(data-parallel replicas); use a multiple of {clients}"
            )
        if clients not in self._parts:
            self._parts[clients] = client_partition(
                self._train,
                clients,
                self.client_alpha,
                seed=self.seed,
                min_examples=self.batch_size // clients,
            )
        return self._parts[clients]

    def client_groups(self, clients: int) -> np.ndarray:
        """The group of each training example that `client_partition` splits by for
        `clients` clients (`meshtrain.data.clients.example_groups`: labels, documents or
        spans), e.g. to measure a partition's skew with `meshtrain.data.clients.group_skew`."""
        return example_groups(self._train, clients)

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
        raise_if(validate.positive("eval_batches", n, example=4))
        if self._val.count == 0:
            raise ValueError("data: no held-out examples (val_fraction=0); set val_fraction > 0")
        lo, hi = self._rows(rows)
        idx = np.arange(n * self.batch_size).reshape(n, self.batch_size) % self._val.count
        return [self._val.take(row[lo:hi]) for row in idx]

    def encode(self, text: str) -> np.ndarray:
        """Returns `text` as int32 tokens of this dataset's tokenizer (LM only; byte-level:
        its UTF-8 bytes).

        Args:
            text: any string.
        """
        self._require_lm("encode")
        return np.asarray(self._tokenizer().encode(text), dtype=np.int32)

    def decode(self, tokens) -> str:
        """Returns tokens as text (LM only; byte-level: invalid UTF-8 becomes U+FFFD).

        Args:
            tokens: array-like of integers in [0, vocab_size).
        """
        self._require_lm("decode")
        arr, tok = np.asarray(tokens).reshape(-1), self._tokenizer()
        if arr.size and (arr.min() < 0 or arr.max() >= tok.vocab_size):
            if tok.vocab_size == 256:
                raise ValueError("decode: tokens must be byte values in [0, 256)")
            raise ValueError(f"decode: tokens must be in [0, {tok.vocab_size})")
        return tok.decode(arr.tolist())

    def _tokenizer(self) -> Tokenizer:
        """The dataset's tokenizer; byte-level when it has none."""
        return self.tokenizer or ByteTokenizer()

    def _require_lm(self, what: str) -> None:
        """Raises unless this is an LM dataset."""
        if self.kind != "lm":
            raise ValueError(f"{what}: only for LM datasets, this one is {self.kind!r}")
