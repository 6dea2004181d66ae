"""JAX's persistent compilation cache, on in one call, in the user's cache directory.

A serving run compiles its prefill chunk, its decode loop and a dozen small programs; on a
2-core CPU that is most of a short run's wall time, and without a persistent cache every run
pays it again. :func:`enable_compilation_cache` points JAX's cache
(``jax_compilation_cache_dir``) at ``$JAX_COMPILATION_CACHE_DIR`` when set, else at
``$XDG_CACHE_HOME/jax-longctx/jax`` (``~/.cache/jax-longctx/jax`` without ``XDG_CACHE_HOME``),
and caches every program however short its compile. The command-line examples, the
notebooks and the benchmarks call it; ``JAX_LONGCTX_NO_COMPILATION_CACHE=1`` (or the
examples' ``--no-compilation-cache``) turns it off.

JAX's own warning applies: the cache is trusted code. Keep it in a directory only you can
write to.
"""

import os
import pathlib

import jax

__all__ = ["OPT_OUT_VARIABLE", "default_compilation_cache_dir", "enable_compilation_cache"]

OPT_OUT_VARIABLE = "JAX_LONGCTX_NO_COMPILATION_CACHE"


def default_compilation_cache_dir() -> pathlib.Path:
    """Where :func:`enable_compilation_cache` keeps programs when no directory is given:
    ``$JAX_COMPILATION_CACHE_DIR``, else ``$XDG_CACHE_HOME/jax-longctx/jax``, else
    ``~/.cache/jax-longctx/jax``.

    Example:
      >>> default_compilation_cache_dir().relative_to(pathlib.Path.home())  # neither variable set
      PosixPath('.cache/jax-longctx/jax')
    """
    named = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if named:
        return pathlib.Path(named).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base).expanduser() / "jax-longctx" / "jax"


def enable_compilation_cache(
    directory: str | os.PathLike | None = None, *, min_compile_seconds: float = 0.0
) -> pathlib.Path | None:
    """Turns on JAX's persistent compilation cache; returns its directory, or ``None`` when
    ``$JAX_LONGCTX_NO_COMPILATION_CACHE`` is set to anything but ``""`` / ``0`` (then JAX's
    settings are left as they are: a cache that ``$JAX_COMPILATION_CACHE_DIR`` names is JAX's
    own, and ``jax.config.update("jax_enable_compilation_cache", False)`` turns that off too).

    Call it once at start-up (before the first compile, or later: programs compiled before it
    are simply not cached). A second process that compiles the same programs with the same
    JAX, backend and flags then loads them from disk instead of compiling.

    Args:
      directory: where to keep the programs; default :func:`default_compilation_cache_dir`.
        Created if missing.
      min_compile_seconds: programs that compile faster than this are not written (JAX's
        default is 1 s; 0 here, since a serving run's many sub-second programs add up).

    Returns:
      The cache directory, or ``None`` if opted out.

    Raises:
      ValueError: ``min_compile_seconds`` is negative or not finite, or ``directory`` names a
        file.

    Example:
      >>> import offload.serving
      >>> path = offload.serving.enable_compilation_cache()  # first thing in a script
      >>> path.parts[-2:]  # with neither variable set: ~/.cache/jax-longctx/jax
      ('jax-longctx', 'jax')
    """
    if not (0.0 <= float(min_compile_seconds) < float("inf")):
        raise ValueError(
            "enable_compilation_cache: min_compile_seconds: expected a finite number >= 0, "
            f"got {min_compile_seconds!r}"
        )
    if os.environ.get(OPT_OUT_VARIABLE, "") not in ("", "0"):
        return None
    path = pathlib.Path(directory).expanduser() if directory is not None else default_compilation_cache_dir()  # fmt: skip
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"enable_compilation_cache: directory: {str(path)!r} is a file; pass a directory "
            "(or unset JAX_COMPILATION_CACHE_DIR to use the default)"
        )
    path.mkdir(parents=True, exist_ok=True)
    path = path.resolve()
    if jax.config.jax_compilation_cache_dir != str(path):
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()  # a cache already opened elsewhere is re-opened here
        jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    return path
