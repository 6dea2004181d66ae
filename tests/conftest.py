"""Test configuration: 8 emulated CPU devices, and runtime shape checks.

JAX is configured here, before any test module creates an array, so every test sees the
same 8-device CPU platform that CI sees. jaxtyping's import hook (with beartype) is installed
before the library is imported, so every annotated public signature of ``ringattn``,
``paged`` and ``offload`` is checked against its shape annotation in every test. Tests that
feed deliberately malformed inputs to check the library's own ``ValueError`` messages carry
the ``no_typecheck`` marker, which switches the hook off for that test only.

The tests' programs are tiny, so compiling them is most of their time: they are compiled with
LLVM at ``-O0`` (``--xla_backend_optimization_level=0``) and with XLA:CPU's elemental IR
emitters rather than its MLIR fusion emitters (``--xla_cpu_use_fusion_emitters=false``). ``-O0``
leaves XLA's HLO passes, fusion and buffer assignment included, unchanged; the emitter flag
makes XLA:CPU form fewer fusions (those the older emitters cannot take), so a check of a
program's fusions or memory sees a close relative of a user's program; every test passed
with and without it (docs/development.md says how to run one as a user's). The default run
took 19m28s with ``-O0`` alone, 11m47s with both, on 2 cores. Subprocesses and notebook
kernels the tests start inherit the flags. Benchmarks compile with the defaults.

The persistent compilation cache that the examples' command lines, the notebooks and the
benchmarks turn on (``offload.serving.enable_compilation_cache``) stays off in tests
(``JAX_LONGCTX_NO_COMPILATION_CACHE=1``, inherited by their subprocesses and kernels), so a
test never reads a program another run wrote; the cache's own tests lift it explicitly.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_LONGCTX_NO_COMPILATION_CACHE"] = "1"
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


# The longest tests and files first (measured on 2 cores): pytest-xdist hands tests to its
# workers in collection order, so a long test collected last would run alone at the end while
# the other worker idles. Whole files move together (their module fixtures are set up once);
# the order inside a file, and of everything else, is unchanged.
LONG_FIRST = (
    "tests/test_notebooks.py::test_real_model_notebook",  # slow: about 200 s
    "tests/examples/test_llama.py",  # slow: 430 s in all, one test about 100 s
    "tests/ringattn/test_ring_pallas.py",  # slow: 370 s in all
    "tests/examples/test_longctx_lm.py",  # default 105 s, slow 185 s
    "tests/test_notebooks.py",
    "tests/ringattn/test_blockwise.py",
    "tests/test_oracle64.py",
    "tests/paged/test_quantized.py",
    "tests/ringattn/test_ring.py",
    "tests/paged/test_kivi.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        return next(
            (i for i, prefix in enumerate(LONG_FIRST) if item.nodeid.startswith(prefix)),
            len(LONG_FIRST),
        )

    items.sort(key=rank)  # stable: the rest keeps its order
