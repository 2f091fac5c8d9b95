"""``meshtrain generate``: sample text from a checkpoint with its tokenizer.

meshtrain generate runs/default --prompt "def " --tokens 200       # a run's newest step
meshtrain generate runs/a/checkpoints/200 --temperature 0.7 --top-p 0.9
meshtrain generate hf:exported --top-k 40 --seed 1                 # a Hugging Face directory
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import tyro

from meshtrain.cli import parsing

__all__ = ["GenerateSettings", "main", "parse", "run"]

EXAMPLE = "meshtrain generate runs/default --prompt 'def '"

# What orbax logs (through absl) each time a checkpoint is opened read-only: true, expected,
# and of no use to someone sampling from it.
_READ_ONLY_NOTES = ("CheckpointManagerOptions.read_only=True", "Given directory is read only")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateSettings:
    """Sample text from a meshtrain checkpoint or a Hugging Face directory.

    Args:
        source: run / checkpoint / step directory, or hf:PATH.
        prompt: text to continue (at most the model's context, max_seq_len, in tokens).
        tokens: tokens to sample.
        temperature: softmax temperature; 0: greedy.
        top_k: k most probable tokens only (0: all).
        top_p: nucleus mass (1: all).
        seed: random seed.
        tokenizer: override: 'bytes' or a tokenizer.json (default: the checkpoint's own).
    """

    source: tyro.conf.Positional[str]
    prompt: str = "def "
    tokens: int = 200
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    tokenizer: str = ""

    def __post_init__(self):
        """Refuses a sampling setting out of range (or not finite) when the flags are read."""
        from meshtrain import generate as gen

        s = self
        gen.check_settings(n_new=s.tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)


class _ReadOnlyNotes(logging.Filter):
    """Drops orbax's notes about opening a checkpoint read-only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_READ_ONLY_NOTES)


@contextlib.contextmanager
def _quiet_read_only():
    """Silences `_READ_ONLY_NOTES` (and nothing else) while a checkpoint is read."""
    quiet, logger = _ReadOnlyNotes(), logging.getLogger("absl")
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def run(settings: GenerateSettings) -> int:
    """Loads the checkpoint, samples and prints the text; returns 0."""
    from meshtrain import generate as gen

    s = settings
    with _quiet_read_only():
        model, tokenizer = gen.load(s.source, s.tokenizer or None)
    text = gen.generate(
        model,
        tokenizer,
        s.prompt,
        s.tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        seed=s.seed,
    )
    print(text)
    return 0


def parse(argv: list[str]) -> GenerateSettings:
    """The settings the words after ``meshtrain generate`` give."""
    return parsing.parse("generate", GenerateSettings, argv, example=EXAMPLE)


def main(argv: list[str]) -> int:
    """``meshtrain generate ARGV``."""
    return run(parse(argv))
