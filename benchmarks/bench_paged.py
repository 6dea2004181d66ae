"""Paged decode speed: paged_attention vs contiguous decode vs JAX's reference vs memcpy.

One decode step (one query token per sequence), B = 8 sequences of 32K tokens, N = 32 query
heads, K = 8 kv heads, H = 128, page size 16, float32 (2 GiB of KV):

* ``paged``: :func:`paged.paged_attention` over a randomly permuted page table, with
  ``pages_per_block`` tuned first (the best of a sweep measured in the same run; the
  library default ``DEFAULT_PAGES_PER_BLOCK`` came from this sweep);
* ``contiguous``: the same data in its fastest CPU layout, heads-major ``[B, K, S, H]``,
  decoded with a plain jitted einsum / softmax / einsum;
* ``jax ref``: ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``'s
  ``ref_ragged_paged_attention`` (token-major ``[P, C, 2K, H]`` pages; jitted with its
  metadata closed over as constants) at a smaller size, compared with ``paged`` at that size;
* ``gathers only``: the page walk with its attention math removed: the same per-sequence loop
  over blocks of ``pages_per_block`` pages (the tuned value) that only gathers each block's
  keys and values and sums them. It is the floor of any XLA page walk of this shape on this
  backend (the gathers already run on both cores: process CPU time / wall time 1.8-1.9);
* ``bandwidth limit``: KV bytes / the rate of a same-run ``np.copyto`` of a large array into a
  preallocated buffer.

Targets: paged <= 1.15x contiguous and <= 2x the bandwidth limit.

Run from the repository root: ``python -m benchmarks.bench_paged [--quick]``; writes
``benchmarks/results/paged.md`` (``--quick``: ``benchmarks/results/quick/paged.md``).
"""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _common
from paged import paged_attention

GiB = _common.GiB


def interleaved(fns, reps):
    """Best wall time of each zero-argument ``fns[name]()`` (interleaved rounds, warm-up)."""
    return {name: t.best for name, t in _common.time_interleaved(fns, repeats=reps).items()}


def make_data(B, S, N, K, H, C, seed=0):
    """Contiguous heads-major KV, and the same data in a paged pool with permuted pages."""
    rng = np.random.default_rng(seed)
    M = S // C
    P = B * M + 1
    k = rng.random((B, K, S, H), dtype=np.float32) - 0.5
    v = rng.random((B, K, S, H), dtype=np.float32) - 0.5
    q = rng.random((B, 1, N, H), dtype=np.float32) - 0.5
    table = (rng.permutation(B * M) + 1).astype(np.int32).reshape(B, M)
    k_pages = np.zeros((K, P, C, H), np.float32)
    v_pages = np.zeros((K, P, C, H), np.float32)
    for b in range(B):
        k_pages[:, table[b]] = k[b].reshape(K, M, C, H)
        v_pages[:, table[b]] = v[b].reshape(K, M, C, H)
    lengths = np.full((B,), S, np.int32)
    return q, k, v, k_pages, v_pages, table, lengths


