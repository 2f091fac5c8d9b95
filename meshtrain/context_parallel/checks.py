"""The run check's questions about context parallelism, answered before anything compiles."""

from __future__ import annotations

from collections.abc import Mapping

from meshtrain.context_parallel.attention import AXIS, algorithm_problems
from meshtrain.problem import Problem


def context_problems(
    sizes: Mapping[str, int], algorithm: str, *, seq_len: int | None, kind: str = "lm"
) -> list[Problem]:
    """What keeps a run with ``seq = sizes["seq"]`` from splitting its sequences.

    Args:
        sizes: mesh axis name → size.
        algorithm: the context-parallel algorithm (`Rules.context_parallel`).
        seq_len: the data's sequence length (None when unknown).
        kind: the data's kind (``"lm"`` for token sequences).

    Returns:
        The problems; none when ``seq = 1``. (Data without sequences is refused by
        `meshtrain.composition`.)
    """
    n = sizes.get(AXIS, 1)
    if n == 1:
        return []
    problems = algorithm_problems(algorithm)
    if kind == "lm" and seq_len is not None and seq_len % (2 * n):
        fix = -(-seq_len // (2 * n)) * 2 * n
        problems.append(
            Problem(
                "data.seq_len",
                seq_len,
                f"not divisible by 2 × seq = {2 * n}: context parallelism cuts each sequence "
                f"into 2·seq chunks to balance causal work; use --data.seq-len {fix} (a "
                f"multiple of {2 * n}) or a smaller seq",
            )
        )
    return problems


def heads_problems(sizes: Mapping[str, int], algorithm: str, heads: int) -> list[Problem]:
    """Ulysses splits the query heads over ``seq``: a count it does not divide."""
    n = sizes.get(AXIS, 1)
    if n == 1 or algorithm != "ulysses" or heads % n == 0:
        return []
    return [
        Problem(
            "gpt.n_heads",
            heads,
            f"context_parallel='ulysses' splits the heads over seq={n}, which does not divide "
            f"{heads}; use a head count divisible by {n}, or --context-parallel ring",
        )
    ]
