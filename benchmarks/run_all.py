"""Reruns every benchmark, one after another, each in its own process.

``python -m benchmarks --quick`` (or ``python -m benchmarks.run_all --quick``), from the
repository root, reruns all of them in their short form in under 10 minutes on a 2-core CPU,
writing ``benchmarks/results/quick/*.md`` and a summary ``benchmarks/results/quick/README.md``
(script, exit status, seconds). Without ``--quick`` it runs the full sizes (hours on a CPU;
the full tables in ``benchmarks/results/`` are overwritten). Each script runs in a fresh
process because the number of emulated CPU devices is fixed before JAX starts.
"""

import argparse
import pathlib
import subprocess
import sys
import time

from benchmarks import _common

SCRIPTS = (
    "bench_paged_memory",
    "bench_blockwise",
    "bench_paged",
    "bench_policies",
    "bench_offload",
    "bench_ring",
    "bench_ring_quant",
    "bench_train",
    "bench_decode",
    "bench_kvquant",
)
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _fmt(load):
    return "n/a" if load is None else f"{load:.1f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short forms, under 10 minutes")
    parser.add_argument("--only", nargs="*", choices=SCRIPTS, help="run only these scripts")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per script (default 300 with --quick)"
    )
    args = parser.parse_args(argv)
    timeout = args.timeout or (300.0 if args.quick else None)
    scripts = args.only or SCRIPTS
    rows, failed = [], []
    start = time.perf_counter()
    load_start = _common.load_average()
    for name in scripts:
        command = [sys.executable, "-m", f"benchmarks.{name}", *(["--quick"] if args.quick else [])]
        print(f"=== {_common.command_line(name, command[3:])}", flush=True)
        t0 = time.perf_counter()
        try:
            status = subprocess.run(command, cwd=REPO_ROOT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout:.0f} s"
        seconds = time.perf_counter() - t0
        rows.append(f"| `{name}` | {status} | {seconds:.0f} |")
        if status != 0:
            failed.append(name)
    load_end = _common.load_average()
    lines = [
        f"# Benchmarks{' (quick run)' if args.quick else ''}",
        "",
        "Command (from the repository root): "
        f"`python -m benchmarks{' --quick' if args.quick else ''}"
        f"{' --only ' + ' '.join(args.only) if args.only else ''}`",
        "",
        f"Total {time.perf_counter() - start:.0f} s; host load average {_fmt(load_start)} at "
        f"the start, {_fmt(load_end)} at the end.",
        "",
        "| script | exit status | seconds |",
        "|---|---|---:|",
        *rows,
    ]
    out = (_common.QUICK_DIR if args.quick else _common.RESULTS_DIR) / "README.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
