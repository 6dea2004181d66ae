"""Quantized ring hops on 8 CPU devices: bytes per hop, step time and error, per hop format.

Rerun from the repository root:
        python -m benchmarks.bench_ring_quant                      (4K, 8K, 16K: long on 2 cores)
        python -m benchmarks.bench_ring_quant --quick              (512 tokens, about a minute)
        python -m benchmarks.bench_ring_quant --seq-lens 4096,8192 --repeats 5

One table, Markdown to stdout and to benchmarks/results/ring_quant.md (``--quick``:
benchmarks/results/quick/ring_quant.md): for each length ``S`` and ``hop_format`` in
(None, "int8", "fp8"), the ring (``sharded_attention``, zigzag layout, causal) on 8 devices:

* bytes each device sends per forward hop, from :func:`ringattn.hop_bytes` and, as a check,
  from the operands of the ``ppermute`` in the traced program (they must agree);
* forward and forward+backward time (ms, best of ``--repeats`` after a warm-up; the three
  formats of one length are timed interleaved, so load from other jobs hits them alike);
* the max abs difference of the output from the exact (``hop_format=None``) ring.

On CPU the 8 "devices" share the host's cores and ``ppermute`` is a memory copy, so the time
saved by smaller hops is not what a GPU/TPU interconnect would show (there, a hop overlaps
the previous block's compute); quantizing and dequantizing cost compute here. The bytes are
the point; the times show the overhead.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _common
from ringattn import hop_bytes, sharded_attention

DEVICES = 8
B, N, K, H = 1, 8, 2, 128
LAYOUT = "zigzag"
FORMATS = (None, "int8", "fp8")


def make_mesh():
    devices = np.asarray(jax.devices()[:DEVICES])
    return Mesh(devices, ("seq",), axis_types=(AxisType.Auto,))


def make_fns(mesh, hop_format, block_sizes=None):
    """``(forward, forward+backward)`` of the causal zigzag ring, not yet jitted."""

    def fwd(q, k, v):
        return sharded_attention(
            q,
            k,
            v,
            mesh=mesh,
            seq_axis="seq",
            layout=LAYOUT,
            causal=True,
            positions=_common.layout_positions(LAYOUT, q.shape[0], q.shape[1], DEVICES),
            block_sizes=block_sizes,
            hop_format=hop_format,
        ).out

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(fwd, q, k, v)
        return vjp(out)  # any cotangent of the right shape

    return fwd, fwd_bwd


def inputs(S, dtype, sharding, *, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((B, S, N, H), (B, S, K, H), (B, S, K, H))
    return [
        jax.device_put(jnp.asarray(rng.standard_normal(s, np.float32), dtype), sharding)
        for s in shapes
    ]


def _ppermute_operand_bytes(jaxpr) -> list[int]:
    """Operand bytes of every ``ppermute`` in the program text (a loop body counted once)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            found.append(sum(x.aval.size * x.aval.dtype.itemsize for x in eqn.invars))
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(item, "jaxpr", item)
                if hasattr(sub, "eqns"):
                    found += _ppermute_operand_bytes(sub)
    return found


def measured_hop_bytes(fwd, args) -> int:
    """Bytes per forward hop, read from the traced program's ``ppermute`` operands."""
    sizes = set(_ppermute_operand_bytes(jax.make_jaxpr(fwd)(*args).jaxpr))
    if len(sizes) != 1:
        raise RuntimeError(f"bench_ring_quant: expected one hop size, found {sorted(sizes)}")
    return sizes.pop()


def check_hops(S: int, dtype=jnp.float32, block_sizes=None) -> dict:
    """Per format: ``(computed bytes, measured bytes, max abs output error vs exact)``.

    Runs the forward once per format (no timing); used by the benchmark and its test.
    """
    mesh = make_mesh()
    args = inputs(S, dtype, NamedSharding(mesh, P(None, "seq")))
    results, exact = {}, None
    for fmt in FORMATS:
        fwd, _ = make_fns(mesh, fmt, block_sizes)
        computed = hop_bytes(
            B, S // DEVICES, K, H, dtype, hop_format=fmt, layout=LAYOUT, block_sizes=block_sizes
        )
        out = np.asarray(jax.jit(fwd)(*args).astype(jnp.float32))
        exact = out if fmt is None else exact
        results[fmt] = (computed, measured_hop_bytes(fwd, args), float(np.max(np.abs(out - exact))))
    return results


