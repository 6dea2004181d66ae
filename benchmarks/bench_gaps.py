"""The speed gaps of issue 12 in one table, and how each cost grows per doubling of S.

Reruns, with the measuring functions of the other scripts, the measurements behind:

| gap | target |
|---|---|
| blockwise backward / forward time (non-causal) | <= 2.5x |
| blockwise fwd+bwd efficiency vs same-run matmul | >= 55% |
| blockwise forward efficiency | >= 65% |
| causal / non-causal blockwise forward, every size | <= 0.55 |
| paged decode / contiguous heads-major decode (B=8, page 16) | <= 1.10x |
| host page-out, page-in vs same-run memcpy (medians) | >= 0.85 |
| ring causal fwd+bwd vs the Ring Attention paper's JAX code, 8 devices | <= 0.6 |

and prints it with the measured ratio and whether each target is met (the efficiency rows
also name their ceiling: ``bench_blockwise.block_matmuls``, the kernels' block products alone,
timed beside them; the paged row names the walk's gathers alone), then a scaling table:
t(S') / t(S) for consecutive doublings of S of the blockwise forward and forward+backward
(compute: ~4x per doubling), one paged decode step (~2x: linear) and the blockwise compiled
temporary memory (~2x: linear), so the scaling claim is measured, not asserted.

Sources: ``bench_blockwise`` (attention paths, matmul rate, FLOP counts),
``bench_paged.bench_main`` (paged vs contiguous heads-major decode), ``bench_offload
.measure_throughput`` (page-out / page-in / memcpy), ``bench_ring`` (mesh, jitted ring
functions, inputs) and ``benchmarks/_paper_ring.py`` (a port of the paper's code: its package
no longer imports on current JAX). Each part runs in its own process (``--part``): the ring
needs 8 emulated CPU devices, the rest one device. Compute times are the best of the repeats
(as ``bench_blockwise`` / ``bench_paged`` / ``bench_ring`` report them), host transfers the
median (the target says so); every ratio is between methods timed interleaved in one process.

Usage (from the repository root):
  python -m benchmarks.bench_gaps            # the targets' sizes (16K backward, 8K-32K causal,
                                             # B=8 x 32K decode, 8K ring): ~15 minutes idle
  python -m benchmarks.bench_gaps --quick    # 8K backward and causal, B=8 x 8K decode, 8K
                                             # ring (stated in the table): ~5 minutes idle
"""

import dataclasses
import itertools
import json
import pathlib
import subprocess
import sys
import tempfile

from benchmarks import _common

