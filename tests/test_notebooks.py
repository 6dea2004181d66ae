"""Every notebook runs end to end (at a small size, in a fresh process) and its Colab copy is in sync."""

import os
import pathlib
import subprocess
import sys

import jupytext
import pytest

NOTEBOOKS = sorted(pathlib.Path(__file__).parent.parent.joinpath("notebooks").glob("*.py"))


def _cells(notebook):
    return [(c.cell_type, c.source.strip()) for c in notebook.cells]


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_ipynb_is_paired_and_in_sync(source):
    ipynb = source.with_suffix(".ipynb")
    assert ipynb.exists(), (
        f"{source.name} has no paired {ipynb.name} (run: jupytext --sync {source})"
    )
    assert _cells(jupytext.read(source)) == _cells(jupytext.read(ipynb)), (
        f"{ipynb.name} is out of date with {source.name} (run: jupytext --sync {source})"
    )


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(source, tmp_path):
    env = dict(os.environ, QUICKSTART_SCALE="small", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, str(source)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (
        f"{source.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    assert "Summary" in proc.stdout, proc.stdout[-2000:]
