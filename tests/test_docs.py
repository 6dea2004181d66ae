"""The documentation site (docs/) against the code: every public name has a docstring and a
place in the API reference, the concept pages exist and are linked, the code the pages show
runs, the set-up commands agree with the README and CI, and the product names the design
article by its title. The site itself is built by ``.ci/run`` with warnings as errors."""

import contextlib
import importlib
import inspect
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Each public module and the API page that documents it.
API_PAGES = {
    "ringattn": "ringattn.md",
    "paged": "paged.md",
    "offload": "offload.md",
    "offload.planning": "planning.md",
    "offload.monitoring": "monitoring.md",
    "offload.retrieval": "retrieval.md",
    "offload.serving": "serving.md",
}
CONCEPTS = (
    "semantics",
    "sharded",
    "paged",
    "quantized",
    "offload",
    "planning",
    "monitoring",
    "multihost",
    "kernels",
)


def _code_blocks(path, lang):
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("module", sorted(API_PAGES))
def test_every_public_name_has_a_docstring_and_an_api_entry(module):
    """Functions and classes render through ``automodule`` (so they need a docstring);
    constants have no docstring of their own, so each needs an ``autodata`` entry."""
    mod = importlib.import_module(module)
    page = (DOCS / "api" / API_PAGES[module]).read_text()
    assert f".. automodule:: {module}\n" in page
    for name in mod.__all__:
        obj = getattr(mod, name)
        if inspect.isclass(obj) or callable(obj):
            assert (obj.__doc__ or "").strip(), f"{module}.{name} has no docstring"
        else:
            assert f".. autodata:: {module}.{name}\n" in page, (
                f"{module}.{name} is a constant: docs/api/{API_PAGES[module]} needs an autodata"
            )


def test_every_page_is_in_the_index():
    index = (DOCS / "index.md").read_text()
    for name in CONCEPTS:
        assert (DOCS / "concepts" / f"{name}.md").is_file(), name
        assert f"concepts/{name}\n" in index, f"concepts/{name} is not in docs/index.md"
    for page in ("getting_started", "notebooks", "benchmarks", "changelog", "api/index"):
        assert f"\n{page}\n" in index, page
    notebooks = (DOCS / "notebooks.md").read_text()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"notebooks/{nb.stem}\n" in notebooks, f"{nb.name} is not rendered"


def test_setup_commands_agree_with_the_readme_and_ci():
    readme_cmds = _code_blocks(ROOT / "README.md", "bash")[0].strip().splitlines()
    assert len(readme_cmds) == 2 and "quickstart.py" in readme_cmds[0]
    assert "pytest" in readme_cmds[1]
    assert readme_cmds[1] + "\n" in (ROOT / ".ci" / "run").read_text()
    assert _code_blocks(DOCS / "getting_started.md", "bash")[0].strip().splitlines() == readme_cmds
    ci = (ROOT / ".ci" / "run").read_text()
    assert "sphinx-build -W --keep-going -n -b html docs docs/_build/html" in ci


def test_the_readme_example_is_the_getting_started_example():
    readme = (ROOT / "README.md").read_text()
    example = readme[readme.index("## Example") :]
    assert _code_blocks(DOCS / "getting_started.md", "python")[0] in example


def test_the_paged_life_cycle_example_runs_and_prints_what_the_page_says():
    page = DOCS / "concepts" / "paged.md"
    code = _code_blocks(page, "python")[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(page), "exec"), {})
    printed = out.getvalue().strip()
    assert f"It prints `{printed}`" in page.read_text(), printed


_SEED = re.compile(r"\bseed(?:'s| article)\b", re.I)


def test_the_article_is_named_by_its_title_not_as_the_seed():
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS.rglob("*.md")]
    for folder in ("ringattn", "paged", "offload", "benchmarks", "examples", "notebooks"):
        files += (ROOT / folder).rglob("*.py")
        files += (ROOT / folder).rglob("*.md")
    hits = [
        f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
        for f in files
        if "_build" not in f.parts
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if _SEED.search(line)
    ]
    assert not hits, "call the article by its title:\n" + "\n".join(hits)


_REPO_LINK = re.compile(r"https://github\.com/jax-longctx/jax-longctx/blob/main/([^)\s#]+)")


def test_links_to_files_of_the_repository_resolve():
    """Relative links in the README, the changelog and the history file, and the docs' links
    to files of the repository (benchmark results, examples), name files that exist."""
    broken = []
    for f in (ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks/results/history.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", f.read_text()):
            if not target.startswith("http") and not (f.parent / target).exists():
                broken.append(f"{f.relative_to(ROOT)}: {target}")
    for f in DOCS.rglob("*.md"):
        if "_build" in f.parts:
            continue
        for target in _REPO_LINK.findall(f.read_text()):
            if not (ROOT / target).exists():
                broken.append(f"{f.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)