PARTS = ("blockwise", "paged", "offload", "ring")
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKWISE_SHAPE = (1, 8, 64)  # B, N (= K), H, as bench_blockwise
PAGED_SHAPE = (32, 8, 128, 16)  # N, K, H, C, as bench_paged


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each part measures (lengths are powers of two, so consecutive ones are doublings)."""

    fwd_lengths: tuple[int, ...]  # non-causal blockwise forward timed (scaling)
    bwd_lengths: tuple[int, ...]  # non-causal blockwise fwd+bwd timed; the largest: gap rows
    causal_lengths: tuple[int, ...]  # causal / non-causal forward
    memory_lengths: tuple[int, ...]  # compiled temporaries (compile only beyond timed ones)
    matmul_n: int
    repeats: int
    decode_batch: int
    decode_lengths: tuple[int, ...]  # paged decode; the largest: the gap row
    decode_repeats: int
    decode_sweep: tuple[int, ...]  # pages_per_block values tried (the best is kept)
    transfer_repeats: int
    transfer_page_bytes: int
    transfer_bytes: int
    ring_length: int
    ring_repeats: int
    ring_chunk: int = 512  # the paper's query / key chunk
    block_q: int = 512  # blockwise block sizes (ringattn.BlockSizes defaults)
    block_kv: int = 512
    blockwise_shape: tuple[int, int, int] = BLOCKWISE_SHAPE
    paged_shape: tuple[int, int, int, int] = PAGED_SHAPE


K_ = 1024
MiB = _common.MiB
FULL = Sizes(
    fwd_lengths=(2 * K_, 4 * K_, 8 * K_, 16 * K_, 32 * K_),
    bwd_lengths=(2 * K_, 4 * K_, 8 * K_, 16 * K_),
    causal_lengths=(8 * K_, 16 * K_, 32 * K_),
    memory_lengths=(2 * K_, 4 * K_, 8 * K_, 16 * K_, 32 * K_, 64 * K_),
    matmul_n=4096,
    repeats=3,
    decode_batch=8,
    decode_lengths=(8 * K_, 16 * K_, 32 * K_),
    decode_repeats=9,
    decode_sweep=(8, 16, 32, 64),
    transfer_repeats=9,
    transfer_page_bytes=16 * MiB,
    transfer_bytes=256 * MiB,
    ring_length=8 * K_,
    ring_repeats=3,
)
QUICK = Sizes(
    fwd_lengths=(2 * K_, 4 * K_, 8 * K_),
    bwd_lengths=(2 * K_, 4 * K_, 8 * K_),
    causal_lengths=(2 * K_, 4 * K_, 8 * K_),
    memory_lengths=(2 * K_, 4 * K_, 8 * K_, 16 * K_, 32 * K_),
    matmul_n=2048,
    repeats=3,
    decode_batch=8,
    decode_lengths=(2 * K_, 4 * K_, 8 * K_),
    decode_repeats=5,
    decode_sweep=(16, 32, 64),
    transfer_repeats=7,
    transfer_page_bytes=16 * MiB,
    transfer_bytes=256 * MiB,
    ring_length=8 * K_,
    ring_repeats=3,
)
TINY = Sizes(  # the tests' sizes: seconds, meaningless timings
    fwd_lengths=(128, 256),
    bwd_lengths=(128, 256),
    causal_lengths=(128, 256),
    memory_lengths=(128, 256, 512),
    matmul_n=128,
    repeats=1,
    decode_batch=2,
    decode_lengths=(64, 128),
    decode_repeats=2,
    decode_sweep=(2, 4),
    transfer_repeats=3,
    transfer_page_bytes=MiB // 4,
    transfer_bytes=2 * MiB,
    ring_length=128,
    ring_repeats=1,
    ring_chunk=8,
    block_q=64,
    block_kv=64,
    blockwise_shape=(1, 2, 16),
    paged_shape=(4, 2, 8, 16),
)
SIZES = {"full": FULL, "quick": QUICK, "tiny": TINY}


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


# ------------------------------------------------------------------------------------------
# Parts: each returns a JSON-able dict (lengths as string keys)
# ------------------------------------------------------------------------------------------
def measure_blockwise(sizes: Sizes) -> dict:
    """Blockwise forward (causal and not) and non-causal fwd+bwd times, compiled temporaries,
    and the same-run matmul rate, on the default device."""
    import jax
    import jax.numpy as jnp

    from benchmarks import bench_blockwise
    from ringattn import BlockSizes

    B, N, H = sizes.blockwise_shape
    blocks = BlockSizes(block_q=sizes.block_q, block_kv=sizes.block_kv)
    make = bench_blockwise.make_paths(blocks)["blockwise"]
    mm = bench_blockwise.matmul_flops_per_s(repeats=max(2, sizes.repeats), n=sizes.matmul_n)
    out = {"matmul_flops": mm, "fwd": {}, "fwd_causal": {}, "fwd_bwd": {}, "bwd": {}}
    out |= {"temp_fwd": {}, "temp_fwd_bwd": {}, "matmuls_fwd": {}, "matmuls_bwd": {}}
    mm_fwd, mm_bwd = bench_blockwise.block_matmuls(sizes.block_q, sizes.block_kv)
    lengths = sorted({*sizes.fwd_lengths, *sizes.bwd_lengths, *sizes.causal_lengths})
    for L in sorted({*lengths, *sizes.memory_lengths}):
        shape = jax.ShapeDtypeStruct((B, L, N, H), jnp.float32)
        attend = make(False)
        fwd, fwd_bwd = bench_blockwise.jit_fwd_and_fwd_bwd(attend)
        causal_fwd, _ = bench_blockwise.jit_fwd_and_fwd_bwd(make(True))
        compiled = {}
        for name, f in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            compiled[name] = f.lower(shape, shape, shape).compile()
            temp = compiled[name].memory_analysis().temp_size_in_bytes
            out[f"temp_{name}"][str(L)] = temp
        if L not in lengths:
            continue  # memory only
        q, k, v = (jax.random.normal(jax.random.key(i), (B, L, N, H)) for i in range(3))
        # The forward at every timed length: the denominator of the causal and backward ratios.
        fns = {"fwd": lambda c=compiled["fwd"], q=q, k=k, v=v: c(q, k, v)}
        if L in sizes.causal_lengths:
            c = causal_fwd.lower(shape, shape, shape).compile()
            fns["fwd_causal"] = lambda c=c, q=q, k=k, v=v: c(q, k, v)
        if L in sizes.bwd_lengths:
            fns["fwd_bwd"] = lambda c=compiled["fwd_bwd"], q=q, k=k, v=v: c(q, k, v)
            # The backward alone: the saved residuals of one forward, then the pullback.
            out_, pullback = jax.jit(lambda q, k, v, f=attend: jax.vjp(f, q, k, v))(q, k, v)
            c = jax.jit(lambda f, g: f(g)).lower(pullback, 2 * out_).compile()
            fns["bwd"] = lambda c=c, f=pullback, g=2 * out_: c(f, g)
        if L == max(sizes.bwd_lengths):
            # The kernels' block products alone (the efficiency rows' ceiling), and the matmul
            # rate again, timed in the same rounds as the rows it divides (this machine's
            # matmul rate moved by 1.5x within minutes in one session).
            fns["matmuls_fwd"] = lambda q=q, k=k, v=v: mm_fwd(q, k, v)
            fns["matmuls_bwd"] = lambda q=q, k=k, v=v: mm_bwd(q, k, v, q)
            fns["matmul"], matmul_flops = bench_blockwise.matmul_call(sizes.matmul_n)
        timing = _common.time_interleaved(fns, repeats=sizes.repeats)
        if "matmul" in timing:
            out["matmul_flops_interleaved"] = {str(L): matmul_flops / timing["matmul"].best}
        for name, t in timing.items():
            if name != "matmul":
                out[name][str(L)] = t.best
        print(f"blockwise L={L}: " + ", ".join(f"{n} {_common.ms(t.best)}" for n, t in timing.items()), flush=True)  # fmt: skip
    return out


def measure_paged(sizes: Sizes) -> dict:
    """One paged decode step vs the contiguous heads-major einsum (``bench_paged.bench_main``)
    at each decode length, batch ``decode_batch``."""
    from benchmarks import bench_paged

    N, K, H, C = sizes.paged_shape
    out = {"by_length": {}}
    for S in sizes.decode_lengths:
        r = bench_paged.bench_main(
            sizes.decode_batch, S, N, K, H, C, sizes.decode_repeats, sizes.decode_sweep
        )
        keep = {key: r[key] for key in ("contiguous", "paged", "gathers", "best", "err", "limit")}
        out["by_length"][str(S)] = keep
        print(f"paged S={S}: {keep}", flush=True)
    return out


def measure_offload(sizes: Sizes) -> dict:
    """Medians of page-out, page-in and a same-run memcpy (``bench_offload``)."""
    from benchmarks import bench_offload

    timings = bench_offload.measure_throughput(
        sizes.transfer_repeats, page_bytes=sizes.transfer_page_bytes, total=sizes.transfer_bytes
    )
    out = {name: t.median for name, t in timings.items()}
    print(f"offload medians: {out}", flush=True)
    return out


def measure_ring(sizes: Sizes) -> dict:
    """Causal fwd+bwd of our ring (``sharded_attention``, zigzag, ``bench_ring.make_fns``) and
    of the paper's code (contiguous shards, its only layout) on the same 8-device mesh and
    inputs (K = N: the paper's code has no GQA), timed interleaved."""
    import jax
    import jax.numpy as jnp

    import ringattn
    from benchmarks import _paper_ring, bench_ring

    S, n = sizes.ring_length, bench_ring.DEVICES
    K = bench_ring.N
    _, ours, sharding = bench_ring.make_fns("ring", "zigzag", True, K)
    mesh = bench_ring.mesh_for((n,), ("seq",))
    paper_fwd = _paper_ring.make_paper_ring(mesh, "seq", causal=True, chunk=sizes.ring_chunk)

    def paper_fwd_bwd(q, k, v):
        out, vjp = jax.vjp(paper_fwd, q, k, v)
        return vjp(out)  # as bench_ring's fwd_bwd

    natural = bench_ring.inputs(S, K, sharding)  # the paper's order: contiguous shards
    # Ours takes the same tokens in zigzag order (permuted once at the data boundary, untimed).
    zigzag = [
        jax.device_put(ringattn.to_layout(x, "zigzag", num_shards=n), sharding) for x in natural
    ]
    args = {"ours": zigzag, "paper": natural}
    compiled = {
        "ours": ours.lower(*zigzag).compile(),
        "paper": jax.jit(paper_fwd_bwd).lower(*natural).compile(),
    }
    grads = {name: c(*args[name]) for name, c in compiled.items()}
    back = [ringattn.from_layout(g, "zigzag", num_shards=n) for g in grads["ours"]]
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(back, grads["paper"], strict=True))
    timing = _common.time_interleaved(
        {name: (lambda c=c, a=args[name]: c(*a)) for name, c in compiled.items()},
        repeats=sizes.ring_repeats,
    )
    out = {name: t.best for name, t in timing.items()} | {"grad_err": err, "S": S}
    out |= {"B": bench_ring.B, "N": bench_ring.N, "H": bench_ring.H}
    print(f"ring S={S}: {out}", flush=True)
    return out


