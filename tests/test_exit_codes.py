"""The exit codes the CLI page documents are the ones the code returns: the table in
docs/cli.md ("Exit codes") is read, and each row is checked against what produces it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain import cli
from meshtrain.cli.errors import guarded
from meshtrain.train import stopping, watchdog
from meshtrain.train.hooks import NonFiniteError

CLI_PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def documented() -> dict[str, str]:
    """Code → its row's text, from the page's "Exit codes" table."""
    section = CLI_PAGE.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([0-9][0-9 +N]*) \| (.+) \|$", section, flags=re.M)
    return {code.strip(): text for code, text in rows}


def _raise(error: BaseException):
    """A command body that raises `error`."""

    def work() -> int:
        raise error

    return work


def _second_signal_status() -> int:
    """The status of a process that gets SIGTERM twice inside `StopSignals`."""
    code = (
        "import os, signal, time\n"
        "from meshtrain.train.hooks import StopSignals\n"
        "with StopSignals():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.5)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
    )
    return subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True).returncode


CHECKS = {
    "0": lambda: guarded("train", lambda: 0),
    "1": lambda: guarded("train", _raise(NonFiniteError("5 consecutive steps were not finite"))),
    "2": lambda: cli.main(["train", "--stpes", "3"]),
    "75": lambda: stopping.PEER_GONE_EXIT,
    "124": lambda: watchdog.HANG_EXIT,
    "130": lambda: guarded("train", _raise(KeyboardInterrupt())),
    "128 + N": lambda: _second_signal_status() - 128 == signal.SIGTERM and "128 + N",
}


def test_the_page_documents_exactly_the_codes_checked_here():
    assert set(documented()) == set(CHECKS)


@pytest.mark.parametrize("code", sorted(CHECKS))
def test_each_documented_code_is_what_the_code_returns(code, capsys):
    got = CHECKS[code]()
    assert str(got) == code, documented()[code]
