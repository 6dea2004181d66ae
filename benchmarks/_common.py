"""The harness every benchmark script shares: device set-up, timing, and results writing.

A benchmark script is then only the cases it measures::

    from benchmarks import _common

    def main(argv=None):
        args = _common.make_parser(__doc__).parse_args(argv)
        run = _common.start_run("bench_x", args, cpu_devices=8)  # before any JAX array
        timing = _common.time_interleaved({"a": f, "b": g}, repeats=5)
        run.write("Title", ["| method | best ms |", ...])

Benchmarks run from the repository root as modules (``python -m benchmarks.bench_x``), with
the library installed (``pip install -e .``) or not: ``python -m`` puts the current directory
first on ``sys.path``, so the checkout's ``ringattn`` / ``paged`` / ``offload`` are the ones
measured. Results are Markdown files under ``benchmarks/results/`` (``--quick`` runs under
``benchmarks/results/quick/``, so a smoke run never overwrites a full table), each headed by
the command that produced it, the machine and the host load average at start and end.

Timings are wall-clock, after a warm-up call (compilation), over ``repeats`` rounds. Several
methods are timed *interleaved* (each round runs every method once), so a burst of load from
other jobs on a shared machine hits them alike; report same-run ratios, and the best run (noise
only ever makes a run slower) next to the median.
"""

import argparse
import dataclasses
import datetime
import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
QUICK_DIR = RESULTS_DIR / "quick"
MiB = 2**20
GiB = 2**30


# ------------------------------------------------------------------------------------------
# Device set-up
# ------------------------------------------------------------------------------------------
def setup_devices(cpu_devices: int = 1) -> None:
    """Selects the platform and the number of emulated CPU devices; call before any JAX array.

    ``JAX_PLATFORMS`` defaults to ``cpu`` (set it, e.g. ``JAX_PLATFORMS=cuda``, to measure an
    accelerator); on CPU, ``cpu_devices`` emulated devices share the host's cores.

    Raises:
        RuntimeError: JAX already created its backend (an array or a device query came first).
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    except RuntimeError as e:
        raise RuntimeError(
            f"setup_devices: call it before any JAX array or device query exists ({e})"
        ) from e


def describe_machine(*, devices: bool = True) -> str:
    """One line: cores, and (``devices=True``) JAX's platform, device count and version."""
    cores = f"{os.cpu_count()} CPU cores ({platform.machine()}), Python {platform.python_version()}"
    if not devices:
        return cores
    import jax

    found = jax.devices()
    return f"{cores}, {len(found)} {found[0].platform.upper()} device(s), JAX {jax.__version__}"


def load_average() -> float | None:
    """The host's 1-minute load average (``None`` where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


# ------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------
class Timing(NamedTuple):
    """Wall-clock seconds of each timed run (after the warm-up)."""

    times: tuple[float, ...]

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        ordered = sorted(self.times)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _block(x: Any) -> Any:
    import jax

    return jax.block_until_ready(x)


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]], *, repeats: int, warmup: int = 1
) -> dict[str, Timing]:
    """Times zero-argument callables in interleaved rounds, after ``warmup`` calls of each.

    Each round calls every function once, in order, and blocks on its result
    (``jax.block_until_ready``), so load from other jobs hits all methods alike.

    Args:
        fns: name -> zero-argument callable (close over the arguments).
        repeats: timed rounds, >= 1.
        warmup: untimed calls of each function first (compilation, caches).

    Returns:
        name -> :class:`Timing` with ``repeats`` times.
    """
    if repeats < 1:
        raise ValueError(f"time_interleaved: repeats: expected >= 1, got {repeats}")
    for fn in fns.values():
        for _ in range(warmup):
            _block(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            _block(fn())
            times[name].append(time.perf_counter() - start)
    return {name: Timing(tuple(ts)) for name, ts in times.items()}


def time_call(fn: Callable[..., Any], *args: Any, repeats: int, warmup: int = 1) -> Timing:
    """Times ``fn(*args)`` alone: ``time_interleaved`` with one method."""
    return time_interleaved({"fn": lambda: fn(*args)}, repeats=repeats, warmup=warmup)["fn"]


# ------------------------------------------------------------------------------------------
# Command line and results
# ------------------------------------------------------------------------------------------
def make_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes: ``--quick`` and ``--out``."""
    text = (doc or "").strip()
    parser = argparse.ArgumentParser(
        description=text.splitlines()[0] if text else None,
        epilog="Run from the repository root: python -m benchmarks.<script> [--quick].",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, a smoke run of a minute or two; writes to benchmarks/results/quick/",
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=None, help="results file (default: see --quick)"
    )
    return parser


