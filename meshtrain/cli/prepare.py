"""``meshtrain prepare``: tokenise text, JSONL and Parquet files into a directory that
``meshtrain train --data.source tokens --data.path DIR`` streams from.

    meshtrain prepare notes/ --out corpus/                       # byte-level tokens
    meshtrain prepare a.jsonl b.parquet --out corpus/ --tokenizer tok/tokenizer.json
    meshtrain prepare docs.jsonl --field body --out corpus/ --workers 2

Running it again on the same inputs and tokenizer does nothing.
"""

from __future__ import annotations

import dataclasses
import time

import tyro

from meshtrain import validate
from meshtrain.cli import parsing
from meshtrain.problem import Problem

__all__ = ["PrepareSettings", "main", "parse", "run"]

EXAMPLE = "meshtrain prepare notes/ --out corpus/"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareSettings(validate.Checked):
    """Tokenise text files, JSONL (one document per line) and Parquet (one per row) into
    memory-mapped tokens for --data.source tokens.

    Args:
        inputs: files or directories (.jsonl, .parquet, text).
        out: the output directory.
        tokenizer: 'bytes' (default) or a tokenizer.json / its directory.
        field: the JSONL field with the text.
        column: the Parquet column with the text.
        workers: tokenising processes (0: one per core).
        progress: show a progress bar.
        overwrite: write into a directory that holds another corpus (replaced) or other files.
    """

    inputs: tyro.conf.Positional[tuple[str, ...]]
    out: str
    tokenizer: str = "bytes"
    field: str = "text"
    column: str = "text"
    workers: int = 0
    progress: bool = True
    overwrite: bool = False

    def problems(self) -> list[Problem]:
        """What is wrong with these settings (empty when they can run)."""
        return validate.require(
            bool(self.inputs), "inputs", (), "give files or directories; e.g. " + EXAMPLE
        ) + validate.non_negative("workers", self.workers, example=0, note="0: one per core")


def run(settings: PrepareSettings) -> int:
    """Prepares the corpus and says what it wrote and how to train on it; returns 0."""
    from meshtrain.data.prepare import prepare_corpus

    s = settings
    start = time.perf_counter()
    m = prepare_corpus(
        list(s.inputs),
        s.out,
        tokenizer=s.tokenizer,
        field=s.field,
        column=s.column,
        workers=s.workers,
        progress=s.progress,
        overwrite=s.overwrite,
    )
    wall = time.perf_counter() - start
    tok = m["tokenizer"]
    what = (
        f"{m['num_documents']} document{'s' * (m['num_documents'] != 1)}, {m['num_tokens']} "
        f"tokens ({m['dtype']}), tokenizer {tok['name']} (vocab {tok['vocab_size']})"
    )
    if m["up_to_date"]:
        print(f"{s.out} is up to date ({what}); nothing to do")
    else:
        mb = m["text_bytes"] / 1e6
        print(f"prepared {s.out}: {what} from {mb:.3g} MB in {wall:.3g} s")
    vocab = f" --gpt.vocab-size {tok['vocab_size']}" if tok["vocab_size"] > 256 else ""
    print(f"train on it: meshtrain train --data.source tokens --data.path {s.out}{vocab}")
    return 0


def parse(argv: list[str]) -> PrepareSettings:
    """The settings the words after ``meshtrain prepare`` give."""
    return parsing.parse("prepare", PrepareSettings, argv, example=EXAMPLE)


def main(argv: list[str]) -> int:
    """``meshtrain prepare ARGV``."""
    return run(parse(argv))
