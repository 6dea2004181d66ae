"""KV memory accounting of the paged allocator (pure numpy + ``paged.PageAllocator``, no JAX).

Three measurements, all on seeded synthetic workloads:

(b) waste: requests with long-tailed lengths (log-normal, median 4K, P99 128K, capped at
    max_model_len = 128K). Paged allocation at page size 4 / 16 / 64 vs contiguous
    preallocation of max_model_len per request: waste % and how many requests fit in a fixed
    KV budget (requests admitted in arrival order; one that does not fit is skipped).
(c) prefix reuse: 50% / 80% of requests start with the same 2K-token system prompt, the rest
    with 2K random tokens; then a random user part (same log-normal, capped at 8K so it runs
    fast). All requests stay resident. Pages saved by prefix caching vs none, and the token
    hit rate, at page 16 vs 64, for a page-aligned (2048) and an unaligned (2000) prompt.
(d) page-table bytes of one 1M-token request at page 4 / 16 / 64, next to its KV bytes.

Run from the repository root: ``python -m benchmarks.bench_paged_memory [--quick]``; writes
``benchmarks/results/paged_memory.md`` (``--quick``: ``benchmarks/results/quick/``).
"""

import math
import time

import numpy as np

from benchmarks import _common
from paged import OutOfPages, PageAllocator

MAX_MODEL_LEN = 128 * 1024
PAGE_SIZES = (4, 16, 64)
# Reference model for byte counts: 32 layers, 8 KV heads, head dim 128, bfloat16, K and V.
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def lognormal_lengths(rng, count, *, median=4096, p99=131072, cap=MAX_MODEL_LEN):
    sigma = math.log(p99 / median) / 2.3263478740408408  # z of the 99th percentile
    lengths = np.exp(math.log(median) + sigma * rng.standard_normal(count))
    return np.clip(np.round(lengths), 1, cap).astype(np.int64)


