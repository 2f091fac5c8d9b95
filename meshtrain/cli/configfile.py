"""``--config FILE``: a JSON object of flag name → value (as ``meshtrain plan --write`` saves),
read and checked like the flags it stands for, then placed before the command line's flags so
that those win.

Each value is checked against its flag's type before tyro sees it (``"steps": "300"`` is a
string, not a number), and a config that refuses a value the file set says so in the file's
words: ``plan.json: data.batch-size=6: not divisible by data × fsdp = 4; ...; fix the file (or
give --data.batch-size on the command line, which wins over the file)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
import typing
from collections.abc import Iterator

from meshtrain import filevalues
from meshtrain.cli.errors import UsageError
from meshtrain.cli.parsing import flag_table, given, suggest
from meshtrain.filevalues import FileProblem, Key
from meshtrain.problem import Problem, RunCheckError

__all__ = ["ConfigFile", "expand", "read", "relabelled"]

READ_FIX = "fix the file, or write it again with meshtrain plan --write"
FIX, FLAG_FIX = "fix the file", "or give --{flag} on the command line, which wins over the file"


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """A ``--config`` file, read and checked.

    Attributes:
        path: the file, as the command line names it.
        values: flag name (without ``--``) → value of each flag the file sets and the command
            line does not, as the file holds them (whole numbers of integer flags as ints).
        keys: the `Key` of each of those flags (their problems are the file's).
        argv: the command line with those flags first and ``--config FILE`` removed.
    """

    path: str
    values: dict
    keys: dict[str, Key]
    argv: list[str]


def _kinds(hint) -> set:
    """The value types a field's annotation admits (``int | None`` → {int, NoneType})."""
    if typing.get_origin(hint) is typing.Annotated:
        return _kinds(typing.get_args(hint)[0])
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return set().union(*(_kinds(a) for a in typing.get_args(hint)))
    if typing.get_origin(hint) is typing.Literal:
        return {type(a) for a in typing.get_args(hint)}
    return {hint}


def _field_hint(cls: type, path: str):
    """The annotation of the dotted field `path` of settings class `cls`."""
    owner: typing.Any = cls
    for part in path.split("."):
        hint = typing.get_type_hints(owner, include_extras=True)[part]
        owner = next((k for k in _kinds(hint) if dataclasses.is_dataclass(k)), None)
    return hint


def _key(cls: type, path: str, name: str) -> Key | None:
    """What flag `name` (the dotted field `path` of `cls`) takes in a file; None when its type
    is not one JSON scalar (then tyro alone checks it)."""
    kinds = _kinds(_field_hint(cls, path))
    null = type(None) in kinds
    kinds.discard(type(None))
    field = name.replace("-", "_")
    if kinds == {int}:
        return Key(int, null=null, field=field)
    if kinds <= {int, float} and float in kinds:
        return Key(float, null=null, field=field)
    if kinds in ({bool}, {str}):
        return Key(next(iter(kinds)), null=null, field=field)
    return None


def _flags(values: dict, table: dict[str, str]) -> list[str]:
    """The file's values as flags (``"save": false`` and ``"no-save": true`` → ``--no-save``)."""
    out = []
    for name, value in values.items():
        if isinstance(value, bool):
            base = name[3:] if name.startswith("no-") and f"--{name[3:]}" in table else name
            on = value == (base == name)
            out.append(f"--{base}" if on else f"--no-{base}")
        else:
            out += [f"--{name}", str(value)]
    return out


def read(argv: list[str], cls: type) -> ConfigFile | None:
    """The ``--config`` file `argv` names, read and checked; None when it names none.

    Args:
        argv: the words after the subcommand.
        cls: the settings class the flags are for (`meshtrain.cli.train.TrainJob`).

    Raises:
        UsageError: no file after ``--config``, a file that cannot be read, or is not a JSON
            object; a key that is no flag; a value of the wrong type (every one at once, each
            ``FILE: key=value: ...; fix``).
    """
    if "--config" not in argv:
        return None
    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise UsageError("--config needs a file: --config plan.json")
    path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    if not os.path.isfile(path):
        why = "Is a directory" if os.path.isdir(path) else "No such file or directory"
        raise UsageError(
            f"--config {path}: cannot read it ({why}); give the JSON file meshtrain plan --write "
            "saved"
        )
    try:
        values = filevalues.read_json(path, READ_FIX, where=f"--config {path}")
    except ValueError as e:
        raise UsageError(str(e)) from None
    table = flag_table(cls)
    names = sorted(n[2:] for n in table)
    unknown: list[Problem] = [
        FileProblem(f"{path}: {name}", value, f"not a flag of this command{_hint(name, names)}")
        for name, value in values.items()
        if f"--{name}" not in table
    ]
    if unknown:
        raise UsageError(str(RunCheckError(unknown)))
    ours = given(rest, cls)  # a flag on the command line replaces the file's value
    values = {n: v for n, v in values.items() if table[f"--{n}"] not in ours}
    keys = {n: k for n in values if (k := _key(cls, table[f"--{n}"], n.removeprefix("no-")))}
    try:
        values = filevalues.checked(values, keys, path, FIX, flag_fix=FLAG_FIX)
    except RunCheckError as e:
        raise UsageError(str(e)) from None
    return ConfigFile(path, values, keys, _flags(values, table) + rest)


def _hint(name: str, names: list[str]) -> str:
    """`` (did you mean steps?)`` for the flag closest to `name`, then the fix."""
    close = suggest(name, names).removeprefix("; ")
    return (f" ({close})" if close else "") + f"; {FIX} (--help lists the flags)"


def expand(argv: list[str], cls: type) -> list[str]:
    """`argv` with ``--config FILE`` replaced by the file's flags, placed first (see `read`)."""
    file = read(argv, cls)
    return list(argv) if file is None else file.argv


def _file_lines(error: RunCheckError, file: ConfigFile) -> RunCheckError:
    """`error` with the problems of the file's values worded for the file."""
    return filevalues.relabel(
        error, file.values, file.keys, file.path, FIX, flag_fix=FLAG_FIX, example=True
    )


def _run_check_error(error: BaseException) -> RunCheckError | None:
    """The `RunCheckError` behind `error` (a config's check that tyro reported), if any."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, RunCheckError):
            return seen
        seen = seen.__context__
    return None


@contextlib.contextmanager
def relabelled(file: ConfigFile | None) -> Iterator[None]:
    """Inside, a refused value that `file` set is reported as the file's (``FILE: key=value:
    ...; fix the file ...``); other refusals pass unchanged."""
    if file is None:
        yield
        return
    try:
        yield
    except UsageError as e:
        found = _run_check_error(e)
        if found is None:
            raise
        lines = _file_lines(found, file)
        if [str(p) for p in lines.problems] == [str(p) for p in found.problems]:
            raise
        raise UsageError(str(lines)) from None
    except RunCheckError as e:
        raise _file_lines(e, file) from None
