"""One row of the refusal table: two features that do not run together, and the one-line
`Problem` the run check files for a run that has both (the table: `meshtrain.composition`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from meshtrain.models import families
from meshtrain.problem import Problem
from meshtrain.run import RunSpec

__all__ = ["Refusal", "model_name"]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Two features that do not run together.

    Args:
        first: the feature whose setting is named (``"gradient compression"``).
        second: the feature it does not run with (``"pipelines"``).
        reason: why, in a few words.
        applies: ``run → bool``: whether `run` has both features.
        field: the setting the problem is filed under, as the CLI names it without dashes;
            ``{model}`` stands for the model family (``gpt.attention_impl``).
        fix: what to change, naming the flags (``{model}`` as in `field`).
        value: ``run → value`` of `field`, shown in the line.
        example: ``() → (with_pair, without_pair)``: two dicts of run attributes, the first
            refused for this pair, the second the same run with one of the two features
            removed (the table's test builds runs from them).
        cells: the cells of the composition matrix this row refuses, as pairs of feature ids
            (`meshtrain.composition.matrix.FEATURES`); empty where neither feature is one.
        touches: the cells this row refuses only under a setting that is no feature of the
            matrix (``second`` names it: "pipelines with global-norm clipping"); they run
            without that setting, and the matrix shows them as conditional.
        by_default: whether that setting is a default (`--clip-norm 1.0`), so a run with both
            features of a touched cell is refused unless the user changes it.
    """

    first: str
    second: str
    reason: str
    applies: Callable[[RunSpec], bool]
    field: str
    fix: str
    value: Callable[[RunSpec], object] = lambda run: None
    example: Callable[[], tuple[dict, dict]] | None = None
    cells: tuple[tuple[str, str], ...] = ()
    touches: tuple[tuple[str, str], ...] = ()
    by_default: bool = False

    def problem(self, run: RunSpec) -> Problem:
        """The one-line `Problem` for `run` (which `applies`)."""
        name = model_name(run.model)
        fix = self.fix.format(model=name)
        message = f"{self.first} with {self.second}: {self.reason}; {fix}"
        return Problem(self.field.format(model=name), self.value(run), message)


def model_name(model) -> str:
    """The family name of a model config (``gpt`` for anything else)."""
    return next((n for n, f in families().items() if isinstance(model, f.config)), "gpt")