MEASURE = {
    "blockwise": measure_blockwise,
    "paged": measure_paged,
    "offload": measure_offload,
    "ring": measure_ring,
}
DEVICES = {"blockwise": 1, "paged": 1, "offload": 1, "ring": 8}


# ------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------
def _by_length(d: dict) -> dict[int, float]:
    return {int(key): value for key, value in d.items()}


def gap_rows(results: dict, sizes: Sizes) -> list[tuple[str, float, str, bool, str]]:
    """``(gap, measured ratio, target, met, note)`` per row of the gap table."""
    from benchmarks.bench_blockwise import attention_flops

    rows = []
    bw = results["blockwise"]
    B, N, H = sizes.blockwise_shape
    fwd, fwd_bwd = _by_length(bw["fwd"]), _by_length(bw["fwd_bwd"])
    L = max(sizes.bwd_lengths)
    # The matmul rate timed interleaved with the rows it divides, where the run has it (runs
    # before it had only the rate timed once at the start of the part).
    mm = bw.get("matmul_flops_interleaved", {}).get(str(L), bw["matmul_flops"])
    r = _by_length(bw["bwd"])[L] / fwd[L]
    rows.append((
        f"blockwise backward / forward time (non-causal, T=S={_k(L)})",
        r, "<= 2.5x", r <= 2.5,
        "backward alone: the pullback from a forward's saved residuals; "
        f"(fwd+bwd) / fwd = {fwd_bwd[L] / fwd[L]:.2f}x",
    ))  # fmt: skip
    flops_fb = attention_flops(L, L, N, H, False, True) * B
    flops_f = attention_flops(L, L, N, H, False, False) * B
    eff_fb, eff_f = flops_fb / fwd_bwd[L] / mm, flops_f / fwd[L] / mm
    note_fb, note_f = f"matmul {mm / 1e9:.1f} GFLOP/s", ""
    if "matmul_flops_interleaved" in bw:
        note_fb += f" timed with these rows ({bw['matmul_flops'] / 1e9:.1f} at the part's start)"
    if str(L) in bw.get("matmuls_fwd", {}):  # results of runs before this row had no ceiling
        t_f, t_b = _by_length(bw["matmuls_fwd"])[L], _by_length(bw["matmuls_bwd"])[L]
        ceiling_fb, ceiling_f = flops_fb / (t_f + t_b) / mm, flops_f / t_f / mm
        note_fb += f"; the same block matmuls alone (no softmax): {ceiling_fb:.0%}"
        note_f = f"the same block matmuls alone (no softmax): {ceiling_f:.0%}"
    rows.append((
        f"blockwise fwd+bwd efficiency vs same-run matmul (T=S={_k(L)})",
        eff_fb, ">= 55%", eff_fb >= 0.55, note_fb,
    ))  # fmt: skip
    rows.append((
        f"blockwise forward efficiency (T=S={_k(L)})", eff_f, ">= 65%", eff_f >= 0.65, note_f,
    ))  # fmt: skip
    causal = _by_length(bw["fwd_causal"])
    ratios = {S: causal[S] / fwd[S] for S in sizes.causal_lengths}
    worst = max(ratios.values())
    sizes_text = ", ".join(_k(S) for S in sizes.causal_lengths)
    rows.append((
        f"causal / non-causal blockwise forward (T=S in {sizes_text}; measured: the worst size)",
        worst, "<= 0.55 at every size", worst <= 0.55,
        ", ".join(f"{_k(S)}: {r:.2f}" for S, r in ratios.items()),
    ))  # fmt: skip
    paged = _by_length(results["paged"]["by_length"])
    S = max(sizes.decode_lengths)
    p = paged[S]
    r = p["paged"] / p["contiguous"]
    rows.append((
        f"paged decode / contiguous heads-major decode (B={sizes.decode_batch} x {_k(S)}, "
        f"page {sizes.paged_shape[3]})",
        r, "<= 1.10x", r <= 1.10,
        f"pages_per_block={p['best']}; the walk's gathers alone: "
        f"{p['gathers'] / p['contiguous']:.2f}x",
    ))  # fmt: skip
    off = results["offload"]
    for op, label in (("page_out", "page-out"), ("page_in", "page-in")):
        r = off["memcpy"] / off[op]
        rows.append((
            f"host {label} vs same-run memcpy (median, {sizes.transfer_bytes // MiB} MiB in "
            f"{sizes.transfer_page_bytes / MiB:g} MiB pages)",
            r, ">= 0.85", r >= 0.85, "memcpy time / transfer time",
        ))  # fmt: skip
    ring = results["ring"]
    r = ring["ours"] / ring["paper"]
    rows.append((
        f"ring causal fwd+bwd vs the Ring Attention paper's JAX code, 8 devices "
        f"(S={_k(ring['S'])})",
        r, "<= 0.6", r <= 0.6,
        f"ours zigzag {_common.ms(ring['ours'], 0)}, paper {_common.ms(ring['paper'], 0)}; "
        f"max abs gradient difference {ring['grad_err']:.1e}",
    ))  # fmt: skip
    return rows


