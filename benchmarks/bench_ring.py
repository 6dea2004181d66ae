"""Sequence-parallel attention on 8 CPU devices: time, compiled memory and communication.

Rerun from the repository root:
        python -m benchmarks.bench_ring            (about 3 minutes idle)
        python -m benchmarks.bench_ring --quick    (about 1 minute idle)
        python -m benchmarks.bench_ring --seq-lens 4096,16384,32768
                                          (every config, K=8 and 2: hours on 2 cores)

Three tables, Markdown to stdout and to benchmarks/results/ring.md (``--quick``:
benchmarks/results/quick/ring.md):

1. Time of forward and forward+backward per strategy and layout, causal and not, with the
   causal / non-causal ratio (target: causal zigzag ring fwd+bwd <= 0.55x non-causal at 16K).
2. Per-device compiled memory (compile only, nothing runs: ``jax.ShapeDtypeStruct`` inputs with
   shardings, ``compiled.memory_analysis()``) up to 1M tokens, and its ratio to the per-device
   bytes of q, k, v and out together (target <= 4x at 1M for the ring).
3. Bytes each device sends, from the shapes (only K heads travel in the ring).

On CPU the 8 "devices" share the host's cores (2 here), so absolute times are not what a
GPU/TPU would show and there is no compute/communication overlap; the ratios are the point.
"""

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _common
from ringattn import sharded_attention

DEVICES = 8
B, N, H = 1, 8, 64
DTYPE = jnp.float32
# strategy, layout, mesh shape, seq_axis: the mesh is always 8 devices
CONFIGS = {
    ("ring", "contiguous"): ((8,), ("seq",), "seq"),
    ("ring", "zigzag"): ((8,), ("seq",), "seq"),
    ("ring", "striped"): ((8,), ("seq",), "seq"),
    ("allgather", "zigzag"): ((8,), ("seq",), "seq"),
    ("ulysses", "contiguous"): ((8,), ("seq",), "seq"),
    ("usp", "zigzag"): ((2, 4), ("u", "r"), ("u", "r")),
}


def mesh_for(shape, names):
    devices = np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def make_fns(strategy, layout, causal, K):
    shape, names, seq_axis = CONFIGS[(strategy, layout)]
    mesh = mesh_for(shape, names)
    # "usp": the sequence is split over (ring axis, ulysses axis), ring major
    spec = P(None, (names[1], names[0]) if strategy == "usp" else seq_axis)

    shards = mesh.shape[names[1]] if strategy == "usp" else mesh.shape[seq_axis]

    def fwd(q, k, v):
        positions = None  # a permuted layout under a causal mask takes its positions
        if causal and layout != "contiguous":
            positions = _common.layout_positions(layout, q.shape[0], q.shape[1], shards)
        return sharded_attention(
            q, k, v, mesh=mesh, seq_axis=seq_axis, strategy=strategy, layout=layout, causal=causal,
            positions=positions,
        ).out  # fmt: skip

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(fwd, q, k, v)
        return vjp(out)  # any cotangent of the right shape

    sharding = NamedSharding(mesh, spec)
    return jax.jit(fwd), jax.jit(fwd_bwd), sharding


def inputs(S, K, sharding, *, abstract=False):
    shapes = ((B, S, N, H), (B, S, K, H), (B, S, K, H))
    if abstract:
        return [jax.ShapeDtypeStruct(s, DTYPE, sharding=sharding) for s in shapes]
    rng = np.random.default_rng(0)
    return [jax.device_put(rng.standard_normal(s, np.float32), sharding) for s in shapes]


def time_call(f, args, repeats):
    compiled = f.lower(*args).compile()
    return _common.time_call(compiled, *args, repeats=repeats).best


