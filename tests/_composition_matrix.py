"""The composition matrix as the suite checks it: the library's cells and refusals
(`meshtrain.composition.matrix`) beside the proofs the test files' pair markers give
(`_pair_markers.evidence`)."""

from _pair_markers import Evidence, evidence

from meshtrain.composition.matrix import (
    EXCLUSIVE,
    FEATURES,
    GROUPS,
    KNOWN_GAPS,
    KNOWN_GAPS_BEYOND_PAIRS,
    Cell,
    cell,
    cells,
    missing,
    refused,
)

__all__ = [
    "EXCLUSIVE",
    "FEATURES",
    "GROUPS",
    "KNOWN_GAPS",
    "KNOWN_GAPS_BEYOND_PAIRS",
    "Cell",
    "Evidence",
    "cell",
    "cells",
    "evidence",
    "missing",
    "refused",
]
