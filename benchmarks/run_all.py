"""Reruns every benchmark, one after another, each in its own process.

``python -m benchmarks --quick`` (or ``python -m benchmarks.run_all --quick``), from the
repository root, reruns all of them in their short form on a 2-core CPU, writing
``benchmarks/results/quick/*.md`` and a summary ``benchmarks/results/quick/README.md``
(script, exit status, seconds, then the gap table of ``bench_gaps``). The scripts before
``bench_gaps`` take under 10 minutes together; ``bench_gaps`` alone (``--only bench_gaps``, or
``python -m benchmarks.bench_gaps --quick``) reruns the issue-12 gap table and the scaling per
doubling in about 5 more. Without ``--quick`` it runs the full sizes (hours on a CPU;
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
    "bench_host_copy",
    "bench_ring",
    "bench_ring_quant",
    "bench_train",
    "bench_decode",
    "bench_decode_scaling",
    "bench_kvquant",
    "bench_million",  # --quick: 131,072 tokens, about 20 s
    "bench_gaps",  # last: the issue-12 gap table and the scaling per doubling, its own sizes
)
QUICK_TIMEOUTS = {"bench_gaps": 600.0}  # seconds with --quick where 300 is too short
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _fmt(load):
    return "n/a" if load is None else f"{load:.1f}"


def _gaps_summary(quick: bool, ran: bool) -> list[str]:
    """The gap table of the ``bench_gaps`` run just made (its ``## Gaps`` section), if any."""
    path = (_common.QUICK_DIR if quick else _common.RESULTS_DIR) / "gaps.md"
    if not ran or not path.exists():
        return []
    lines = path.read_text().splitlines()
    start = lines.index("## Gaps (issue 12)") if "## Gaps (issue 12)" in lines else None
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return ["", f"## Gaps (issue 12), from [`{path.name}`]({path.name})", *lines[start + 1 : end]]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short forms (see above)")
    parser.add_argument("--only", nargs="*", choices=SCRIPTS, help="run only these scripts")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per script (default with --quick: 300, bench_gaps 600)",
    )
    args = parser.parse_args(argv)

    def timeout_of(name):
        if args.timeout or not args.quick:
            return args.timeout
        return QUICK_TIMEOUTS.get(name, 300.0)

    scripts = args.only or SCRIPTS
    rows, failed = [], []
    start = time.perf_counter()
    load_start = _common.load_average()
    for name in scripts:
        command = [sys.executable, "-m", f"benchmarks.{name}", *(["--quick"] if args.quick else [])]
        print(f"=== {_common.command_line(name, command[3:])}", flush=True)
        t0 = time.perf_counter()
        timeout = timeout_of(name)
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
        *_gaps_summary(args.quick, "bench_gaps" in scripts and "bench_gaps" not in failed),
    ]
    out = (_common.QUICK_DIR if args.quick else _common.RESULTS_DIR) / "README.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
