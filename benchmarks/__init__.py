"""Benchmarks for jax-longctx (not part of the installed distribution).

Run from the repository root, one script at a time, as modules::

    python -m benchmarks.bench_blockwise [--quick]
    python -m benchmarks --quick        # every script in its short form
    python -m benchmarks.bench_gaps --quick   # the issue-12 gap table, scaling per doubling

Each script writes a Markdown table to ``benchmarks/results/`` (``--quick``:
``benchmarks/results/quick/``) headed by the command that produced it. The shared harness
(device set-up, warm-up and interleaved timing, results writing) is ``benchmarks._common``.
"""
