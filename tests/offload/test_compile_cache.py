"""offload.serving.enable_compilation_cache: where it points JAX's persistent cache, the opt-out, its
errors, and that a second process loads the first one's programs instead of compiling.

conftest.py turns the cache off for the whole suite (JAX_LONGCTX_NO_COMPILATION_CACHE=1);
these tests lift that and restore JAX's settings after each test, so no other test sees a
cache.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

import offload.serving as serving

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def cache_settings(monkeypatch):
    """Lifts the suite's opt-out; puts JAX's cache settings back afterwards."""
    monkeypatch.delenv(serving.OPT_OUT_VARIABLE, raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)  # fmt: skip
    yield
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])


def test_default_directory_follows_the_variables(cache_settings, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert serving.default_compilation_cache_dir() == tmp_path / "home" / ".cache" / "jax-longctx" / "jax"  # fmt: skip
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert serving.default_compilation_cache_dir() == tmp_path / "xdg" / "jax-longctx" / "jax"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "named"))
    assert serving.default_compilation_cache_dir() == tmp_path / "named"


def test_enable_points_jax_at_the_directory_and_creates_it(cache_settings, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = serving.enable_compilation_cache()
    assert path == (tmp_path / "jax-longctx" / "jax").resolve() and path.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(path)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    other = serving.enable_compilation_cache(tmp_path / "other", min_compile_seconds=2.5)
    assert jax.config.jax_compilation_cache_dir == str(other) and other.is_dir()
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.5


@pytest.mark.parametrize("value", ["1", "yes"])
def test_opt_out_leaves_jax_untouched(cache_settings, monkeypatch, tmp_path, value):
    monkeypatch.setenv(serving.OPT_OUT_VARIABLE, value)
    before = jax.config.jax_compilation_cache_dir
    assert serving.enable_compilation_cache(tmp_path / "c") is None
    assert jax.config.jax_compilation_cache_dir == before and not (tmp_path / "c").exists()


def test_opt_out_of_zero_or_empty_means_on(cache_settings, monkeypatch, tmp_path):
    for value in ("0", ""):
        monkeypatch.setenv(serving.OPT_OUT_VARIABLE, value)
        assert serving.enable_compilation_cache(tmp_path / value) is not None


@pytest.mark.no_typecheck
def test_errors_say_what_to_do(cache_settings, tmp_path):
    afile = tmp_path / "f"
    afile.write_text("x")
    with pytest.raises(ValueError, match="is a file; pass a directory"):
        serving.enable_compilation_cache(afile)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="min_compile_seconds: expected a finite number"):
            serving.enable_compilation_cache(tmp_path, min_compile_seconds=bad)


_CHILD = """
import json, sys
import jax
from jax._src import monitoring
import offload.serving
hits = []
monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
path = offload.serving.enable_compilation_cache(sys.argv[1])
f = jax.jit(lambda x: (x @ x.T).sum() * 3.0)
value = float(f(jax.numpy.ones((64, 32))))
print(json.dumps({"hits": len(hits), "value": value, "path": str(path)}))
"""


def test_a_second_process_loads_the_first_ones_program(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != serving.OPT_OUT_VARIABLE}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "cache")], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0]["hits"] == 0 and runs[1]["hits"] >= 1, runs
    assert runs[0]["value"] == runs[1]["value"] == 64 * 64 * 32 * 3.0
    assert any((tmp_path / "cache").iterdir())
    # Opted out, the same program compiles again: no hit, nothing read.
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "cache")], cwd=ROOT,
                          env={**env, serving.OPT_OUT_VARIABLE: "1"}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["hits"] == 0
