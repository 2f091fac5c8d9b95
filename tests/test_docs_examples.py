"""The documentation's complete Python examples run as written, each in a fresh interpreter.

An example is complete when it sets up its own devices (`mt.simulate_devices(...)`), as a
user's script would. The pages mark each such block with the line `<!-- runnable -->` right
above its fence (invisible on GitHub and in the built site), so a reader of the Markdown sees
which examples the suite runs. Fragments that continue an earlier example, such as the Hugging
Face one, are not scripts and are not run. The README and every page under docs/ are read.
"""

import pathlib
import re
import subprocess
import sys

import pytest
from _helpers import fresh_env

ROOT = pathlib.Path(__file__).parent.parent
MARK = "<!-- runnable -->"


def pages() -> list[pathlib.Path]:
    """The README and the documentation's Markdown pages (not the built site)."""
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md")) if "_build" not in p.parts]
    return [ROOT / "README.md", *docs]


def python_blocks() -> list[tuple[str, bool, str]]:
    """(page, marked runnable, code) for every Python block of every page."""
    found = []
    for page in pages():
        text = "\n" + page.read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            found.append((str(page.relative_to(ROOT)), before.strip() == MARK, match[1]))
    return found


BLOCKS = python_blocks()
RUNNABLE = [(page, code) for page, runnable, code in BLOCKS if runnable]
# Examples whose steps cost more than their compiles run with XLA's full optimisation, as a
# user's would: the README's 20 steps of the default GPT took about 36 CPU-s so, 41 with the
# suite's cheap compiles (LLVM -O0 makes every step slower).
FULLY_OPTIMISED = {"README.md"}


def test_the_docs_have_runnable_examples():
    assert {page for page, _ in RUNNABLE} >= {"README.md", "docs/getting_started.md"}


def test_complete_examples_are_exactly_the_runnable_ones():
    for page, runnable, code in BLOCKS:
        complete = "mt.simulate_devices(" in code
        assert complete == runnable, (
            f"{page}: a Python block that {'calls' if complete else 'does not call'} "
            f"mt.simulate_devices is {'' if runnable else 'not '}marked {MARK}:\n{code[:300]}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(RUNNABLE)), ids=[p for p, _ in RUNNABLE])
def test_docs_example_runs(index, tmp_path):
    env = fresh_env()
    if RUNNABLE[index][0] in FULLY_OPTIMISED:
        del env["XLA_FLAGS"]
    proc = subprocess.run(
        [sys.executable, "-c", RUNNABLE[index][1]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
