"""``python -m benchmarks [--quick]``: every benchmark, see ``benchmarks/run_all.py``."""

from benchmarks.run_all import main

main()
