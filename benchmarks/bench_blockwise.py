"""Blockwise attention on one CPU device against XLA's dot_product_attention and the reference.

Measures, in one run (ratios are what matter on a shared, noisy machine):
  * forward and forward+backward time of ``ringattn.blockwise_attention``,
    ``jax.nn.dot_product_attention(implementation="xla")`` and ``ringattn.attention_reference``
    (the last two only where their compiled temporaries fit in memory);
  * compiled temporary memory from ``jax.jit(f).lower(...).compile().memory_analysis()``;
  * this machine's float32 matmul FLOP/s, so each result is also an efficiency:
    useful attention FLOPs per second / matmul FLOPs per second.

Usage (from the repository root):
  python -m benchmarks.bench_blockwise            # T = S in 2K..32K (about 15 minutes)
  python -m benchmarks.bench_blockwise --quick    # 1K and 2K only (about a minute)
"""

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks import _common
from ringattn import BlockSizes, attention_reference, blockwise_attention

GiB = _common.GiB
FITS_BYTES = 6 * GiB  # run a path only if its compiled temporaries stay under this


def best_time(fn, *args, repeats):
    return _common.time_call(fn, *args, repeats=repeats).best


def matmul_call(n=4096):
    """``(call, flops)``: a jitted ``n x n`` float32 matmul on fixed inputs, and its FLOPs."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(jnp.dot)
    return (lambda: f(a, b)), 2 * n**3


def matmul_flops_per_s(repeats, n=4096):
    call, flops = matmul_call(n)
    return flops / best_time(call, repeats=repeats)


def temp_bytes(fn, *shapes):
    return fn.lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def attention_flops(T, S, N, H, causal, backward):
    pairs = T * (T + 1) / 2 if causal and T == S else T * S
    fwd = 4 * N * H * pairs  # QK^T and PV
    return fwd * (3.5 if backward else 1.0)  # backward: 5 matmuls (one recompute) vs 2


def block_matmuls(block_q: int, block_kv: int):
    """``(forward, backward)``, jitted: the blockwise kernels' block products and nothing else.

    The same loops, block-major layouts and batched matmul shapes as the kernels, with the
    softmax, masking and bookkeeping removed, so their FLOP rate is what this machine gives
    these block products: the ceiling of the kernels' efficiency. For ``q, k, v, dout
    [B, L, N, H]`` (one kv head per query head; ``L`` a multiple of both blocks) they compute
    ``forward(q, k, v) = (q k^T) v`` per head, two products per block pair visited query block
    by query block, and ``backward(q, k, v, dout) = (dq, dk, dv)``, its exact VJP, five
    products per block pair (``s^T = k q^T``, ``dv += s^T do``, ``dp^T = v do^T``,
    ``dk += dp^T q``, ``dq^T += k^T dp^T``) visited key block by key block.
    """

    def rows(x, b):  # [B, L, N, H] -> [L // b, B, N, b, H]
        B, L, N, H = x.shape
        return x.reshape(B, L // b, b, N, H).transpose(1, 0, 3, 2, 4)

    def cols(x, b):  # [B, L, N, H] -> [L // b, B, N, H, b]
        B, L, N, H = x.shape
        return x.reshape(B, L // b, b, N, H).transpose(1, 0, 3, 4, 2)

    def forward(q, k, v):
        q_rows, k_cols, v_rows = rows(q, block_q), cols(k, block_kv), rows(v, block_kv)
        nk = k_cols.shape[0]

        def q_block(i, out):
            def kv_block(j, acc):
                return acc + (q_rows[i] @ k_cols[j]) @ v_rows[j]

            acc = lax.fori_loop(0, nk, kv_block, jnp.zeros(q_rows.shape[1:], jnp.float32))
            return lax.dynamic_update_index_in_dim(out, acc, i, 0)

        out = lax.fori_loop(0, q_rows.shape[0], q_block, jnp.zeros(q_rows.shape, jnp.float32))
        return out.transpose(1, 0, 3, 2, 4).reshape(q.shape)

    def backward(q, k, v, dout):
        q_rows, q_cols = rows(q, block_q), cols(q, block_q)
        do_rows, do_cols = rows(dout, block_q), cols(dout, block_q)
        k_rows, k_cols, v_rows = rows(k, block_kv), cols(k, block_kv), rows(v, block_kv)
        nq = q_rows.shape[0]

        def kv_block(j, carry):
            dq_t, dk_all, dv_all = carry

            def q_block(i, c):
                dq_t, dk, dv = c
                s_t = k_rows[j] @ q_cols[i]  # [B, N, bk, bq]
                dv = dv + s_t @ do_rows[i]
                dp_t = v_rows[j] @ do_cols[i]
                dk = dk + dp_t @ q_rows[i]
                dq_t = lax.dynamic_update_index_in_dim(dq_t, dq_t[i] + k_cols[j] @ dp_t, i, 0)
                return dq_t, dk, dv

            zeros = jnp.zeros(k_rows.shape[1:], jnp.float32)
            dq_t, dk, dv = lax.fori_loop(0, nq, q_block, (dq_t, zeros, zeros))
            dk_all = lax.dynamic_update_index_in_dim(dk_all, dk, j, 0)
            dv_all = lax.dynamic_update_index_in_dim(dv_all, dv, j, 0)
            return dq_t, dk_all, dv_all

        init = (jnp.zeros(q_cols.shape, jnp.float32), *2 * [jnp.zeros(k_rows.shape, jnp.float32)])
        dq_t, dk, dv = lax.fori_loop(0, k_rows.shape[0], kv_block, init)
        dq = dq_t.transpose(1, 0, 4, 2, 3).reshape(q.shape)
        kv_back = lambda x: x.transpose(1, 0, 3, 2, 4).reshape(k.shape)
        return dq, kv_back(dk), kv_back(dv)

    return jax.jit(forward), jax.jit(backward)


def make_paths(blocks):
    """name -> ``causal -> attend(q, k, v) -> out``: the three timed attention paths."""
    return {
        "blockwise": lambda causal: (
            lambda q, k, v: blockwise_attention(q, k, v, causal=causal, block_sizes=blocks).out
        ),
        "xla": lambda causal: (
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="xla"
            )
        ),
        "reference": lambda causal: lambda q, k, v: attention_reference(q, k, v, causal=causal).out,
    }


def jit_fwd_and_fwd_bwd(attend):
    """``(forward, forward+backward)``, jitted: ``attend(q, k, v)``, and the value and gradient
    (q, k, v) of ``sum(attend(q, k, v) ** 2)``."""

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v) ** 2)

    return jax.jit(attend), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def main(argv=None):
    parser = _common.make_parser(__doc__)
    parser.add_argument("--lengths", type=int, nargs="*")
    args = parser.parse_args(argv)
    run = _common.start_run("bench_blockwise", args, cpu_devices=1, argv=argv)
    lengths = args.lengths or ([1024, 2048] if args.quick else [2048, 4096, 8192, 16384, 32768])
    B, N, K, H = 1, 8, 8, 64
    blocks = BlockSizes()
    mm = matmul_flops_per_s(repeats=2 if args.quick else 5, n=2048 if args.quick else 4096)

    paths = make_paths(blocks)
    rows = []
    for L in lengths:
        shape = jax.ShapeDtypeStruct((B, L, N, H), jnp.float32)
        q, k, v = (jax.random.normal(jax.random.key(i), (B, L, N, H)) for i in range(3))
        repeats = 1 if args.quick or L > 8192 else 3
        for causal in (False, True):
            results = {}
            for name, make in paths.items():
                fwd, fwd_bwd = jit_fwd_and_fwd_bwd(make(causal))
                mem_f = temp_bytes(fwd, shape, shape, shape)
                mem_b = temp_bytes(fwd_bwd, shape, shape, shape)
                res = {"mem_fwd": mem_f, "mem_bwd": mem_b, "t_fwd": None, "t_bwd": None}
                if mem_f < FITS_BYTES:
                    res["t_fwd"] = best_time(fwd, q, k, v, repeats=repeats)
                if mem_b < FITS_BYTES:
                    res["t_bwd"] = best_time(fwd_bwd, q, k, v, repeats=repeats)
                results[name] = res
                print(f"L={L} causal={causal} {name}: {res}", flush=True)
            rows.append((L, causal, results))

    lines = [
        f"Matmul ({2048 if args.quick else 4096}^3 float32, same run): {mm / 1e9:.1f} GFLOP/s. "
        f"B={B}, N={N}, K={K}, H={H}, float32, one CPU device, "
        f"blocks {blocks.block_q}x{blocks.block_kv}. Efficiency = useful attention FLOP/s / "
        "matmul FLOP/s. '-' = not run: compiled temporaries over "
        f"{FITS_BYTES // GiB} GiB.",
        "",
        "| T=S | mask | blockwise fwd | fwd vs xla | fwd eff. | blockwise fwd+bwd | "
        "fwd+bwd vs xla | fwd+bwd eff. | reference fwd | temp MiB blockwise fwd / fwd+bwd | "
        "temp MiB xla fwd / fwd+bwd |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ms(t):
        return "-" if t is None else f"{t * 1e3:.0f} ms"

    def ratio(a, b):
        return "-" if a is None or b is None else f"{a / b:.2f}x"

    def eff(t, L, causal, backward):
        return "-" if t is None else f"{attention_flops(L, L, N, H, causal, backward) / t / mm:.0%}"

    for L, causal, r in rows:
        bw, xla, ref = r["blockwise"], r["xla"], r["reference"]
        lines.append(
            f"| {L // 1024}K | {'causal' if causal else 'full'} | {ms(bw['t_fwd'])} | "
            f"{ratio(bw['t_fwd'], xla['t_fwd'])} | {eff(bw['t_fwd'], L, causal, False)} | "
            f"{ms(bw['t_bwd'])} | {ratio(bw['t_bwd'], xla['t_bwd'])} | "
            f"{eff(bw['t_bwd'], L, causal, True)} | {ms(ref['t_fwd'])} | "
            f"{bw['mem_fwd'] / 2**20:.0f} / {bw['mem_bwd'] / 2**20:.0f} | "
            f"{xla['mem_fwd'] / 2**20:.0f} / {xla['mem_bwd'] / 2**20:.0f} |"
        )
    # Causal vs full, same run.
    lines += [
        "",
        "| T=S | causal / full, blockwise fwd | causal / full, blockwise fwd+bwd |",
        "|---|---|---|",
    ]
    by_len = {}
    for L, causal, r in rows:
        by_len.setdefault(L, {})[causal] = r["blockwise"]
    for L, d in by_len.items():
        lines.append(
            f"| {L // 1024}K | {ratio(d[True]['t_fwd'], d[False]['t_fwd'])} | "
            f"{ratio(d[True]['t_bwd'], d[False]['t_bwd'])} |"
        )
    run.write("Blockwise attention on one CPU device", lines)


if __name__ == "__main__":
    main()
