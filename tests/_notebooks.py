"""Executes a notebook's Colab copy (``notebooks/NAME.ipynb``) in a real Jupyter kernel, as
``jupyter execute`` does, with the environment variables that pick its size and where it writes
its numbers.

Each notebook runs once in the whole CI run, here: the kernel is what Colab and Jupyter run
(magics, inline plots, ``display``), the ``.ipynb`` is checked cell for cell against its
jupytext source (``test_ipynb_is_paired_and_in_sync``), and that source is checked to be a
plain Python script (``test_colab_install_cell_is_one_pip_line_that_execution_skips``). The
install cell carries the ``skip-execution`` tag that nbclient skips: the notebook runs against
this checkout (``PYTHONPATH``).
"""

import json
import os
import pathlib

import nbclient
import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent


def notebook_env(**extra: str) -> dict[str, str]:
    """The kernel's environment: CPU JAX, this checkout first on the path, ``extra`` set.

    The tests' compile flags (``XLA_FLAGS``, tests/conftest.py) are inherited: the notebooks'
    programs are tiny at their test size and compile in about half the time with them."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def execute_notebook(
    name: str, tmp_path: pathlib.Path, *, results_var: str, timeout: int = 900, **extra: str
) -> tuple[dict, list[str]]:
    """Runs ``notebooks/NAME.ipynb`` in a fresh ``python3`` kernel whose working directory is
    ``tmp_path``, with ``results_var`` naming ``tmp_path / results.json``; returns the numbers
    the notebook wrote there and the names of the PNG files it saved beside them. A failing
    cell raises ``nbclient.exceptions.CellExecutionError`` carrying the cell and traceback."""
    results = tmp_path / "results.json"
    notebook = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    env = notebook_env(**{results_var: str(results)}, **extra)
    env.pop("NOTEBOOK_TOKENS", None)  # offload_tiers' host-memory decode at its small size
    client = nbclient.NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute(env=env)
    assert results.exists(), f"{name}.ipynb ran but wrote no {results_var}"
    return json.loads(results.read_text()), sorted(p.name for p in tmp_path.glob("*.png"))