def _fmt_ratio(label: str, value: float) -> str:
    return f"{value:.0%}" if "%" in label else f"{value:.2f}x"


def scaling_rows(results: dict, sizes: Sizes) -> list[tuple[str, int, int, float, str]]:
    """``(quantity, S, S', value(S') / value(S), expected)`` for consecutive lengths."""
    bw = results["blockwise"]
    paged = _by_length(results["paged"]["by_length"])
    series = [
        ("blockwise forward time (non-causal)", _by_length(bw["fwd"]), sizes.fwd_lengths, "~4x"),
        (
            "blockwise fwd+bwd time (non-causal)",
            _by_length(bw["fwd_bwd"]),
            sizes.bwd_lengths,
            "~4x",
        ),
        (
            f"paged decode step (B={sizes.decode_batch})",
            {S: p["paged"] for S, p in paged.items()},
            sizes.decode_lengths,
            "~2x",
        ),
        (
            "blockwise forward compiled temporaries",
            _by_length(bw["temp_fwd"]),
            sizes.memory_lengths,
            "~2x",
        ),
        (
            "blockwise fwd+bwd compiled temporaries",
            _by_length(bw["temp_fwd_bwd"]),
            sizes.memory_lengths,
            "~2x",
        ),
    ]
    rows = []
    for name, values, lengths, expected in series:
        ordered = sorted(lengths)
        for a, b in itertools.pairwise(ordered):
            rows.append((name, a, b, values[b] / values[a], expected))
    return rows


