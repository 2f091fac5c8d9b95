"""The documentation site builds without a warning, and its references cover the whole interface.

The site is built once, strictly (`sphinx -W`, nitpicky: a broken link, reference or docstring
fails), into a temporary folder; under `make test`, which has just built it as strictly, the
test reads that build (``MESHTRAIN_DOCS_SITE``). Then every public name of `meshtrain`,
`meshtrain.lower`, `meshtrain.hf` and `meshtrain.kernels` must be described in the API
reference, and every subcommand the CLI lists in the CLI reference, with the help it prints.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
pytestmark = pytest.mark.xdist_group("docs")  # one worker builds the site once

PAGES = {
    "meshtrain": "api/meshtrain.html",
    "meshtrain.lower": "api/lower.html",
    "meshtrain.hf": "api/hf.html",
    "meshtrain.kernels": "api/kernels.html",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    built = os.environ.get("MESHTRAIN_DOCS_SITE")  # `make test` built it strictly just before
    if built and (ROOT / built / "index.html").exists():
        return ROOT / built
    out = tmp_path_factory.mktemp("docs")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q"]
    cmd += ["-d", str(out / "doctrees"), "docs", str(out / "html")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"the docs build warned or failed:\n{proc.stderr[-4000:]}"
    return out / "html"


def described(html: str) -> set[str]:
    """The names of the objects a page describes (the bold name of each signature)."""
    return set(re.findall(r'<span class="sig-name descname"><span class="pre">(\w+)</span>', html))


@pytest.mark.parametrize("module", list(PAGES))
def test_every_public_name_is_in_the_api_reference(site, module):
    public = __import__(module, fromlist=["__all__"]).__all__
    missing = set(public) - described((site / PAGES[module]).read_text())
    assert not missing, f"{module}: not in {PAGES[module]}: {sorted(missing)}"


def test_every_subcommand_is_in_the_cli_reference(site):
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from cli_reference import commands  # meshtrain.cli.COMMANDS, in the order it lists them

    from meshtrain import cli

    names = list(commands())
    assert names == list(cli.COMMANDS)
    page = (site / "cli.html").read_text()
    for name in names:
        assert f'id="meshtrain-{name}"' in page, f"meshtrain {name}: no section in cli.html"
        assert f"usage: meshtrain {name}" in page, f"meshtrain {name}: its help is not shown"


def test_every_notebook_is_rendered_with_its_committed_outputs(site):
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        page = site / "notebooks" / f"{notebook.stem}.html"
        assert page.exists(), f"{notebook.name} is not rendered"
        cells = json.loads(notebook.read_text())["cells"]
        assert any(cell.get("outputs") for cell in cells), f"{notebook.name}: saved unexecuted"
        assert 'class="cell_output' in page.read_text(), f"{notebook.name}: outputs not shown"


def test_the_readme_is_one_screen_and_its_links_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert any(t.startswith("docs/") for t in local)
    for target in local:
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_every_refused_pair_is_in_the_validation_guide(site):
    import html

    from meshtrain.composition import REFUSALS

    page = html.unescape((site / "guides" / "validation.html").read_text())
    for r in REFUSALS:
        assert f"{r.first}</p></td>" in page and r.reason in page, f"{r.first} + {r.second}"
