"""Sphinx configuration of the dask-train documentation site (``make docs``).

The user guide is Markdown (myst-parser), so the same pages read well on GitHub; the API reference
is generated from the numpydoc docstrings of the names in ``dask_train.__all__`` (``api.rst``).
``tests/test_docs.py`` builds the site with warnings as errors, so a broken docstring fails CI.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The package in src/ (an editable install has it already; this serves a plain checkout).
sys.path.insert(0, str(ROOT / "src"))
# Importing the public names must not start anything: keep TensorFlow's logging quiet as well.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import dask_train  # noqa: E402

project = "dask-train"
author = "the dask-train developers"
copyright = "the dask-train developers"
release = dask_train.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
templates_path = ["_templates"]
exclude_patterns = ["_build", "generated/.gitignore", "Thumbs.db", ".DS_Store"]

# -- MyST: the user guide in Markdown ---------------------------------------------------------------
# Headings get GitHub's anchors, so `page.md#a-section` links work on GitHub and on the site alike.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# -- API reference ----------------------------------------------------------------------------------
# One page per public name, generated on every build into docs/generated/ (ignored by git).
autosummary_generate = True
autosummary_imported_members = True
# Signatures without annotations (the numpydoc "Parameters" sections give the types), as in the
# scikit-learn and Dask references; annotations name private and third-party types that would need
# intersphinx, which needs a network.
autodoc_typehints = "none"
autodoc_default_options = {"inherited-members": False}
autodoc_member_order = "bysource"
# numpydoc lists class members itself; autosummary tables of them would need a page per member.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# -- HTML: the PyData theme, as Dask, pandas and scikit-learn use -----------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"dask-train {release}"
html_static_path: list[str] = []
html_theme_options = {
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "header_links_before_dropdown": 4,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["theme-version"],
}
html_context = {"default_mode": "light"}
# The user-guide pages are single pages (no children), so no left sidebar: their wide benchmark
# tables get the room. The API reference keeps its navigation of the generated pages.
html_sidebars = {"*": [], "api": ["sidebar-nav-bs"]}
html_show_sourcelink = False


def _skip_foreign_members(app, what, name, obj, skip, options):  # type: ignore[no-untyped-def]
    # scikit-learn adds set_{fit,score,...}_request methods to every estimator subclass (metadata
    # routing); their docstrings point into scikit-learn's own glossary, which this site lacks.
    if (getattr(obj, "__module__", None) or "").startswith("sklearn."):
        return True
    return None


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("autodoc-skip-member", _skip_foreign_members)