@jax.jit
def contiguous_decode(q, k, v):
    """Dense decode on heads-major KV: q ``[B, 1, N, H]``, k, v ``[B, K, S, H]``."""
    B, _, N, H = q.shape
    K = k.shape[1]
    qg = q.reshape(B, K, N // K, H)
    s = jnp.einsum("bkgh,bksh->bkgs", qg, k, preferred_element_type=jnp.float32) / np.sqrt(H)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bkgs,bksh->bkgh", p.astype(v.dtype), v)
    return out.reshape(B, 1, N, H)


def make_memcpy(nbytes):
    """A zero-argument copy of ``nbytes`` between preallocated numpy buffers."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def gathers_only(k_pages, v_pages, table, pages_per_block):
    """A zero-argument walk over ``table``'s pages that gathers each block of keys and values
    and sums it, with no attention math (the gather floor of :func:`paged.paged_attention`)."""
    B, M = table.shape
    blocks = -(-M // pages_per_block)
    table = jnp.pad(table, ((0, 0), (0, blocks * pages_per_block - M)))  # page 0 holds zeros

    @jax.jit
    def walk(k_pages, v_pages, table):
        def step(i, total):
            row = jnp.take(table, i // blocks, axis=0)
            ids = jax.lax.dynamic_slice_in_dim(row, (i % blocks) * pages_per_block, pages_per_block)
            kb = jnp.take(k_pages, ids, axis=1)
            vb = jnp.take(v_pages, ids, axis=1)
            return total + jnp.sum(kb) + jnp.sum(vb)

        return jax.lax.fori_loop(0, B * blocks, step, jnp.float32(0))

    return lambda: walk(k_pages, v_pages, table)


def bench_main(B, S, N, K, H, C, reps, sweep):
    q, k, v, k_pages, v_pages, table, lengths = make_data(B, S, N, K, H, C)
    kv_bytes = k.nbytes + v.nbytes
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)
    table, lengths = jnp.asarray(table), jnp.asarray(lengths)
    paged_args = (q, k_pages, v_pages, table, lengths)

    def paged_fn(ppb):
        fn = jax.jit(lambda *a: paged_attention(*a, pages_per_block=ppb).out)
        return lambda: fn(*paged_args)

    tuning = interleaved({ppb: paged_fn(ppb) for ppb in sweep}, max(2, reps // 2))
    best = min(tuning, key=tuning.get)
    paged, gathers = paged_fn(best), gathers_only(k_pages, v_pages, table, best)
    copy_bytes = min(kv_bytes, GiB)
    result = interleaved(
        {
            "contiguous": lambda: contiguous_decode(q, k, v),
            "paged": paged,
            "gathers": gathers,
            "memcpy": make_memcpy(copy_bytes),
        },
        reps,
    )
    err = float(jnp.max(jnp.abs(paged() - contiguous_decode(q, k, v))))
    rate = copy_bytes / result["memcpy"]
    gathered = float(gathers())
    if not np.isclose(gathered, float(k.sum() + v.sum()), rtol=1e-3):
        raise AssertionError(f"gathers-only walk summed {gathered}, the KV sums to another value")
    return dict(
        gathers=result["gathers"],
        contiguous=result["contiguous"],
        paged=result["paged"],
        best=best,
        tuning=tuning,
        limit=kv_bytes / rate,
        rate=rate,
        err=err,
        kv_bytes=kv_bytes,
    )


def bench_reference(B, S, N, K, H, C, reps):
    try:
        from jax.experimental.pallas.ops.tpu import ragged_paged_attention as kernel
    except ImportError as e:  # pragma: no cover - depends on the JAX version
        return f"not importable: {e}"
    q, _, _, k_pages, v_pages, table, lengths = make_data(B, S, N, K, H, C, seed=1)
    P = k_pages.shape[1]
    kv = np.stack([k_pages, v_pages], axis=3).transpose(1, 2, 0, 3, 4).reshape(P, C, 2 * K, H)
    meta = (lengths, table, np.arange(B + 1, dtype=np.int32), np.array([B], np.int32))
    scale = 1 / np.sqrt(H)
    ref = jax.jit(lambda q, kv: kernel.ref_ragged_paged_attention(q, kv, *meta, sm_scale=scale))
    flat_q = jnp.asarray(q[:, 0])
    kv = jnp.asarray(kv)
    args = [jnp.asarray(x) for x in (q, k_pages, v_pages, table, lengths)]
    fn = jax.jit(lambda *a: paged_attention(*a).out)
    times = interleaved({"ref": lambda: ref(flat_q, kv), "paged": lambda: fn(*args)}, reps)
    t_ref, t_paged = times["ref"], times["paged"]
    err = float(jnp.max(jnp.abs(fn(*args)[:, 0] - ref(flat_q, kv))))
    return dict(ref=t_ref, paged=t_paged, err=err)


def main(argv=None):
    args = _common.make_parser(__doc__).parse_args(argv)
    run = _common.start_run("bench_paged", args, cpu_devices=1, argv=argv)
    N, K, H, C = 32, 8, 128, 16
    if args.quick:
        B, S, reps, sweep = 4, 8192, 5, (16, 32, 64)
        ref_size = (2, 2048)
    else:
        B, S, reps, sweep = 8, 32768, 9, (8, 16, 32, 64)
        ref_size = (4, 4096)
    r = bench_main(B, S, N, K, H, C, reps, sweep)
    ref = bench_reference(*ref_size, N, K, H, C, reps)
    ms = _common.ms
    lines = [
        f"One decode step: B={B} sequences x S={S} tokens, N={N}, K={K}, H={H}, page size "
        f"{C}, float32, {r['kv_bytes'] / GiB:.2f} GiB of KV. "
        f"Best of {reps} runs after a warm-up (shared machine: the "
        "best run is the least disturbed one).",
        "",
        "| method | time | vs contiguous | vs bandwidth limit |",
        "|---|---|---|---|",
        f"| contiguous heads-major einsum | {ms(r['contiguous'])} | 1.00x | "
        f"{r['contiguous'] / r['limit']:.2f}x |",
        f"| paged_attention (pages_per_block={r['best']}) | {ms(r['paged'])} | "
        f"{r['paged'] / r['contiguous']:.2f}x | {r['paged'] / r['limit']:.2f}x |",
        f"| the walk's gathers only, no attention math (pages_per_block={r['best']}) | "
        f"{ms(r['gathers'])} | {r['gathers'] / r['contiguous']:.2f}x | "
        f"{r['gathers'] / r['limit']:.2f}x |",
        f"| bandwidth limit (KV bytes / memcpy {r['rate'] / GiB:.1f} GiB/s) | {ms(r['limit'])} "
        f"| {r['limit'] / r['contiguous']:.2f}x | 1.00x |",
        "",
        f"paged vs contiguous max abs difference: {r['err']:.2e}. Targets: paged <= 1.15x "
        f"contiguous ({'met' if r['paged'] <= 1.15 * r['contiguous'] else 'MISSED'}), <= 2x "
        f"the bandwidth limit ({'met' if r['paged'] <= 2 * r['limit'] else 'MISSED'}).",
        "",
        "pages_per_block sweep (paged time): "
        + ", ".join(f"{p}: {ms(t)}" for p, t in r["tuning"].items()),
        "",
    ]
    if isinstance(ref, str):
        lines.append(f"JAX ref_ragged_paged_attention: {ref}")
    else:
        lines += [
            f"## vs JAX's ref_ragged_paged_attention (smaller: B={ref_size[0]}, "
            f"S={ref_size[1]}; token-major pages)",
            "",
            "| method | time | vs paged_attention |",
            "|---|---|---|",
            f"| paged_attention | {ms(ref['paged'])} | 1.00x |",
            f"| ref_ragged_paged_attention (jitted) | {ms(ref['ref'])} | "
            f"{ref['ref'] / ref['paged']:.2f}x |",
            "",
            f"max abs difference: {ref['err']:.2e}",
        ]
    run.write("Paged decode", lines)


if __name__ == "__main__":
    main()
