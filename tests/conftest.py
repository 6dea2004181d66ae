"""Test configuration: 8 emulated CPU devices, and runtime shape checks.

JAX is configured here, before any test module creates an array, so every test sees the
same 8-device CPU platform that CI sees. jaxtyping's import hook (with beartype) is installed
before the library is imported, so every annotated public signature of ``ringattn``,
``paged`` and ``offload`` is checked against its shape annotation in every test. Tests that
feed deliberately malformed inputs to check the library's own ``ValueError`` messages carry
the ``no_typecheck`` marker, which switches the hook off for that test only.

The tests' programs are tiny, so compiling them is most of their time: they are compiled with
LLVM at ``-O0`` (``--xla_backend_optimization_level=0``; XLA's own HLO passes, fusion and
buffer assignment included, are unchanged, so every HLO, memory and numerical check sees the
program a user gets). The default run took 13m24s with it, 16m52s without, on 2 cores.
Subprocesses and notebook kernels the tests start inherit the flag. Benchmarks compile with
the defaults.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_threefry_partitionable", True)

import jaxtyping

jaxtyping.install_import_hook(["ringattn", "paged", "offload"], "beartype.beartype")

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "no_typecheck: switch the jaxtyping/beartype runtime check off (malformed-input tests)",
    )


@pytest.fixture(autouse=True)
def _runtime_typecheck(request):
    """Runtime shape checks on, except for tests marked ``no_typecheck``."""
    disable = request.node.get_closest_marker("no_typecheck") is not None
    previous = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", disable)
    yield
    jaxtyping.config.update("jaxtyping_disable", previous)
