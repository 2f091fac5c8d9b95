"""Values read from files (``--config`` files, Hugging Face ``config.json``, corpus manifests),
checked like flags: one line naming the file and the key, with a fix that applies to files.

A reader describes each key it uses with a `Key` and calls `checked`, which refuses a value of
the wrong type before anything uses it (a string where a number belongs, ``true`` for a
count, ``2.5`` layers, ``Infinity``). When a config built from the file then refuses a value
(``n_layers=-2``), `relabel` turns the config's `Problem`, worded for a flag, into one worded
for the file::

    config.json: num_hidden_layers=-2: must be a positive integer; fix the file (or pass
    --gpt.n-layers when not using --init-from)

Values are shown as the file spells them (JSON): ``hidden_size="64"``, ``tie_word_embeddings=
"false"``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path

from meshtrain.problem import Problem, RunCheckError

__all__ = ["MISSING", "FileProblem", "Key", "checked", "read_json", "relabel"]

MISSING = object()  # the value of a `FileProblem` whose key the file does not hold
_EXAMPLE = re.compile(r"; e\.g\. --\S+ (.+)$")  # the flag example `validate` ends a message with


@dataclasses.dataclass(frozen=True)
class FileProblem(Problem):
    """A `Problem` with a value inside a file: ``field`` is ``"{file}: {key}"`` and the value is
    shown as JSON (``hidden_size="64"``), or not at all when the key is missing."""

    def __str__(self) -> str:
        shown = "" if self.value is MISSING else f"={_json(self.value)}"
        return f"{self.field}{shown}: {self.message}"


@dataclasses.dataclass(frozen=True)
class Key:
    """What one key of a file must hold.

    Args:
        kind: ``int``, ``float``, ``bool``, ``str``, ``dict`` (a JSON object) or ``list``. An
            ``int`` key takes whole numbers (``4`` or ``4.0``); a ``float`` key takes any
            finite number.
        low: the smallest value allowed (numbers only); None for no bound.
        strict: the value must be above `low`, not equal to it.
        required: the file must hold the key (a missing key is a problem).
        null: JSON ``null`` is allowed (the reader's default applies).
        field: the setting the key fills, as the CLI names it (``gpt.n_layers``); it ties the
            config's problems to the key (`relabel`) and names the flag in a fix.
    """

    kind: type
    low: float | None = None
    strict: bool = False
    required: bool = False
    null: bool = False
    field: str = ""


def _json(value) -> str:
    """`value` as the file spells it."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _fix(fix: str, flag_fix: str, field: str) -> str:
    """The fix of a value: `fix`, and `flag_fix` (``{flag}`` the field with dashes) when the key
    fills a setting."""
    if field and flag_fix:
        return f"{fix} ({flag_fix.format(flag=field.replace('_', '-'))})"
    return fix


def read_json(path: str | Path, fix: str, where: str | None = None) -> dict:
    """The JSON object in file `path`.

    Args:
        path: the file.
        fix: what to do about an unreadable file (``"fix the file or write it again with
            meshtrain plan --write"``).
        where: how error lines name the file (default: `path`).

    Returns:
        The parsed object.

    Raises:
        ValueError: one line naming the file: cannot be read, not UTF-8, not valid JSON (with
            the line and column), or not a JSON object.
    """
    where = str(path) if where is None else where
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror or e}); {fix}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte {e.start}); {fix}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{where}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}; {fix}"
        ) from None
    if not isinstance(data, dict):
        got = "an array" if isinstance(data, list) else f"the value {_json(data)}"
        raise ValueError(f"{where}: must hold a JSON object of key → value, not {got}; {fix}")
    return data


def _kind_message(key: Key, value) -> str:
    """What is wrong with the type or range of `value` for `key`; "" when nothing is."""
    quoted = _unquote(key.kind, value)
    if key.kind is bool:
        return "" if isinstance(value, bool) else f"must be true or false{quoted}"
    if key.kind is str:
        return "" if isinstance(value, str) else "must be a string (in double quotes)"
    if key.kind in (dict, list):
        word = "object" if key.kind is dict else "array"
        return "" if isinstance(value, key.kind) else f"must be a JSON {word}"
    word = "an integer" if key.kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be {word}, not {_type_name(value)}{quoted}"
    if not math.isfinite(value):
        return f"must be a finite {'integer' if key.kind is int else 'number'}"
    if key.kind is int and value != int(value):
        return "must be a whole number"
    if key.low is not None and (value <= key.low if key.strict else value < key.low):
        if key.kind is int and key.low == 1 and not key.strict:
            return "must be a positive integer"
        return f"must be {word} {'>' if key.strict else '≥'} {key.low:g}"
    return ""


