"""The data settings (`DataConfig`) and the checks its fields and `make_arrays_dataset`'s
share."""

from __future__ import annotations

import dataclasses
import math
import os

from meshtrain import validate
from meshtrain.problem import Problem

SOURCES: tuple[str, ...] = (
    "stdlib",
    "synthetic",
    "text",
    "arrays",
    "digits",
    "images",
    "fake_images",
    "tokens",
)
# the sources that read `path`
FILE_SOURCES: tuple[str, ...] = ("text", "arrays", "images", "tokens")


def common_problems(*, batch_size, seed, val_fraction) -> list[Problem]:
    """What is wrong with the fields `DataConfig` and `make_arrays_dataset` share."""
    v = validate
    return (
        v.positive("data.batch_size", batch_size, example=32)
        + v.in_range("data.seed", seed, 0, 2**32, closed="[)", integer=True, example=0)
        + v.in_range(
            "data.val_fraction",
            val_fraction,
            0,
            1,
            closed="[)",
            example=0.05,
            note="0 holds nothing out",
        )
    )


def min_size(train: int, held_out: int, val_fraction: float) -> int:
    """Smallest total N whose first ``N - int(N * val_fraction)`` units reach `train` and whose
    held-out tail ``int(N * val_fraction)`` reaches `held_out` (ignored when val_fraction=0)."""
    # Lower bounds, since N(1 - f) <= N - int(N f) < N(1 - f) + 1; then step up to the exact one.
    n = max(train, math.floor((train - 1) / (1 - val_fraction)))
    if val_fraction:
        n = max(n, math.floor(held_out / val_fraction) - 1)
    while n - int(n * val_fraction) < train or (val_fraction and int(n * val_fraction) < held_out):
        n += 1
    return n


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig(validate.Checked):
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
        tokenizer: "bytes" (the byte-level default) or a path to a Hugging Face
            ``tokenizer.json`` (or a directory holding one); see `meshtrain.data.load_tokenizer`.
            The text sources ("stdlib", "synthetic", "text") are tokenised with it in memory;
            "tokens" uses the corpus's own tokenizer (this must then be it, or "bytes").
        packing: for "tokens": batches carry "segment_ids" and "positions" so that attention
            and the loss never link two documents (`meshtrain.data.packing`); False gives
            plain windows. The other sources have no document boundaries: plain windows.
        eval_path: held-out data for evaluation instead of the `val_fraction` tail: a text
            file for "stdlib", "synthetic" and "text", a prepared directory for "tokens".
        client_alpha: non-i.i.d. client data, for runs whose replicas step apart (federated
            averaging, gossip, local SGD): the training examples are split among the
            data-parallel replicas, each a Dirichlet(α) mix of the labels (classify data) or
            of the documents (prepared tokens; spans of the corpus for the other text
            sources), and each replica's rows of a batch come from its own part (α = 0.1:
            most clients see a few labels; 100: nearly i.i.d.; `meshtrain.data.clients`).
            None: one shuffled order of all examples.
    """

    source: str = "stdlib"
    path: str = ""
    seq_len: int = 128
    batch_size: int = 32
    seed: int = 0
    val_fraction: float = 0.05
    max_bytes: int = 4_000_000
    image_shape: tuple[int, int, int] = (32, 32, 3)
    tokenizer: str = "bytes"
    packing: bool = True
    eval_path: str = ""
    client_alpha: float | None = None

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        v = validate
        problems = v.one_of("data.source", self.source, SOURCES, example="text")
        problems += v.require(
            isinstance(self.path, str), "data.path", self.path, "must be a string"
        )
        if self.source in FILE_SOURCES and not self.path:
            what = {
                "text": "a text file",
                "arrays": "an .npz with inputs and targets",
                "images": "an .npz of images and labels",
                "tokens": "the directory `meshtrain prepare` wrote",
            }[self.source]
            problems += [Problem("data.source", self.source, f"needs --data.path: give {what}")]
        if isinstance(self.path, str) and self.path and self.source not in FILE_SOURCES:
            reader = "arrays" if self.path.endswith(".npz") else "text"
            reader = "tokens" if os.path.isdir(self.path) else reader
            problems += [
                Problem(
                    "data.path",
                    self.path,
                    f"is given but source={self.source!r} reads no file; add --data.source "
                    f"{reader} (source={reader!r}) to train on it, or drop the path",
                )
            ]
        problems += v.require(
            isinstance(self.tokenizer, str) and bool(self.tokenizer),
            "data.tokenizer",
            self.tokenizer,
            "give 'bytes' or a path to a tokenizer.json",
        )
        problems += v.require(
            isinstance(self.eval_path, str), "data.eval_path", self.eval_path, "must be a string"
        )
        if (
            isinstance(self.eval_path, str)
            and self.eval_path
            and self.source not in ("stdlib", "synthetic", "text", "tokens")
        ):
            problems += [
                Problem(
                    "data.eval_path",
                    self.eval_path,
                    f"source={self.source!r} holds out its last rows (val_fraction) instead; "
                    "drop --data.eval-path",
                )
            ]
        problems += common_problems(**self._common())
        if self.client_alpha is not None:
            problems += v.above(
                "data.client_alpha",
                self.client_alpha,
                0,
                example=0.1,
                note="the Dirichlet concentration; leave it out for i.i.d. batches",
            )
        problems += v.positive("data.seq_len", self.seq_len, example=128)
        problems += v.positive("data.max_bytes", self.max_bytes, example=4_000_000)
        shape = tuple(self.image_shape)
        problems += v.require(
            len(shape) == 3 and all(v.is_int(d) and d > 0 for d in shape),
            "data.image_shape",
            self.image_shape,
            "must be three positive integers H W C; e.g. --data.image-shape 32 32 3",
        )
        return problems

    def _common(self) -> dict:
        """The fields `make_arrays_dataset` shares."""
        return dict(batch_size=self.batch_size, seed=self.seed, val_fraction=self.val_fraction)
