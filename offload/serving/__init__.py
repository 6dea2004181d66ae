"""Serving helpers: what a program that serves a model through the library sets up once.

``offload.serving`` is a public subpackage of ``offload`` (as ``offload.planning``,
``offload.monitoring`` and ``offload.retrieval`` are): ``import offload`` does not import it;
``import offload.serving`` does. It holds :func:`enable_compilation_cache` (JAX's persistent
compilation cache in the user's cache directory, which the examples' command lines, the
notebooks and the benchmarks turn on) and :func:`default_compilation_cache_dir`; the serving
layer of issue 40 (a model contract, prefill / insert / generate over a decode state) is to
join them here.
"""

from offload.serving._compile_cache import (
    OPT_OUT_VARIABLE,
    default_compilation_cache_dir,
    enable_compilation_cache,
)

__all__ = ["OPT_OUT_VARIABLE", "default_compilation_cache_dir", "enable_compilation_cache"]
