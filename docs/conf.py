"""Sphinx configuration: myst-nb pages and notebooks (never executed), autodoc API, furo.

Build (warnings are errors, broken cross-references fail):
``sphinx-build -W --keep-going -n -b html docs docs/_build/html``.
"""

import pathlib
import shutil
import sys

from sphinx.ext.napoleon.docstring import GoogleDocstring
from sphinx.util.nodes import make_refnode

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the packages and examples/ import from the checkout

# The notebooks live in notebooks/ beside their jupytext sources; Sphinx reads only its own
# source tree, so the .ipynb files are copied into docs/notebooks/ (ignored by git) each build.
_NB_OUT = DOCS / "notebooks"
_NB_OUT.mkdir(exist_ok=True)
for _old in _NB_OUT.glob("*.ipynb"):
    _old.unlink()
for _nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
    shutil.copy2(_nb, _NB_OUT / _nb.name)

project = "jax-longctx"
author = "the jax-longctx authors"
copyright = "2026, the jax-longctx authors"
release = "0.2.0"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.extlinks",
    "sphinx.ext.mathjax",
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# Notebooks are rendered as committed (their outputs, if any), never executed here.
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

REPO = "https://github.com/jax-longctx/jax-longctx"
# {repo}`benchmarks/results/gaps.md` links a file of the repository.
extlinks = {"repo": (f"{REPO}/blob/main/%s", "%s")}

autodoc_default_options = {
    "members": True,
    "member-order": "bysource",
    # methods from the library's private base classes (PageAllocator's), not from Python's
    "inherited-members": "tuple,object,BaseException,Exception,ValueError,RuntimeError,dict",
}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = False  # "Attributes:" become attribute entries (link targets)
napoleon_attr_annotations = False  # shapes are in the prose; jaxtyping strings are not types

nitpicky = True
# Types of other libraries (no intersphinx: the build downloads nothing).
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|numpy|np|jnp|jaxtyping|ml_dtypes|flax|optax)(\..*)?"),
    (
        r"py:.*",
        r"(os|typing|collections|collections\.abc|enum|dataclasses|pathlib|threading|types)\..*",
    ),
    (r"py:class", r"(Array|ArrayLike|DTypeLike|PyTree|Sharding|Mesh|NamedSharding|ndarray)"),
    (r"py:class", r".*'.*"),  # jaxtyping shape strings inside annotations ("B T N H")
    (r"py:.*", r"(ringattn|paged|offload)(\..*)?\._.*"),  # private modules: not documented
]


# The docstrings are Google style with shapes and types in prose: "Returns:" and a property's
# first line are descriptions, never "type: description" (napoleon's reading).
def _returns_untyped(self, preprocess_types=False):
    lines = self._dedent(self._consume_to_next_section())
    return [("", "", lines)] if lines else []


def _inline_untyped(self):
    lines = [self._lines.next(), *self._dedent(self._consume_to_end())]
    return "", self.__class__(lines, self._config).lines()


GoogleDocstring._consume_returns_section = _returns_untyped
GoogleDocstring._consume_inline_attribute = _inline_untyped


def _skip_namedtuple_aliases(app, what, name, obj, skip, options):
    """A NamedTuple's fields are described in its docstring, not as "Alias for field"."""
    doc = getattr(obj, "__doc__", None) or ""
    if doc.startswith("Alias for field number"):
        return True
    return None


def _resolve_unqualified(app, env, node, contnode):
    """``:func:`plan``` in a docstring of another module: the one documented object of that
    name in the API reference (none or several: left unresolved, so the build fails)."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "").lstrip("~.")
    domain = env.get_domain("py")
    kinds = set(domain.objtypes_for_role(node.get("reftype", "obj")) or ())
    objects = {n: o for n, o in domain.objects.items() if not o.aliased and o.objtype in kinds}
    scoped = ".".join(filter(None, [node.get("py:module"), node.get("py:class"), target]))
    hits = [scoped] if scoped in objects else [n for n in objects if n.endswith("." + target)]
    if len(hits) != 1:
        return None
    obj = objects[hits[0]]
    return make_refnode(app.builder, node["refdoc"], obj.docname, obj.node_id, contnode, hits[0])


def _drop_type_docstrings(app, what, name, obj, options, lines):
    """A constant (a tuple, a dict) has no docstring of its own: autodoc would print its
    type's (``dict() -> new empty dictionary``); the API pages describe it instead."""
    doc = type(obj).__doc__
    if what == "data" and doc and " ".join(lines).split() == " ".join(doc.split("\n")).split():
        lines.clear()


def setup(app):
    app.connect("autodoc-process-docstring", _drop_type_docstrings)
    app.connect("autodoc-skip-member", _skip_namedtuple_aliases)
    app.connect("missing-reference", _resolve_unqualified)


html_theme = "furo"
html_title = "jax-longctx"
html_theme_options = {
    "source_repository": REPO,
    "source_branch": "main",
    "source_directory": "docs/",
}
