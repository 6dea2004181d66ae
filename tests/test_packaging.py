"""Project hygiene: lint, the dependency direction, and nothing heavy at import time."""

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PACKAGES = ("ringattn", "paged", "offload")  # each may import only those before it


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.mark.parametrize("package", PACKAGES)
def test_dependency_direction_and_public_names_only(package):
    allowed_private = {package}
    forbidden = set(PACKAGES[PACKAGES.index(package) + 1 :])
    for path in sorted((ROOT / package).glob("*.py")):
        for module in _imports(path):
            top, *rest = module.split(".")
            assert top not in forbidden, (
                f"{path.name} imports {module}: {package} may not import upward"
            )
            if top in PACKAGES and top not in allowed_private:
                assert not rest, f"{path.name} imports {module}: use {top}'s public names only"


def test_consumers_use_public_names_only():
    for folder in ("notebooks", "benchmarks"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for module in _imports(path):
                top, *rest = module.split(".")
                assert not (top in PACKAGES and rest), f"{folder}/{path.name} imports {module}"


def test_import_is_light_and_touches_no_backend():
    code = (
        "import sys\n"
        "import ringattn, paged, offload\n"
        "heavy = [m for m in ('flax', 'optax', 'orbax', 'tensorstore') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge._backends, 'a JAX backend was initialised at import time'\n"
        "for pkg in (ringattn, paged, offload):\n"
        "    missing = [n for n in pkg.__all__ if not hasattr(pkg, n)]\n"
        "    assert not missing, (pkg.__name__, missing)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ruff_lint_and_format():
    # ruff comes with the 'test' extra, next to this interpreter.
    ruff = str(pathlib.Path(sys.executable).parent / "ruff")
    ruff = ruff if pathlib.Path(ruff).exists() else shutil.which("ruff")
    for args in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (
            f"ruff {' '.join(args)}:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
        )
