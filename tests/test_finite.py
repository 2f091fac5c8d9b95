"""Every float setting of every command refuses inf, -inf and nan: one line naming the setting,
exit code 2, before anything runs. The settings are found by reading each command's settings
dataclass, so a float flag added later is covered without a new line here."""

from __future__ import annotations

import dataclasses
import sys
import typing

import pytest

from meshtrain import cli, validate
from meshtrain.cli import parsing

# Words a command needs besides the flag under test (a launch runs a harmless program).
REQUIRED = {
    "generate": ["runs/none"],
    "prepare": ["notes", "--out", "corpus"],
    "launch": ["--nproc", "1"],
}
AFTER = {"launch": ["--", sys.executable, "-c", "pass"]}
# What makes a setting count, so that its own check answers (dotted-field prefix → flags).
CONTEXT = {
    "gpt.rope_factor": ["--gpt.rope-scaling", "llama3"],
    "gpt.rope_low_freq_factor": ["--gpt.rope-scaling", "llama3"],
    "gpt.rope_high_freq_factor": ["--gpt.rope-scaling", "llama3"],
    "moe.capacity_factor": ["--model", "moe", "--moe.dispatch", "capacity"],
    "moe.": ["--model", "moe"],
    "precision.loss_scale_init": ["--precision", "fp16"],
    "sync.outer_": ["--sync-every", "4"],
}
VALUES = ("inf", "-inf", "nan")


def _settings_class(name: str) -> type:
    """The settings dataclass a command's ``run`` takes."""
    run = cli._module(name).run
    hints = typing.get_type_hints(run)
    return hints[next(iter(hints))]


def _is_float(hint) -> bool:
    """True for ``float``, ``float | None`` and an Annotated float."""
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    return hint is float or float in typing.get_args(hint)


def _float_fields(cls: type, path: str = "") -> list[str]:
    """The dotted fields of `cls` (its sections' included) whose type is a float."""
    found = []
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        inner = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
        if isinstance(inner, type) and dataclasses.is_dataclass(inner):
            found += _float_fields(inner, f"{path}{f.name}.")
        elif _is_float(hint):
            found.append(f"{path}{f.name}")
    return found


def _float_flags() -> list[tuple[str, str, str]]:
    """(command, flag, dotted field) for every float setting of every command."""
    rows = []
    for name in cli.COMMANDS:
        cls = _settings_class(name)
        flag_of = {field: flag for flag, field in parsing.flag_table(cls).items()}
        rows += [(name, flag_of[field], field) for field in _float_fields(cls)]
    return rows


FLOAT_FLAGS = _float_flags()


def test_the_float_settings_are_found():
    found = {(name, flag) for name, flag, _ in FLOAT_FLAGS}
    for known in [("train", "--lr"), ("train", "--clip-norm"), ("inspect", "--gpt.norm-eps")]:
        assert known in found
    for known in [("launch", "--grace"), ("launch", "--restart-delay")]:
        assert known in found
    assert ("generate", "--temperature") in found and ("plan", "--client-fraction") in found


@pytest.fixture
def nothing_runs(monkeypatch):
    """Replaces each command's work (launch's excepted: its checks live in it) with a stub
    that records the call, so an accepted value shows up as exit code 0 and a record."""
    ran = []
    for name in cli.COMMANDS:
        if name != "launch":
            monkeypatch.setattr(cli._module(name), "run", lambda *a, **k: ran.append(a) or 0)
    return ran


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize(("name", "flag", "field"), FLOAT_FLAGS, ids=lambda x: str(x))
def test_every_float_setting_refuses_a_non_finite_value(
    name, flag, field, value, nothing_runs, capsys, monkeypatch, tmp_path
):
    monkeypatch.chdir(tmp_path)
    context = next((words for key, words in CONTEXT.items() if field.startswith(key)), [])
    argv = [name, *REQUIRED.get(name, []), *context, flag, value, *AFTER.get(name, [])]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and not nothing_runs, (argv, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith(f"meshtrain {name}: error: "), line
    assert field.rsplit(".", 1)[-1] in line.replace("-", "_") and value in line, line
    assert "Traceback" not in out + err


@pytest.mark.parametrize(
    ("problems", "line"),
    [
        (validate.above("lr", float("inf"), 0), "lr=inf: must be a finite number > 0"),
        (
            validate.at_least("grace", float("-inf"), 0, integer=False),
            "grace=-inf: must be a finite number ≥ 0",
        ),
        (validate.in_range("b1", float("nan"), 0, 1), "b1=nan: must be a number in [0, 1]"),
        (validate.above("cap", float("inf"), 0, allow_inf=True), None),
        (validate.non_negative("t", float("inf"), integer=False, allow_inf=True), None),
    ],
)
def test_the_validation_vocabulary_refuses_infinity_unless_allowed(problems, line):
    assert [str(p) for p in problems] == ([line] if line else [])


def test_is_number_takes_finite_reals_only():
    assert validate.is_number(1.5) and validate.is_number(3)
    for bad in (float("inf"), float("-inf"), float("nan"), True, "1"):
        assert not validate.is_number(bad), bad
    assert validate.is_number(float("inf"), allow_inf=True)
    assert not validate.is_number(float("nan"), allow_inf=True)
