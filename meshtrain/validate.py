"""One vocabulary for checking settings: each helper returns ``list[Problem]`` in one wording.

A config dataclass derives from `Checked` and lists what is wrong with it in ``problems()``,
built from these helpers; making one with a problem raises them all at once::

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class TrainConfig(validate.Checked):
        ...
        def problems(self) -> list[Problem]:
            return validate.positive("steps", self.steps, example=300) + validate.one_of(
                "loss", self.loss, LOSSES
            )

Every line names the field (as the CLI spells it, without dashes), the value and the fix:
``steps=0: must be a positive integer; e.g. --steps 300``.

Numbers are finite: NaN is never accepted, and neither is ±inf unless a setting documents
what infinity means there and passes ``allow_inf=True``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable

from meshtrain.problem import Problem, RunCheckError

__all__ = [
    "Checked",
    "above",
    "at_least",
    "check",
    "divides",
    "in_range",
    "is_int",
    "is_number",
    "non_negative",
    "one_of",
    "positive",
    "reject",
    "require",
]


def is_int(value) -> bool:
    """True for Python and numpy integers, never for bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value, *, allow_inf: bool = False) -> bool:
    """True for finite real numbers (ints and floats, numpy's too), never for bools or NaN;
    ±inf too with ``allow_inf=True``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return not math.isnan(value) and (allow_inf or not math.isinf(value))


def _kind(value, integer: bool) -> str:
    """``"an integer"``, ``"a number"``, or ``"a finite number"`` for an infinite value."""
    if integer:
        return "an integer"
    infinite = is_number(value, allow_inf=True) and math.isinf(value)
    return "a finite number" if infinite else "a number"


def _fix(field: str, flag: str | None, example) -> str:
    """``"; e.g. --steps 300"`` (the flag derived from the field unless given), or ``""``."""
    if example is None:
        return ""
    flag = flag or "--" + field.replace("_", "-")
    return f"; e.g. {flag} {example}"


def _one(
    field: str, value, message: str, flag: str | None, example, note: str | None
) -> list[Problem]:
    """One `Problem` with the shared ending: the note, then an example."""
    tail = f" ({note})" if note else ""
    return [Problem(field, value, message + tail + _fix(field, flag, example))]


def positive(
    field: str, value, *, flag: str | None = None, example=None, note=None
) -> list[Problem]:
    """Integers ≥ 1.

    Args:
        field: the setting as the CLI names it without dashes (``steps``, ``gpt.n_heads``).
        value: its value.
        flag: the flag in the example; default ``--`` and the field with dashes.
        example: a good value to show; None shows none.
        note: what the setting means or what a special value does, in brackets.

    Returns:
        ``[Problem(field, value, "must be a positive integer...")]``, or ``[]`` when fine.
    """
    if is_int(value) and value >= 1:
        return []
    return _one(field, value, "must be a positive integer", flag, example, note)


def non_negative(
    field: str,
    value,
    *,
    integer: bool = True,
    allow_inf: bool = False,
    flag=None,
    example=None,
    note=None,
) -> list[Problem]:
    """Integers ≥ 0 (numbers ≥ 0 with ``integer=False``); same arguments as `at_least`."""
    return at_least(
        field,
        value,
        0,
        integer=integer,
        allow_inf=allow_inf,
        flag=flag,
        example=example,
        note=note,
    )


def at_least(
    field: str, value, low, *, integer=True, allow_inf=False, flag=None, example=None, note=None
) -> list[Problem]:
    """Integers ≥ `low` (finite numbers ≥ `low` with ``integer=False``).

    Args:
        field, value, flag, example, note: as `positive`.
        low: the smallest value accepted.
        integer: accept integers only.
        allow_inf: accept +inf too (only where the setting documents what it means).

    Returns:
        ``[Problem(field, value, "must be a number ≥ low...")]``, or ``[]``.
    """
    ok = is_int(value) if integer else is_number(value, allow_inf=allow_inf)
    if ok and value >= low:
        return []
    return _one(field, value, f"must be {_kind(value, integer)} ≥ {low}", flag, example, note)


def above(
    field: str, value, low, *, allow_inf=False, flag=None, example=None, note=None
) -> list[Problem]:
    """Finite numbers > `low` (+inf too with ``allow_inf=True``); arguments as `at_least`."""
    if is_number(value, allow_inf=allow_inf) and value > low:
        return []
    return _one(field, value, f"must be {_kind(value, False)} > {low}", flag, example, note)


def in_range(
    field: str,
    value,
    low,
    high,
    *,
    closed: str = "[]",
    integer=False,
    flag=None,
    example=None,
    note=None,
) -> list[Problem]:
    """Numbers in an interval, ``[low, high]`` by default.

    Args:
        field, value, flag, example, note: as `positive`.
        low, high: the ends.
        closed: the brackets, ``"[]"``, ``"[)"``, ``"(]"`` or ``"()"``.
        integer: accept integers only.
        allow_inf: accept ±inf where an end is infinite (only where the setting documents
            what infinity means).

    Returns:
        ``[Problem(field, value, "must be a number in [low, high)...")]``, or ``[]``.
    """
    ok = is_int(value) if integer else is_number(value)
    if ok:
        lower = value >= low if closed[0] == "[" else value > low
        upper = value <= high if closed[1] == "]" else value < high
        if lower and upper:
            return []
    kind = _kind(value, integer)
    interval = f"{closed[0]}{low}, {high}{closed[1]}"
    return _one(field, value, f"must be {kind} in {interval}", flag, example, note)


def one_of(
    field: str, value, choices: Iterable, *, flag=None, example=None, note=None
) -> list[Problem]:
    """A value among `choices`; arguments as `positive` (the example defaults to the first)."""
    choices = tuple(choices)
    if value in choices:
        return []
    example = choices[0] if example is None and choices else example
    message = f"choose from {', '.join(map(str, choices))}"
    return _one(field, value, message, flag, example, note)


def divides(
    field: str, value, by: int, *, what: str = "", flag=None, example=None, note=None
) -> list[Problem]:
    """An integer that `by` divides (a multiple of `by`); `what` names `by` in the message.

    Returns:
        ``[Problem(field, value, "not divisible by n_heads = 4; use a multiple of 4")]``, or
        ``[]``; nothing when `value` or `by` is not a positive integer (another check says so).
    """
    if not (is_int(value) and is_int(by)) or by < 1 or value % by == 0:
        return []
    named = f"{what} = {by}" if what else str(by)
    message = f"not divisible by {named}; use a multiple of {by}"
    return _one(field, value, message, flag, example, note)


def require(ok: bool, field: str, value, message: str) -> list[Problem]:
    """A free-form check: ``[Problem(field, value, message)]`` unless `ok`."""
    return [] if ok else [Problem(field, value, message)]


def check(field: str, value, fn: Callable, *args, **kwargs) -> list[Problem]:
    """A function that raises ValueError (a parser, another module's check) as Problems.

    A message that starts by naming the field and the value (``gpt remat='x': ...``) keeps
    only what follows, so the line does not say them twice.
    """
    try:
        fn(*args, **kwargs)
    except RunCheckError as e:
        return list(e.problems)
    except ValueError as e:
        text = str(e)
        prefix, _, name = field.rpartition(".")
        for head in (f"{field}={value!r}", f"{prefix} {name}={value!r}", f"{name}={value!r}"):
            if text.startswith(head):
                text = text[len(head) :].lstrip(": ")
                break
        return [Problem(field, value, text)]
    return []


class Checked:
    """A config that checks itself when made: a dataclass deriving from it raises
    `RunCheckError` listing its ``problems()`` from ``__post_init__`` (see `reject`)."""

    def __post_init__(self):
        reject(self)

    def problems(self) -> list[Problem]:
        """What is wrong with these settings; an empty list when nothing."""
        return []


def reject(config) -> None:
    """Raises `RunCheckError` (a ValueError) listing ``config.problems()``, when any.

    Args:
        config: an object with ``problems() -> list[Problem]``; called from ``__post_init__``.

    Raises:
        RunCheckError: one line per problem.
    """
    problems = config.problems()
    if problems:
        raise RunCheckError(problems)
