"""Did a commit slow the attention kernels? The same measurements at several commits, and the
backward's ``optimization_barrier`` on and off, in one run.

Each commit is checked out in a temporary ``git worktree`` and measured in its own process
(its ``ringattn`` first on ``PYTHONPATH``), the commits alternating round by round so a burst
of load hits them alike. A process times, on one CPU device, ``ringattn.blockwise_attention``
at B=1, N=8, H=64, float32, the default blocks: the causal and the full forward, and the full
and causal forward+backward (``jax.grad``), best of ``--repeats``; it reports causal / full
forward and backward / forward ((fwd+bwd - fwd) / fwd). With ``--ring`` it also runs that
commit's own ``bench_gaps --quick --part ring`` (our zigzag ring fwd+bwd on 8 emulated devices
against the Ring Attention paper's JAX code, 8K).

The barrier row: in this checkout, one process compiles the blockwise fwd+bwd twice, with the
backward kernel's ``lax.optimization_barrier`` (which keeps XLA from folding the logits'
transpose back into the product: the GQA precision fix of 2026-12-03) and with it replaced by
the identity, and times the two interleaved.

Usage (from the repository root)::

    python -m benchmarks.bench_kernel_ab                       # 88df8c8 (2026-12-02) vs HEAD
    python -m benchmarks.bench_kernel_ab --commits A B C --rounds 3 --ring
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from benchmarks import _common

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_COMMITS = ("88df8c8", "HEAD")


def _inputs(length: int):
    """``q, k, v [1, length, 8, 64]`` float32, the same in every process."""
    import jax

    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(key, (1, length, 8, 64)) for key in keys)


def _fwd(causal: bool):
    import jax

    import ringattn

    return jax.jit(lambda q, k, v: ringattn.blockwise_attention(q, k, v, causal=causal)[0])


def _fwd_bwd(causal: bool):
    """The gradients of a loss through ``blockwise_attention`` (forward and backward), jitted."""
    import jax
    import jax.numpy as jnp

    import ringattn

    loss = lambda q, k, v: jnp.sum(ringattn.blockwise_attention(q, k, v, causal=causal)[0] * v)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def child(length: int, repeats: int) -> dict:
    """Runs in the commit's process: only ``ringattn``'s public API of every commit. It times
    by itself (interleaved rounds, best of ``repeats``) rather than with ``_common``, which in
    that process is the old commit's."""
    import jax

    q, k, v = _inputs(length)
    fns = {"fwd_causal": _fwd(True), "fwd_full": _fwd(False), "fb_full": _fwd_bwd(False),
           "fb_causal": _fwd_bwd(True)}  # fmt: skip
    for f in fns.values():
        jax.block_until_ready(f(q, k, v))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, f in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(f(q, k, v))
            best[name] = min(best[name], time.perf_counter() - start)
    return {
        **{name: round(t * 1e3, 1) for name, t in best.items()},
        "causal_over_full": round(best["fwd_causal"] / best["fwd_full"], 3),
        "bwd_over_fwd": round((best["fb_full"] - best["fwd_full"]) / best["fwd_full"], 3),
    }


def barrier_ab(length: int, repeats: int) -> dict:
    """Blockwise fwd+bwd with the backward's optimization_barrier and with the identity."""
    import jax
    from jax import lax

    q, k, v = _inputs(length)
    barrier = lax.optimization_barrier
    fns = {}
    try:
        for keep in (True, False):
            # The kernels call lax.optimization_barrier through the jax.lax module at trace
            # time: replacing the attribute replaces it there (checked in the program below).
            lax.optimization_barrier = barrier if keep else (lambda x: x)
            jax.clear_caches()  # the kernels' traces are cached per function
            for causal in (False, True):
                lowered = _fwd_bwd(causal).lower(q, k, v)
                found = lowered.as_text().count("optimization_barrier")
                if (found > 0) != keep:
                    raise RuntimeError(f"barrier kept={keep}: {found} barriers in the program")
                fns[(keep, causal)] = lowered.compile()
    finally:
        lax.optimization_barrier = barrier
    t = _common.time_interleaved({key: (lambda f=f: f(q, k, v)) for key, f in fns.items()}, repeats=repeats)  # fmt: skip
    ms = {key: t[key].best * 1e3 for key in fns}
    return {
        "full": (ms[(True, False)], ms[(False, False)]),
        "causal": (ms[(True, True)], ms[(False, True)]),
    }


def measure(commit: str, tree: pathlib.Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
    # Run as a script (its folder first on sys.path, not this checkout's root), so ``ringattn``
    # is the worktree's.
    command = [sys.executable, __file__, "--child", str(args.length), str(args.repeats)]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{commit}: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if args.ring:
        out = tree / "ring.json"
        ring = [sys.executable, "-m", "benchmarks.bench_gaps", "--quick", "--part", "ring", "--json", str(out)]  # fmt: skip
        done = subprocess.run(ring, cwd=tree, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{commit} ring: {done.stderr[-2000:]}")
        r = json.loads(out.read_text())
        result.update(ring_ours=round(r["ours"] * 1e3), ring_paper=round(r["paper"] * 1e3),
                      ring_over_paper=round(r["ours"] / r["paper"], 3))  # fmt: skip
    print(commit, json.dumps(result), flush=True)
    return result


def main(argv=None):
    parser = _common.make_parser(__doc__)
    parser.add_argument("--commits", nargs="+", default=list(DEFAULT_COMMITS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--ring", action="store_true", help="also each commit's 8K ring vs paper")
    args = parser.parse_args(argv)
    if args.quick:
        args.length, args.rounds, args.repeats = 2048, 1, 2
    run = _common.start_run("bench_kernel_ab", args, argv=argv)
    names = {c: subprocess.check_output(["git", "rev-parse", "--short", c], cwd=ROOT, text=True).strip() for c in args.commits}  # fmt: skip
    results: dict[str, list[dict]] = {c: [] for c in args.commits}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for c in args.commits:
            trees[c] = pathlib.Path(tmp) / names[c]
            subprocess.run(["git", "worktree", "add", "-f", "--detach", str(trees[c]), c], cwd=ROOT, check=True, capture_output=True)  # fmt: skip
        try:
            for _ in range(args.rounds):
                for c in args.commits:
                    results[c].append(measure(c, trees[c], args))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)  # fmt: skip
    barrier = barrier_ab(args.length, max(args.repeats, 2))
    cols = ["causal_over_full", "bwd_over_fwd", "fwd_full", "fb_full"] + (["ring_over_paper", "ring_ours", "ring_paper"] if args.ring else [])  # fmt: skip
    lines = [
        f"Blockwise B=1, N=8, H=64, S={args.length}, float32, default blocks, one CPU device; best of "
        f"{args.repeats} per process; {args.rounds} rounds, the commits alternating (one row a "
        "process). Times in ms.",
        "",
        "| commit | round | " + " | ".join(cols) + " |",
        "|---|---:|" + "---:|" * len(cols),
    ]
    for c in args.commits:
        for i, r in enumerate(results[c]):
            lines.append(f"| {c} ({names[c]}) | {i + 1} | " + " | ".join(str(r.get(k, "-")) for k in cols) + " |")  # fmt: skip
    lines += [
        "",
        "## The backward's optimization_barrier (this checkout, one process, interleaved)",
        "",
        "| fwd+bwd | with the barrier | identity instead | identity / barrier |",
        "|---|---:|---:|---:|",
    ]
    for name, (a, b) in barrier.items():
        lines.append(f"| {name} | {a:.0f} ms | {b:.0f} ms | {b / a:.3f} |")
    run.write("Kernel timings across commits", lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        main()
