"""The values of a prepared corpus's ``manifest.json``, checked like flags before the ``tokens``
source uses them: each wrong one is a line naming the file and the key."""

from __future__ import annotations

import os

import numpy as np

from meshtrain import filevalues
from meshtrain.data.prepare import MANIFEST
from meshtrain.filevalues import MISSING, FileProblem, Key
from meshtrain.problem import Problem, RunCheckError

# The keys the tokens source reads.
KEYS = {
    "format": Key(str, required=True),
    "dtype": Key(str, required=True),
    "num_tokens": Key(int, 0, required=True),
    "num_documents": Key(int, 0, required=True),
    "max_id": Key(int, -1),
    "input_hash": Key(str, required=True),
}
TOKENIZER_KEYS = {
    "name": Key(str, required=True),
    "vocab_size": Key(int, 1, required=True),
    "eos_id": Key(int, 0, null=True),
    "fingerprint": Key(str, required=True),
}
DTYPES = ("uint8", "uint16", "uint32")  # what `prepare_corpus` writes token ids as


def fix(directory: str) -> str:
    """What fixes a wrong value in the manifest of `directory`."""
    again = f"meshtrain prepare FILES --out {directory}"
    return f"restore the file, or prepare the corpus again: {again}"


def _checked(values, keys, where: str, fix: str, prefix: str = "") -> tuple[dict, list[Problem]]:
    """`filevalues.checked`, its problems returned instead of raised."""
    try:
        return filevalues.checked(values, keys, where, fix, prefix=prefix), []
    except RunCheckError as e:
        return dict(values), e.problems


def checked_manifest(directory: str, manifest: dict) -> dict:
    """`manifest` (of the corpus in `directory`) after checking every value the source reads.

    Raises:
        RunCheckError: one ``.../manifest.json: key=value: ...; fix`` line per wrong value.
    """
    where, repair = os.path.join(directory, MANIFEST), fix(directory)
    out, problems = _checked(manifest, KEYS, where, repair)
    tokenizer = manifest.get("tokenizer", MISSING)
    if isinstance(tokenizer, dict):
        out["tokenizer"], more = _checked(tokenizer, TOKENIZER_KEYS, where, repair, "tokenizer.")
        problems += more
    else:
        message = "missing; add it" if tokenizer is MISSING else "must be a JSON object"
        problems.append(FileProblem(f"{where}: tokenizer", tokenizer, f"{message}; {repair}"))
    dtype, vocab = out.get("dtype"), out.get("tokenizer", {}).get("vocab_size")
    if isinstance(dtype, str) and dtype not in DTYPES:
        message = f"choose from {', '.join(DTYPES)}; {repair}"
        problems.append(FileProblem(f"{where}: dtype", dtype, message))
    elif not problems and vocab > 2 ** (8 * np.dtype(dtype).itemsize):
        message = f"cannot hold the ids below tokenizer.vocab_size={vocab}; {repair}"
        problems.append(FileProblem(f"{where}: dtype", dtype, message))
    if problems:
        raise RunCheckError(problems)
    return out