def waste_table(lengths, budget_tokens):
    rows = []
    total = int(lengths.sum())
    short = lengths < 2048
    for size in PAGE_SIZES:
        pages_needed = int(np.sum(-(-lengths // size)))
        alloc = PageAllocator(pages_needed + 1, size, max_pages_per_seq=MAX_MODEL_LEN // size)
        for i, length in enumerate(lengths):
            alloc.allocate(i, int(length))
        stats = alloc.stats()
        assert stats.tokens_stored == total
        short_slots = int(np.sum(-(-lengths[short] // size) * size))
        short_waste = 1 - lengths[short].sum() / short_slots if short_slots else 0.0
        # Fixed budget: a pool of budget_tokens / C pages, requests in arrival order.
        pool = PageAllocator(
            budget_tokens // size + 1, size, max_pages_per_seq=MAX_MODEL_LEN // size
        )
        fit = 0
        for i, length in enumerate(lengths):
            try:
                pool.allocate(i, int(length))
                fit += 1
            except OutOfPages:
                pass
        rows.append(
            (
                f"paged, C={size}",
                stats.waste,
                short_waste,
                fit,
                stats.page_table_bytes / len(lengths),
            )
        )
    contiguous_waste = 1 - total / (len(lengths) * MAX_MODEL_LEN)
    short_contiguous = (
        1 - lengths[short].sum() / (short.sum() * MAX_MODEL_LEN) if short.any() else 0
    )
    rows.append(
        (
            "contiguous, max_model_len",
            contiguous_waste,
            short_contiguous,
            min(budget_tokens // MAX_MODEL_LEN, len(lengths)),
            0.0,
        )
    )
    return rows


def make_prompts(seed, count, share, prefix_len, vocab=32000):
    # Same seed for both prompt lengths: rows differ only in the prompt length.
    rng = np.random.default_rng([seed, round(100 * share)])
    users = lognormal_lengths(rng, count, cap=8192)
    sharers = rng.random(count) < share
    system = rng.integers(0, vocab, prefix_len)
    prompts = []
    for user, shared in zip(users, sharers, strict=True):
        head = system if shared else rng.integers(0, vocab, prefix_len)
        prompts.append(np.concatenate([head, rng.integers(0, vocab, user)]))
    return prompts, int(sharers.sum())


def prefix_table(seed, count):
    rows = []
    for prefix_len in (2048, 2000):
        for share in (0.5, 0.8):
            prompts, sharers = make_prompts(seed, count, share, prefix_len)
            total = sum(len(p) for p in prompts)
            for size in (16, 64):
                without = sum(-(-len(p) // size) for p in prompts)
                longest = max(len(p) for p in prompts)
                alloc = PageAllocator(without + 1, size, max_pages_per_seq=-(-longest // size))
                for i, tokens in enumerate(prompts):
                    alloc.admit(i, tokens)
                    alloc.commit(i)  # the prefill wrote it: full pages become cached
                stats = alloc.stats()
                rows.append(
                    (
                        prefix_len,
                        share,
                        sharers,
                        size,
                        without,
                        stats.pages_used,
                        1 - stats.pages_used / without,
                        stats.prefix_hit_rate,
                        max(sharers - 1, 0) * prefix_len / total,
                    )
                )
    return rows


def page_table_rows(tokens=1 << 20):
    rows = []
    for size in PAGE_SIZES:
        pages = tokens // size
        alloc = PageAllocator(pages + 1, size, max_pages_per_seq=pages)
        alloc.allocate("long", tokens)
        table = alloc.stats().page_table_bytes
        rows.append((size, pages, table, table / (tokens * KV_BYTES_PER_TOKEN)))
    return rows


def render(args, lengths, waste_rows, prefix_rows, table_rows, budget, seconds):
    out = []
    pct = lambda x: f"{100 * x:.2f}%"
    out.append(
        f"Seed {args.seed}, {seconds:.1f} s. "
        "Pure host-side accounting with `paged.PageAllocator`; no device, no timing.\n"
    )
    q = np.percentile(lengths, [50, 90, 99])
    out.append(
        f"## (b) Waste: {len(lengths)} requests, log-normal lengths "
        f"(median {q[0]:.0f}, P90 {q[1]:.0f}, P99 {q[2]:.0f}, max {lengths.max()}, "
        f"mean {lengths.mean():.0f} tokens; {int((lengths < 2048).sum())} under 2K)\n"
    )
    out.append(
        f"Budget for the fit column: {budget:,} token slots "
        f"({budget * KV_BYTES_PER_TOKEN / 2**30:.0f} GiB at {KV_BYTES_PER_TOKEN // 1024} KiB/token: "
        "32 layers × 8 KV heads × H 128 × bf16 × K,V). Waste = (slots allocated − tokens) / "
        "slots allocated.\n"
    )
    out.append(
        "| scheme | waste | waste, requests < 2K | requests that fit (of "
        f"{len(lengths)}) | page-table bytes / request |"
    )
    out.append("|---|---:|---:|---:|---:|")
    for name, waste, short, fit, table in waste_rows:
        table_text = f"{table:,.0f}" if table else "n/a"
        out.append(f"| {name} | {pct(waste)} | {pct(short)} | {fit} | {table_text} |")
    out.append("")
    out.append(
        f"## (c) Prefix reuse: {args.prefix_requests} requests, "
        "shared system prompt + log-normal user part (capped at 8K), all resident\n"
    )
    out.append(
        "Ideal = (requests sharing − 1) × prompt length / all resident tokens: the most any "
        "prefix cache can save on this workload.\n"
    )
    out.append(
        "| system prompt | share | requests sharing | C | pages, no caching | pages, caching "
        "| pages saved | ideal | token hit rate |"
    )
    out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for prefix_len, share, sharers, size, without, used, saved, hit, ideal in prefix_rows:
        out.append(
            f"| {prefix_len} | {share:.0%} | {sharers} | {size} | {without:,} | {used:,} | "
            f"{pct(saved)} | {pct(ideal)} | {pct(hit)} |"
        )
    out.append("")
    out.append("## (d) Page-table bytes for one 1M-token request\n")
    out.append("| C | pages | page-table bytes | share of the request's KV bytes |")
    out.append("|---:|---:|---:|---:|")
    for size, pages, table, ratio in table_rows:
        out.append(f"| {size} | {pages:,} | {table:,} ({table / 2**20:.2f} MiB) | {ratio:.1e} |")
    out.append("")
    out.append(advice(waste_rows, prefix_rows, table_rows))
    return "\n".join(out) + "\n"


def advice(waste_rows, prefix_rows, table_rows):
    waste = {name: (w, s) for name, w, s, _, _ in waste_rows}
    w4, s4 = waste["paged, C=4"]
    w16, s16 = waste["paged, C=16"]
    w64, s64 = waste["paged, C=64"]
    contiguous, _ = waste["contiguous, max_model_len"]
    saved = {(p, s, c): v for p, s, _, c, _, _, v, _, _ in prefix_rows}
    hits = {(p, s, c): h for p, s, _, c, _, _, _, h, _ in prefix_rows}
    ideal = {(p, s): i for p, s, _, _, _, _, _, _, i in prefix_rows}
    target16 = "meets" if w16 <= 0.04 else "misses"
    target_c = "meets" if contiguous >= 0.60 else "misses"
    best64 = max(saved[(2048, 0.5, 64)], saved[(2048, 0.8, 64)])
    claim = "inside" if 0.30 <= best64 <= 0.40 else ("above" if best64 > 0.40 else "below")
    return (
        "## What this says about the usual advice\n\n"
        f"Targets: paged waste at C=16 is {w16:.2%} ({target16} the ≤ 4% target) and "
        f"contiguous max-length preallocation wastes {contiguous:.1%} ({target_c} the ≥ 60% "
        "target). "
        f"*Page 4 under 2K tokens*: on requests under 2K tokens the waste is {s4:.2%} at C=4, "
        f"{s16:.2%} at C=16 and {s64:.2%} at C=64; over the whole long-tailed mix it is "
        f"{w4:.3%} / {w16:.3%} / {w64:.3%}. Internal fragmentation is at most one page per "
        "request, so small pages matter only when requests are short; with a median of 4K "
        f"even C=64 wastes only {w64:.2%}, and C=4 buys that back at the price of a page "
        f"table 4× larger than C=16 ({table_rows[0][2] / 2**20:.1f} MiB vs "
        f"{table_rows[1][2] / 2**20:.2f} MiB at 1M tokens, both negligible next to the KV) and, "
        "on a device, 4× more gathers per token. "
        "*16 by default*: holds up here: waste near zero and a modest table. "
        f"*64 with heavy prefix reuse*: with a page-aligned 2K system prompt, caching saves "
        f"{saved[(2048, 0.5, 16)]:.1%} / {saved[(2048, 0.8, 16)]:.1%} of pages at C=16 and "
        f"{saved[(2048, 0.5, 64)]:.1%} / {saved[(2048, 0.8, 64)]:.1%} at C=64 (50% / 80% "
        f"sharing; token hit rates {hits[(2048, 0.5, 64)]:.1%} / {hits[(2048, 0.8, 64)]:.1%}), "
        f"so what we measure at C=64 (best {best64:.1%}) is {claim} the claimed 30–40%. "
        "The saving is set by the shared fraction of all resident tokens (ideal "
        f"{ideal[(2048, 0.5)]:.1%} / {ideal[(2048, 0.8)]:.1%} here: the 2K prompt is small "
        "next to long-tailed user parts), not by the page size; a 30–40% saving needs the "
        "shared prefix to be that share of the resident tokens. A larger page never raises the hit rate; with an unaligned 2000-token prompt "
        f"C=64 loses the prompt's last partial page ({saved[(2000, 0.8, 64)]:.1%} vs "
        f"{saved[(2000, 0.8, 16)]:.1%} at C=16, 80% sharing). So the case for C=64 under heavy "
        "reuse has to rest on kernel efficiency (fewer, larger gathers), which this "
        "benchmark does not measure, not on memory."
    )


def main(argv=None):
    parser = _common.make_parser(__doc__)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run = _common.start_run("bench_paged_memory", args, cpu_devices=None, argv=argv)
    start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    requests = 200 if args.quick else 1000
    args.prefix_requests = 200 if args.quick else 1000
    lengths = lognormal_lengths(rng, requests)
    budget = 2 * 1024 * 1024 if not args.quick else 512 * 1024
    waste_rows = waste_table(lengths, budget)
    prefix_rows = prefix_table(args.seed, args.prefix_requests)
    table_rows = page_table_rows()
    text = render(
        args, lengths, waste_rows, prefix_rows, table_rows, budget, time.perf_counter() - start
    )
    run.write("Paged KV memory: waste, prefix reuse, page-table size", text.splitlines())


if __name__ == "__main__":
    main()