def report_lines(results: dict, sizes: Sizes, label: str) -> list[str]:
    """The Markdown body: the gap table, then the scaling table."""
    B, N, H = sizes.blockwise_shape
    ring = results["ring"]
    lines = [
        f"Sizes: {label}. Blockwise: B={B}, N=K={N}, H={H}, float32, one CPU device, blocks "
        f"{sizes.block_q}x{sizes.block_kv}, best of {sizes.repeats} interleaved runs. Paged: "
        f"N, K, H, C = {sizes.paged_shape}, best of {sizes.decode_repeats}. Transfers: median "
        f"of {sizes.transfer_repeats}. Ring: B={ring['B']}, N=K={ring['N']}, H={ring['H']}, "
        "float32, 8 emulated CPU devices "
        f"sharing the host's cores, ours zigzag vs the paper's contiguous chunks of "
        f"{sizes.ring_chunk}, best of {sizes.ring_repeats}. Every ratio compares methods "
        "timed interleaved in one process.",
        "",
        "## Gaps (issue 12)",
        "",
        "| gap | measured ratio | target | met? | note |",
        "|---|---:|---|---|---|",
    ]
    for gap, value, target, met, note in gap_rows(results, sizes):
        lines.append(
            f"| {gap} | {_fmt_ratio(target, value)} | {target} | {'yes' if met else '**no**'} "
            f"| {note} |"
        )
    lines += [
        "",
        "## Scaling: value(S') / value(S) per doubling of S",
        "",
        "Compute grows ~4x per doubling (quadratic), a decode step and memory ~2x (linear); "
        "small sizes sit below that (fixed costs).",
        "",
        "| quantity | S -> S' | ratio | expected |",
        "|---|---|---:|---|",
    ]
    for name, a, b, ratio, expected in scaling_rows(results, sizes):
        lines.append(f"| {name} | {_k(a)} -> {_k(b)} | {ratio:.2f}x | {expected} |")
    return lines


