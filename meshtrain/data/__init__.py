"""Input pipeline: byte-level LM corpora and user arrays, shuffled and batched with `grain`.

Every source becomes a table of examples (LM windows of ``seq_len + 1`` bytes, or array
rows). Training order is one grain pipeline over example *indices*,
``MapDataset.range(n).shuffle(seed).repeat().batch(batch_size)``: each element is the index
list of one GLOBAL batch, the same on every process. Each process then gathers only its rows
``[p*B/P, (p+1)*B/P)``, so the per-process slices of a step always make up the batch one
process alone would see, and a saved position (a global step) resumes on any process count.

Modules: `config` (`DataConfig` and its checks), `batches` (examples, order, per-process rows,
the resumable iterator), `text` (byte-level corpora), `arrays` (``.npz`` and in-memory arrays),
`images` (the embedded digits, an ``.npz`` of images, fake images; rows are flattened images),
`tokenizer` (byte-level default, Hugging Face ``tokenizer.json``, SentencePiece), `prepare`
(`prepare_corpus`: text, JSONL and Parquet tokenised into a memory-mappable directory; its
`inputs` readers, `destination` (where it may write) and `workers` pool; `command`,
``meshtrain prepare``), `tokens` (the ``tokens`` source streaming from it), `packing`
(segment ids and positions), `shares` (each microbatch's share of a packed step's tokens),
`clients` (examples split among federated clients, each a
Dirichlet mix of the labels or sources, and batches drawn per client).
"""

from __future__ import annotations

import os

from meshtrain.data.arrays import arrays_dataset, make_arrays_dataset, read_npz
from meshtrain.data.batches import BatchIterator, Dataset
from meshtrain.data.config import SOURCES, DataConfig
from meshtrain.data.images import digits, image_source
from meshtrain.data.prepare import prepare_corpus
from meshtrain.data.text import SYNTHETIC_BYTES, lm_dataset, stdlib_corpus, synthetic_corpus
from meshtrain.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    train_bpe,
)
from meshtrain.data.tokens import TokenCorpus, tokens_dataset

__all__ = [
    "SOURCES",
    "SYNTHETIC_BYTES",
    "TokenCorpus",
    "BatchIterator",
    "ByteTokenizer",
    "DataConfig",
    "Dataset",
    "HFTokenizer",
    "Tokenizer",
    "digits",
    "load_tokenizer",
    "make_arrays_dataset",
    "make_dataset",
    "prepare_corpus",
    "stdlib_corpus",
    "synthetic_corpus",
    "train_bpe",
]


def make_dataset(config: DataConfig) -> Dataset:
    """Builds the dataset `config` describes (ValueError for a missing file or too little data).

    Args:
        config: a `DataConfig`.

    Returns:
        a `Dataset`.
    """
    data = _source_dataset(config)
    data.client_alpha = config.client_alpha
    return data


def _source_dataset(config: DataConfig) -> Dataset:
    """The dataset of `config`'s source."""
    if config.source == "stdlib":
        return lm_dataset(stdlib_corpus(config.max_bytes), config)
    if config.source == "synthetic":
        return lm_dataset(synthetic_corpus(config.seed), config)
    if config.source in ("digits", "fake_images"):
        return image_source(config)
    if config.source == "tokens":
        return tokens_dataset(config)
    if not os.path.isfile(config.path):
        raise ValueError(f"data.path={config.path!r}: no such file; give an existing file")
    if config.source == "text":
        with open(config.path, "rb") as f:
            return lm_dataset(f.read(), config)
    if config.source == "images":
        return image_source(config)
    inputs, targets = read_npz(config.path)
    return arrays_dataset(inputs, targets, f"data.path={config.path!r}", **config._common())
