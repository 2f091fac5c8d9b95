"""The README's complete Python examples (those that set up their own devices, as a user's
script would) run as written, each in a fresh interpreter. Fragments that continue an
earlier example, such as the Hugging Face one, are not scripts and are not run."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"
BLOCKS = [
    block
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    if "mt.simulate_devices(" in block
]


def test_the_readme_has_python_examples():
    assert BLOCKS


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKS[index]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