def bench_time(jobs, repeats):
    rows = []
    for S, K, strategy, layout in jobs:
        times = {}
        for causal in (False, True):
            fwd, fwd_bwd, sharding = make_fns(strategy, layout, causal, K)
            args = inputs(S, K, sharding)
            times[causal] = (time_call(fwd, args, repeats), time_call(fwd_bwd, args, repeats))
        row = (S, K, strategy, layout, *times[False], *times[True])
        rows.append(row)
        print(_time_row(row), flush=True)
    return rows


def _time_row(row):
    S, K, strategy, layout, f_nc, fb_nc, f_c, fb_c = row
    return (
        f"| {S} | {K} | {strategy} | {layout} | {f_nc * 1e3:.0f} | {fb_nc * 1e3:.0f} | "
        f"{f_c * 1e3:.0f} | {fb_c * 1e3:.0f} | {f_c / f_nc:.2f} | {fb_c / fb_nc:.2f} |"
    )


def bench_memory(jobs, K):
    rows = []
    for S, strategy, layout in jobs:
        io_bytes = B * (S // DEVICES) * (2 * N + 2 * K) * H * 4  # q, k, v, out per device
        fwd, fwd_bwd, sharding = make_fns(strategy, layout, True, K)
        args = inputs(S, K, sharding, abstract=True)
        totals = []
        for f in (fwd, fwd_bwd):
            m = f.lower(*args).compile().memory_analysis()
            totals.append(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)
        row = (S, strategy, layout, io_bytes, *totals)
        rows.append(row)
        print(_memory_row(row), flush=True)
    return rows


def _memory_row(row):
    S, strategy, layout, io_bytes, fwd, fwd_bwd = row
    mib = 2.0**20
    return (
        f"| {S} | {strategy} | {layout} | {io_bytes / mib:.1f} | {fwd / mib:.1f} | "
        f"{fwd / io_bytes:.2f} | {fwd_bwd / mib:.1f} | {fwd_bwd / io_bytes:.2f} |"
    )


def communication_rows(S, kv_heads):
    """Bytes one device sends in the forward pass (float32), from the shapes."""
    n, local = DEVICES, S // DEVICES
    rows = []
    for K in kv_heads:
        kv_shard = 2 * B * local * K * H * 4  # k and v of one shard
        q_shard = B * local * N * H * 4
        rows += [
            (K, "ring", "per hop", kv_shard, (n - 1) * kv_shard),
            (K, "allgather", "one all-gather", None, (n - 1) * kv_shard),
            (
                K,
                f"ulysses (kv heads sent: lcm(K, 8) = {math.lcm(K, n)})",
                "q, k, v, out all-to-alls",
                None,
                (n - 1) / n * (2 * q_shard + 2 * B * local * math.lcm(K, n) * H * 4),
            ),
        ]
    return rows


def default_jobs(quick: bool, seq_lens, kv_heads):
    """(timing jobs, memory jobs). Explicit --seq-lens: every config at every S and K."""
    if seq_lens:
        timing = [(S, K, *c) for S in seq_lens for K in kv_heads for c in CONFIGS]
    elif quick:
        timing = [(1024, 2, *c) for c in CONFIGS]
    else:
        timing = [(4096, 2, "ring", "contiguous"), (4096, 2, "ring", "zigzag")]
        timing += [(2048, 2, *c) for c in CONFIGS if c != ("ring", "contiguous")]
    if quick:
        memory = [(S, "ring", "zigzag") for S in (16384, 65536)]
    else:
        memory = [(S, "ring", "zigzag") for S in (65536, 262144, 1048576)]
        memory += [(1048576, "allgather", "zigzag"), (1048576, "ulysses", "contiguous")]
    return timing, memory


def main(argv=None):
    parser = _common.make_parser(__doc__)
    parser.add_argument(
        "--seq-lens", type=str, default=None, help="time every config at these S, e.g. 4096,16384"
    )
    parser.add_argument(
        "--memory-lens", type=str, default=None, help="S for the memory table (ring zigzag)"
    )
    parser.add_argument("--kv-heads", type=str, default="8,2", help="K values with --seq-lens")
    parser.add_argument(
        "--configs",
        type=str,
        default=None,
        help="with --seq-lens: only these strategy:layout pairs, e.g. ring:zigzag,ulysses:contiguous",
    )
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    run = _common.start_run("bench_ring", args, cpu_devices=DEVICES, argv=argv)

    kv_heads = [int(x) for x in args.kv_heads.split(",")]
    seq_lens = [int(x) for x in args.seq_lens.split(",")] if args.seq_lens else None
    timing_jobs, memory_jobs = default_jobs(args.quick, seq_lens, kv_heads)
    if args.configs:
        wanted = {tuple(c.split(":")) for c in args.configs.split(",")}
        unknown = wanted - set(CONFIGS)
        if unknown:
            parser.error(f"unknown --configs {sorted(unknown)}; choose from {sorted(CONFIGS)}")
        timing_jobs = [job for job in timing_jobs if tuple(job[2:]) in wanted]
    if args.memory_lens:
        memory_jobs = [(int(S), "ring", "zigzag") for S in args.memory_lens.split(",")]

    lines = [
        f"B={B}, N={N}, H={H}, float32, 8 emulated CPU devices (`jax_num_cpu_devices=8`). "
        "On CPU the 8 devices share the host's cores (2 here, shared with other jobs), so "
        "absolute times are not what a GPU/TPU would show (no overlap of compute and "
        "communication, collectives are memory copies); the ratios are the point.",
        "",
        "## Time (ms, best of repeats after a warm-up; causal / non-causal ratio)",
        "",
        "| S | K | strategy | layout | fwd | fwd+bwd | causal fwd | causal fwd+bwd "
        "| causal/non fwd | causal/non fwd+bwd |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    t0 = time.time()
    time_rows = bench_time(timing_jobs, args.repeats)
    lines += [_time_row(r) for r in time_rows]
    zigzag = [r for r in time_rows if r[2] == "ring" and r[3] == "zigzag"]
    if zigzag:
        ratios = ", ".join(f"S={r[0]} K={r[1]}: {r[7] / r[5]:.2f}x" for r in zigzag)
        lines += [
            "",
            f"Causal zigzag ring fwd+bwd / non-causal: {ratios} (target <= 0.55x at 16K; "
            "run `--seq-lens 16384 --kv-heads 2 --configs ring:zigzag` for that size, "
            "several minutes on this CPU).",
        ]

    header = [
        "",
        "## Per-device compiled memory (causal, K=2, compile only)",
        "",
        "io = per-device bytes of q, k, v and out together; total = arguments + outputs + "
        "temporaries from `compiled.memory_analysis()`.",
        "",
        "| S | strategy | layout | io MiB | fwd MiB | fwd / io | fwd+bwd MiB | fwd+bwd / io |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(header), flush=True)
    memory_rows = bench_memory(memory_jobs, 2)
    lines += header + [_memory_row(r) for r in memory_rows]

    S_comm = max(job[0] for job in timing_jobs)
    comm = [
        "",
        f"## Bytes sent per device, forward, S={S_comm} (from shapes; float32)",
        "",
        "The ring moves only the K kv heads: with K=2 a hop is 4x smaller than with K=8. "
        "The backward pass of the ring sends K/V again plus float32 dK/dV (3x the forward).",
        "",
        "| K | strategy | collective | bytes per hop | total bytes |",
        "|---|---|---|---|---|",
    ]
    for K, strategy, what, hop, total in communication_rows(S_comm, (8, 2)):
        hop_text = "-" if hop is None else f"{hop / 2**20:.2f} MiB"
        comm.append(f"| {K} | {strategy} | {what} | {hop_text} | {total / 2**20:.2f} MiB |")
    print("\n".join(comm), flush=True)
    lines += [*comm, "", f"Total benchmark time: {time.time() - t0:.0f} s."]
    run.write("Sequence-parallel attention on 8 CPU devices", lines)


if __name__ == "__main__":
    main()
