"""Sphinx configuration of meshtrain's documentation (`make docs` builds it into docs/_build)."""

from __future__ import annotations

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(DOCS, "_ext"))
sys.path.insert(0, os.path.dirname(DOCS))

# The API reference imports meshtrain; one simulated CPU device is all it needs.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "meshtrain"
author = "the meshtrain authors"
copyright = "the meshtrain authors"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "api_reference",
    "cli_reference",
    "refusals",
    "no_effect",
    "composition",
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
root_doc = "index"
smartquotes = False  # flags such as --steps and quotes in messages are shown as typed

# MyST: headings get anchors, so guides link to each other's sections (`page.md#anchor`).
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
suppress_warnings = ["myst.header"]  # notebooks open with their own title levels

# The notebooks are rendered from their committed, executed outputs; the test suite runs them.
nb_execution_mode = "off"
nb_merge_streams = True

# The API reference: the public API only, documented from the docstrings' Args/Returns.
autodoc_default_options = {"members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # a dataclass's fields: described once, as its members

# Nitpicky: every cross-reference inside the project must resolve. Types of other packages
# (jax, flax, optax, numpy, the standard library) are not documented here, so they are let go.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|flax|nnx|optax|orbax|numpy|np|jnp|grain|tyro|rich|tokenizers)(\..*)?"),
    (r"py:.*", r"(collections|typing|pathlib|os|dataclasses|enum|abc|types|concurrent)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Path|PathLike|NamedTuple)"),
    (r"py:.*", r"(Array|ArrayLike|PyTree|Mesh|NamedSharding|PartitionSpec|Module|Rngs|DType)"),
    (r"py:.*", r"(dtype|ndarray|GradientTransformation|Schedule|Optimizer|Shape)"),
    # Types of meshtrain's own modules that the public API returns but does not export.
    (r"py:.*", r"meshtrain\.(models|data|checkpoint|pipeline|comm|train|plan|replicas)\..*"),
    (r"py:.*", r"(ckpt\.CheckpointConfig|Rows|LossFn|NonFiniteError|num_train)"),
    # A Returns: line whose description napoleon reads as a type ("the embedding and head").
    (r"py:class", r".* .*"),
]

html_theme = "furo"
html_title = "meshtrain"
html_static_path: list[str] = []
html_show_sourcelink = False
