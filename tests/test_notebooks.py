"""Notebooks: each runs end to end at a small size and computes the right numbers; its Colab
copy is in sync; its Colab install cell fails with instructions, not a pip traceback.

Each notebook's jupytext source (``notebooks/*.py``) runs as a script in a fresh process with
``QUICKSTART_RESULTS`` pointing at a JSON file; the notebook writes what it computed there and
the test checks those numbers. (To execute the ``.ipynb`` itself headless, install the
``[notebooks]`` extra and run ``jupyter execute notebooks/quickstart.ipynb``.)
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import tomllib

import jupytext
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(ROOT.joinpath("notebooks").glob("*.py"))
QUICKSTART = ROOT / "notebooks" / "quickstart.py"

# What quickstart computes, and the bound each number must satisfy (float32 throughout).
QUICKSTART_BOUNDS = {
    "blockwise forward error": 1e-5,
    "blockwise gradient error": 1e-4,
    "merge error": 1e-5,
    "ring (8 devices) error": 1e-5,
    "paged decode error": 1e-5,
    "offload exact-decode error": 1e-5,
}


def _cells(notebook):
    return [(c.cell_type, c.source.strip()) for c in notebook.cells]


def _env(**extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
    env.pop("XLA_FLAGS", None)
    # This checkout's packages, not whatever copy is installed.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_ipynb_is_paired_and_in_sync(source):
    ipynb = source.with_suffix(".ipynb")
    assert ipynb.exists(), (
        f"{source.name} has no paired {ipynb.name} (run: jupytext --sync {source})"
    )
    assert _cells(jupytext.read(source)) == _cells(jupytext.read(ipynb)), (
        f"{ipynb.name} is out of date with {source.name} (run: jupytext --sync {source})"
    )


def test_quickstart_computes_exact_results(tmp_path):
    results = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(QUICKSTART)],
        cwd=tmp_path,
        env=_env(QUICKSTART_SCALE="small", QUICKSTART_RESULTS=str(results)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (
        f"{QUICKSTART.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    assert results.exists(), f"{QUICKSTART.name} wrote no results:\n{proc.stdout[-2000:]}"
    computed = json.loads(results.read_text())
    for name, bound in QUICKSTART_BOUNDS.items():
        assert name in computed, (name, sorted(computed))
        assert math.isfinite(computed[name]) and computed[name] < bound, (
            f"{name}: {computed[name]:.3g} (bound {bound:g})"
        )
    # The H2O budget keeps 25% of the pages on device, and they hold most of the attention
    # mass (the keys have heavy hitters the queries look for): the approximation is useful.
    assert 0.5 < computed["offload mass kept on device"] <= 1.0 + 1e-6, computed
    assert 0.0 < computed["offload device-only relative error"] < 1.0, computed


def _colab_install_cell(source):
    cells = [c.source for c in jupytext.read(source).cells if c.cell_type == "code"]
    return next((c for c in cells if '"google.colab" in sys.modules' in c), None)


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_colab_install_cell_names_the_published_repository(source):
    cell = _colab_install_cell(source)
    assert cell is not None, f"{source.name} has no Colab install cell"
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert f'"{urls["Repository"]}"' in cell, (
        f"{source.name}: the install cell must use pyproject's Repository URL {urls['Repository']}"
    )


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_colab_install_cell_fails_with_instructions(source, tmp_path):
    """In a (simulated) Colab, an install that cannot work stops with how to install."""
    cell = _colab_install_cell(source)
    code = (
        "import sys, types\n"
        "sys.modules['google.colab'] = types.ModuleType('google.colab')\n"
        f"exec(compile({cell!r}, 'install cell', 'exec'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=_env(JAX_LONGCTX_SPEC=str(tmp_path / "jax_longctx-0.0-py3-none-any.whl")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    for hint in (f"git+{urls['Repository']}", "pip wheel", ".whl"):
        assert hint in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
