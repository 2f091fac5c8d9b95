"""The run check's questions about context parallelism, answered before anything compiles."""

from __future__ import annotations

from collections.abc import Mapping

from meshtrain.context_parallel.attention import AXIS, algorithm_problems
from meshtrain.mesh import PIPE
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
        The problems; none when ``seq = 1``.
    """
    n = sizes.get(AXIS, 1)
    if n == 1:
        return []
    problems = algorithm_problems(algorithm)
    if sizes.get(PIPE, 1) > 1:
        problems.append(
            Problem(
                "mesh.seq",
                n,
                f"context parallelism does not compose with pipelines (pipe={sizes[PIPE]}) "
                "yet; set seq=1 or pipe=1",
            )
        )
    if kind != "lm":
        problems.append(
            Problem("mesh.seq", n, f"{kind!r} data has no sequence to split; set seq=1")
        )
    elif seq_len is not None and seq_len % (2 * n):
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


def heads_problem(sizes: Mapping[str, int], algorithm: str, heads: int) -> Problem | None:
    """Ulysses splits the query heads over ``seq``: a count it does not divide, or None."""
    n = sizes.get(AXIS, 1)
    if n == 1 or algorithm != "ulysses" or heads % n == 0:
        return None
    return Problem(
        "gpt.n_heads",
        heads,
        f"context_parallel='ulysses' splits the heads over seq={n}, which does not divide "
        f"{heads}; use a head count divisible by {n}, or --context-parallel ring",
    )