def bench(seq_lens, dtype, repeats):
    mesh = make_mesh()
    sharding = NamedSharding(mesh, P(None, "seq"))
    rows = []
    for S in seq_lens:
        args = inputs(S, dtype, sharding)
        checks = check_hops(S, dtype)
        compiled = {}
        for fmt in FORMATS:
            fwd, fwd_bwd = make_fns(mesh, fmt)
            compiled[(fmt, "fwd")] = jax.jit(fwd).lower(*args).compile()
            compiled[(fmt, "fwd+bwd")] = jax.jit(fwd_bwd).lower(*args).compile()
        timing = _common.time_interleaved(
            {key: (lambda f=f, a=args: f(*a)) for key, f in compiled.items()}, repeats=repeats
        )
        base_bytes = checks[None][0]
        for fmt in FORMATS:
            computed, measured, err = checks[fmt]
            if computed != measured:
                raise RuntimeError(
                    f"bench_ring_quant: hop_bytes says {computed}, the program sends {measured}"
                )
            row = (
                S,
                "None" if fmt is None else fmt,
                computed,
                computed / base_bytes,
                timing[(fmt, "fwd")].best,
                timing[(fmt, "fwd+bwd")].best,
                timing[(fmt, "fwd")].best / timing[(None, "fwd")].best,
                timing[(fmt, "fwd+bwd")].best / timing[(None, "fwd+bwd")].best,
                err,
            )
            rows.append(row)
            print(_row(row), flush=True)
    return rows


def _row(row):
    S, fmt, hop, ratio, f, fb, f_ratio, fb_ratio, err = row
    return (
        f"| {S} | {fmt} | {hop / 2**10:.1f} | {ratio:.3f} | {f * 1e3:.0f} | {fb * 1e3:.0f} | "
        f"{f_ratio:.2f} | {fb_ratio:.2f} | {err:.2e} |"
    )


def bytes_lines(S):
    """Bytes per hop from ``hop_bytes`` for both input dtypes, forward and backward."""
    lines = [
        "",
        f"## Bytes per hop per device at S={S} (from `ringattn.hop_bytes`; K/V + int32 positions)",
        "",
        "| k/v dtype | hop_format | forward hop KiB | vs None | backward hop KiB | vs None |",
        "|---|---|---|---|---|---|",
    ]
    for dtype in ("float32", "bfloat16"):
        base = [hop_bytes(B, S // DEVICES, K, H, dtype, layout=LAYOUT, backward=b) for b in (0, 1)]
        for fmt in FORMATS:
            fwd, bwd = (
                hop_bytes(B, S // DEVICES, K, H, dtype, hop_format=fmt, layout=LAYOUT, backward=b)
                for b in (False, True)
            )
            lines.append(
                f"| {dtype} | {fmt} | {fwd / 2**10:.1f} | {fwd / base[0]:.3f} | "
                f"{bwd / 2**10:.1f} | {bwd / base[1]:.3f} |"
            )
    return lines


def main(argv=None):
    parser = _common.make_parser(__doc__)
    parser.add_argument("--seq-lens", type=str, default=None, help="e.g. 4096,8192,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)
    run = _common.start_run("bench_ring_quant", args, cpu_devices=DEVICES, argv=argv)
    if args.seq_lens:
        seq_lens = [int(x) for x in args.seq_lens.split(",")]
    else:
        seq_lens = [512] if args.quick else [4096, 8192, 16384]
    dtype = jnp.dtype(args.dtype)

    lines = [
        f"B={B}, N={N}, K={K}, H={H}, {args.dtype} inputs, ring over 8 emulated CPU devices "
        f"(`jax_num_cpu_devices=8`), layout {LAYOUT}, causal, default block sizes. "
        "int8 / fp8 hops carry per-token, per-kv-head absmax-quantized K/V plus one float32 "
        "scale per token and kv head; every block is dequantized to float32 before its "
        "compute. On CPU the devices share the host's cores and a hop is a memory copy, so "
        "smaller hops save little time here (no interconnect, no overlap); the times show the "
        "cost of quantizing and dequantizing, the bytes are what an interconnect would carry.",
        "",
        "## Bytes per forward hop, time and error",
        "",
        "hop KiB: bytes each device sends per forward hop (`ringattn.hop_bytes`, checked equal "
        "to the `ppermute` operands of the traced program); err: max abs difference of the "
        "output from the exact (`hop_format=None`) ring on the same inputs.",
        "",
        "| S | hop_format | hop KiB | vs None | fwd ms | fwd+bwd ms | fwd vs None "
        "| fwd+bwd vs None | err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    t0 = time.time()
    rows = bench(seq_lens, dtype, args.repeats)
    lines += [_row(r) for r in rows]
    extra = bytes_lines(max(seq_lens))
    print("\n".join(extra), flush=True)
    lines += [*extra, "", f"Total benchmark time: {time.time() - t0:.0f} s."]
    run.write("Quantized ring hops on 8 CPU devices", lines)


if __name__ == "__main__":
    main()
