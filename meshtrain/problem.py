"""`Problem`: one thing wrong with a run's settings, as one line that names the fix."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Problem:
    """A setting that cannot work, found before anything compiles.

    Args:
        field: the setting, as the CLI names it without dashes (``data.batch_size``).
        value: its value.
        message: what is wrong and the fix, e.g. ``"not divisible by data × fsdp = 4; use a
            multiple of 4"``.
    """

    field: str
    value: object
    message: str

    def __str__(self) -> str:
        return f"{self.field}={self.value!r}: {self.message}"


class RunCheckError(ValueError):
    """Settings that cannot work; ``problems`` holds each, and the message has one per line."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def raise_if(problems: list[Problem]) -> None:
    """Raises `RunCheckError` when there is any problem."""
    if problems:
        raise RunCheckError(problems)