def command_line(module: str, argv: Sequence[str]) -> str:
    """The command that reproduces this run, from the repository root."""
    return " ".join(["python -m", f"benchmarks.{module}", *argv])


@dataclasses.dataclass
class Run:
    """One benchmark run: what was asked, when it started, and where its results go."""

    module: str
    argv: list[str]
    out: pathlib.Path
    quick: bool
    uses_devices: bool
    started: float
    load_start: float | None

    def header(self, title: str) -> list[str]:
        load_end = load_average()

        def fmt(x):
            return "n/a" if x is None else f"{x:.1f}"

        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        return [
            f"# {title}{' (quick run)' if self.quick else ''}",
            "",
            f"Command (from the repository root): `{command_line(self.module, self.argv)}`",
            "",
            f"Machine: {describe_machine(devices=self.uses_devices)}. Finished {stamp} after "
            f"{time.perf_counter() - self.started:.0f} s; host load average "
            f"{fmt(self.load_start)} at the start, {fmt(load_end)} at the end "
            "(a load above the core count means other jobs shared the cores: timings are noisy, "
            "compare ratios within one run).",
            "",
        ]

    def write(self, title: str, lines: Sequence[str]) -> pathlib.Path:
        """Writes ``# title``, the run header and ``lines`` as Markdown; prints and returns it."""
        text = "\n".join([*self.header(title), *lines]).rstrip() + "\n"
        print(text, flush=True)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(text)
        try:
            shown = self.out.resolve().relative_to(pathlib.Path.cwd())
        except ValueError:
            shown = self.out
        print(f"wrote {shown}", flush=True)
        return self.out


def start_run(
    module: str,
    args: argparse.Namespace,
    *,
    cpu_devices: int | None = 1,
    argv: Sequence[str] | None = None,
    stem: str | None = None,
) -> Run:
    """Sets up devices (unless ``cpu_devices`` is ``None``: no JAX) and JAX's persistent
    compilation cache (``offload.serving.enable_compilation_cache``; ``JAX_LONGCTX_NO_COMPILATION_CACHE=1``
    turns it off), records the start.

    Args:
        module: the script's module name in ``benchmarks`` (``"bench_ring"``).
        args: parsed arguments with ``quick`` and ``out``.
        cpu_devices: emulated CPU devices (see :func:`setup_devices`); ``None`` for a
            benchmark that does not use JAX devices.
        argv: the arguments to record (default ``sys.argv[1:]``).
        stem: results file name without ``.md`` (default: the module without ``bench_``).
    """
    if cpu_devices is not None:
        setup_devices(cpu_devices)
        import offload.serving

        offload.serving.enable_compilation_cache()  # timings exclude compiles; reruns start sooner
    stem = stem or module.removeprefix("bench_")
    out = args.out or (QUICK_DIR if args.quick else RESULTS_DIR) / f"{stem}.md"
    return Run(
        module=module,
        argv=list(sys.argv[1:] if argv is None else argv),
        out=pathlib.Path(out),
        quick=bool(args.quick),
        uses_devices=cpu_devices is not None,
        started=time.perf_counter(),
        load_start=load_average(),
    )


def ms(seconds: float | None, digits: int = 1) -> str:
    """``12.3 ms``, or ``-`` for a method that was not run."""
    return "-" if seconds is None else f"{seconds * 1e3:.{digits}f} ms"


def layout_positions(layout: str, batch: int, length: int, num_shards: int) -> Any:
    """``ringattn.Positions(q, kv)`` of ``[batch, length]`` global positions in ``layout``
    order, concrete even under ``jit`` (computed at trace time), so the ring still reads its
    live hops off them. ``ringattn.sharded_attention`` needs them for a permuted layout under
    a causal or window mask: inputs go through ``to_layout``, and so do their positions."""
    import jax
    import numpy as np

    import ringattn

    natural = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length))
    with jax.ensure_compile_time_eval():
        pos = ringattn.to_layout(natural, layout, num_shards=num_shards)
    return ringattn.Positions(pos, pos)