def _unquote(kind: type, value) -> str:
    """`` (write it without quotes)`` for a string that reads as the value `kind` wants."""
    if not isinstance(value, str):
        return ""
    if kind is bool:
        fits = value.lower() in ("true", "false")
    else:
        try:
            fits = kind in (int, float) and math.isfinite(float(value))
        except ValueError:
            fits = False
    return " (write it without quotes)" if fits else ""


def _type_name(value) -> str:
    """The JSON name of `value`'s type."""
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    return "an array" if isinstance(value, list) else "an object"


def checked(
    values: Mapping,
    keys: Mapping[str, Key],
    where: str,
    fix: str,
    *,
    flag_fix: str = "",
    prefix: str = "",
) -> dict:
    """`values` after checking each key in `keys` (other keys pass as they are).

    Args:
        values: a JSON object read from a file.
        keys: key → what it must hold.
        where: the file, as error lines name it.
        fix: what fixes a wrong value in this file (``"fix the file"``).
        flag_fix: for a key that fills a setting, the other fix, with ``{flag}`` for the
            setting with dashes (``"or pass --{flag} when not using --init-from"``).
        prefix: how error lines name the object `values` is inside (``"tokenizer."``).

    Returns:
        A copy of `values` whose whole numbers for ``int`` keys are ints (``4.0`` → ``4``).

    Raises:
        RunCheckError: a `FileProblem` per wrong value, all at once.
    """
    out, problems = dict(values), list[Problem]()
    for name, key in keys.items():
        value = values.get(name, MISSING)
        if value is MISSING or value is None:
            if key.required or (value is None and not key.null):
                message = "missing; add it" if value is MISSING else "must not be null"
                problems.append(_problem(where, prefix + name, value, message, fix, flag_fix, key))
            continue
        message = _kind_message(key, value)
        if message:
            problems.append(_problem(where, prefix + name, value, message, fix, flag_fix, key))
        elif key.kind is int:
            out[name] = int(value)
    if problems:
        raise RunCheckError(problems)
    return out


def _problem(
    where: str, name: str, value, message: str, fix: str, flag_fix: str, key: Key
) -> FileProblem:
    """The `FileProblem` of key `name`: the message, then the fix."""
    return FileProblem(f"{where}: {name}", value, f"{message}; {_fix(fix, flag_fix, key.field)}")


def _owner(field: str, keys: Mapping[str, Key]) -> str | None:
    """The key whose setting `field` is (or lies inside: ``mesh.data`` in ``mesh``), if any."""
    for name, key in keys.items():
        if key.field and (field == key.field or field.startswith(key.field + ".")):
            return name
    return None


def relabel(
    error: RunCheckError,
    values: Mapping,
    keys: Mapping[str, Key],
    where: str,
    fix: str,
    *,
    flag_fix: str = "",
    example: bool = False,
    whole: bool = False,
) -> RunCheckError:
    """`error` with each problem of a setting that a key of the file filled worded for the file.

    Args:
        error: what a config built from the file's values raised.
        values: the file's values (the value shown is the file's).
        keys: key → `Key`; a problem belongs to the key whose ``field`` it names.
        where, fix, flag_fix: as for `checked`.
        example: keep the message's example value (``; e.g. steps=300``); without it the
            flag's example is dropped.
        whole: every setting came from the file: a problem no key owns is named after the
            file too (``config.json: gpt.rope_factor=...``).

    Returns:
        A `RunCheckError` with the same problems in the same order, those of the file's keys
        as `FileProblem` lines.
    """
    out = []
    for p in error.problems:
        name = _owner(p.field, keys)
        if isinstance(p, FileProblem) or (name is None and not whole):
            out.append(p)
            continue
        if name is None:
            out.append(dataclasses.replace(p, field=f"{where}: {p.field}"))
            continue
        found = _EXAMPLE.search(p.message)
        message = _EXAMPLE.sub("", p.message)
        if p.field != keys[name].field:  # a part of the key's value (mesh.data in "mesh")
            message = f"{p.field}={p.value!r}: {message}"
        if found and example:
            message += f"; e.g. {name}={found.group(1)}"
        value = values.get(name, p.value)
        out.append(_problem(where, name, value, message, fix, flag_fix, keys[name]))
    return RunCheckError(out)
