"""Settings from the command line: tyro builds the flags from a settings dataclass, and every
mistake it finds becomes a `UsageError` of one line (flag, value, fix; "did you mean")."""

from __future__ import annotations

import dataclasses
import difflib
import typing

import tyro

from meshtrain import _compat
from meshtrain.cli.errors import UsageError
from meshtrain.launch import option_value

__all__ = ["flag_table", "given", "parse", "suggest"]

_POSITIONAL = typing.get_args(tyro.conf.Positional[int])[1:]
_SUPPRESS = typing.get_args(tyro.conf.Suppress[int])[1:]
_ARG = type(tyro.conf.arg())  # a field's flag settings, e.g. tyro.conf.arg(name="precision")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def flag_table(cls: type, prefix: str = "", path: str = "") -> dict[str, str]:
    """Every flag of the settings class `cls` → the dotted field it sets.

    ``--gpt.n-layers`` → ``gpt.n_layers``, ``--steps`` → ``train.steps`` (a section tyro
    shows without its prefix), ``--no-save`` → ``save``. Positional fields have no flag.
    """
    hints = typing.get_type_hints(cls, include_extras=True)
    table = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        marks = hint.__metadata__ if typing.get_origin(hint) is typing.Annotated else ()
        if any(m in marks for m in (*_POSITIONAL, *_SUPPRESS)):
            continue
        kind = typing.get_args(hint)[0] if marks else hint
        where = f"{path}{f.name}"
        renamed = [getattr(m, "name", None) for m in marks if isinstance(m, _ARG)]
        named = next((n for n in renamed if n), f.name)
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            inner = prefix if tyro.conf.OmitArgPrefixes in marks else f"{prefix}{_flag(f.name)}."
            table.update(flag_table(kind, inner, f"{where}."))
            continue
        table[f"--{prefix}{_flag(named)}"] = where
        if kind is bool:
            table[f"--{prefix}no-{_flag(named)}"] = where
    return table


def given(argv: list[str], cls: type) -> frozenset[str]:
    """The dotted fields of `cls` that a flag in `argv` sets (even to its default value)."""
    table = flag_table(cls)
    return frozenset(table[a.split("=")[0]] for a in argv if a.split("=")[0] in table)


def suggest(word: str, options) -> str:
    """``"; did you mean X?"`` for the closest of `options` to `word`, else ``""``."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _number_fix(flag: str, value: str, expected: type, default) -> str:
    """What a value flag needs: ``not a whole number; write it as digits: --steps 1000``."""
    if expected is int:
        try:
            whole = float(value)
        except ValueError:
            whole = None
        if whole is not None and whole.is_integer():
            return f"not a whole number; write it as digits: {flag} {int(whole)}"
        return f"not a whole number; e.g. {flag} {default if default is not None else 1}"
    if expected is float:
        return f"not a number; e.g. {flag} {default if default is not None else 0.5}"
    return f"not a valid {expected.__name__}"


def _line(name: str, cls: type, argv: list[str], failure, example: str) -> str:
    """The one line that replaces tyro's error box."""
    helps = f"meshtrain {name} --help lists the flags"
    if failure.kind == "config":
        return failure.message
    if failure.kind == "value" and failure.flags:
        flag = failure.flags[-1]
        value = failure.value if failure.value is not None else option_value(argv, flag)
        if failure.expected in (int, float) and value is not None:
            return f"{flag} {value}: {_number_fix(flag, value, failure.expected, failure.default)}"
        return f"{flag} {value if value is not None else ''}: {failure.message or 'needs a value'}"
    if failure.kind == "choice" and failure.flags:
        flag = failure.flags[-1]
        hint = suggest(failure.value, failure.choices)
        return f"{flag} {failure.value}: choose from {', '.join(failure.choices)}{hint}"
    if failure.kind == "missing":
        what = ", ".join(f.upper() if not f.startswith("-") else f for f in failure.flags)
        return f"missing {what}; e.g. {example}" if example else f"missing {what}; {helps}"
    if failure.kind == "unknown" and failure.flags:
        words = [t for t in failure.flags if t.startswith("-")]
        if not words:
            return f"unexpected argument {failure.flags[0]!r}; {helps}"
        word = words[0].split("=")[0]
        hint = suggest(word, flag_table(cls))
        return f"unknown flag {word}{hint or '; ' + helps}"
    return f"cannot read the command line ({failure.message or failure.kind}); {helps}"


def parse(name: str, cls: type, argv: list[str], *, description: str = "", example: str = ""):
    """The settings `cls` that `argv` (the words after ``meshtrain NAME``) give.

    Args:
        name: the subcommand, for ``usage: meshtrain NAME`` and the error lines.
        cls: the settings dataclass.
        argv: the words after the subcommand.
        description: the help's first paragraph (default: the class docstring).
        example: a command line that works, shown when a required argument is missing.

    Returns:
        An instance of `cls`.

    Raises:
        UsageError: one line naming the flag, the value and the fix.
        SystemExit: ``--help`` (code 0), after printing the help.
    """

    def refuse(failure) -> None:
        raise UsageError(_line(name, cls, argv, failure, example))

    with _compat.tyro_parse_failures(refuse):
        return tyro.cli(
            cls, args=list(argv), prog=f"meshtrain {name}", description=description or None
        )