# ------------------------------------------------------------------------------------------
def run_part(part: str, sizes_name: str, json_out: pathlib.Path) -> None:
    """Runs one part in this (fresh) process and writes its results as JSON."""
    _common.setup_devices(DEVICES[part])
    result = MEASURE[part](SIZES[sizes_name])
    json_out.write_text(json.dumps(result))


def main(argv=None):
    parser = _common.make_parser(__doc__)
    parser.add_argument("--part", choices=PARTS, help="internal: run one part, write --json")
    parser.add_argument("--json", type=pathlib.Path, help="internal: where --part writes")
    parser.add_argument("--tiny", action="store_true", help="test sizes (seconds; no meaning)")
    args = parser.parse_args(argv)
    sizes_name = "tiny" if args.tiny else "quick" if args.quick else "full"
    if args.part:
        run_part(args.part, sizes_name, args.json)
        return
    if args.tiny and args.out is None:
        parser.error("--tiny needs --out (it must not overwrite a real table)")
    run = _common.start_run("bench_gaps", args, cpu_devices=None, argv=argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for part in PARTS:
            path = pathlib.Path(tmp) / f"{part}.json"
            command = [sys.executable, "-m", "benchmarks.bench_gaps", "--part", part]
            command += ["--json", str(path), *(["--quick"] if args.quick else [])]
            command += ["--tiny"] if args.tiny else []
            print(f"=== part {part}", flush=True)
            subprocess.run(command, cwd=REPO_ROOT, check=True)
            results[part] = json.loads(path.read_text())
    label = {"full": "full", "quick": "quick (smaller than the targets' sizes)", "tiny": "tiny"}
    lines = report_lines(results, SIZES[sizes_name], label[sizes_name])
    lines += ["", f"JAX: {_jax_version()}; parts ran in their own processes ({', '.join(PARTS)})."]
    run.write("Speed gaps of issue 12, and scaling per doubling", lines)


def _jax_version() -> str:
    import jax

    return jax.__version__


if __name__ == "__main__":
    main()
