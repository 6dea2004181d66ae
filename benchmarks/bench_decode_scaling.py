"""Decode step time against pool size and against sequence length, on the public API.

A jitted 30-layer decode step with SmolLM2-135M's cache shape (3 kv heads, head dim 64, pages
of 16 tokens, one sequence), written as a user writes it: ``paged.init_paged_cache``,
``paged.with_page_table``, then per layer ``paged.write_layer`` and ``paged.paged_attention``
over ``cache.k_pages[layer]``, ``paged.advance``; the cache donated to the step. The queries
are a fixed function of the step (no model), so the time is the cache's: the KV written and
read.

Two sweeps, each timed interleaved in one run (ratios are same-run; each layout's steps are
interleaved with each other, the two layouts one after the other):

1. **Pool size** at a fixed sequence (1,024 tokens): 80 to 10,240 pages. A step reads the
   same tokens whatever the pool holds, so its time should stay flat (goal: at most 1.25x from
   80 to 2,560 pages).
2. **Sequence length** at a fixed pool (2,560 pages): 256 to 16,384 tokens. The time should
   grow with the tokens read.

The same step over a **stacked** ``[L, K, P, C, H]`` pool (the 0.2 layout; one buffer for
all layers, written with a scatter and read after it) is timed beside the first sweep up to
2,560 pages, as the baseline: XLA copies a layer or the stack each layer there.

Writes ``benchmarks/results/decode_scaling.md`` and ``decode_scaling.png`` (with matplotlib).
"""

from benchmarks import _common

L, K, C, H, N = 30, 3, 16, 64, 9  # SmolLM2-135M: 30 layers, 9 query / 3 kv heads, head dim 64


def _step_per_layer(cache, q, kv):
    import paged

    for layer in range(L):
        cache = paged.write_layer(cache, layer, kv, kv, cache.lengths)
        k, v = cache.k_pages[layer], cache.v_pages[layer]
        out = paged.paged_attention(q, k, v, cache.page_table, cache.lengths + 1).out
        q = q + 1e-3 * out
    return paged.advance(cache, 1), q


def _step_stacked(state, q, kv):
    """The 0.2 layout: one ``[L, K, P, C, H]`` buffer per pool, written with a scatter and
    read back layer by layer (what ``PagedKVCache`` held before per-layer pools)."""
    import jax.numpy as jnp

    import paged

    k_all, v_all, table, lengths = state
    pos = lengths
    page = jnp.take_along_axis(table, (pos // C)[:, None], 1)[:, 0]
    for layer in range(L):
        k_all = k_all.at[layer, :, page, pos % C].set(kv[0][None])
        v_all = v_all.at[layer, :, page, pos % C].set(kv[0][None])
        out = paged.paged_attention(q, k_all[layer], v_all[layer], table, lengths + 1).out
        q = q + 1e-3 * out
    return (k_all, v_all, table, lengths + 1), q


def _cache(pages: int, tokens: int):
    import jax.numpy as jnp
    import numpy as np

    import paged

    M = -(-(tokens + 64) // C)  # room for the decode tokens
    if M + 1 > pages:
        raise ValueError(f"{tokens} tokens need {M + 1} pages, pool has {pages}")
    cache = paged.init_paged_cache(L, K, pages, C, H, 1, M)
    table = np.arange(pages - M, pages, dtype=np.int32)[None]  # the pool's last pages
    return paged.with_page_table(cache, table, np.asarray([tokens], np.int32)), jnp.asarray(table)


def _stacked_state(cache, table):
    import jax.numpy as jnp

    P = cache.k_pages.shape[2]
    # Buffers of its own (the steps donate their state): never the cache's lengths.
    lengths = jnp.array(cache.lengths, copy=True)
    return (jnp.zeros((L, K, P, C, H)), jnp.zeros((L, K, P, C, H)), table, lengths)


def check_layouts_agree(pages: int = 80, tokens: int = 64, steps: int = 2) -> float:
    """Runs ``steps`` decode steps with both layouts from the same empty cache and returns
    the largest difference of their outputs; raises if they differ (before any timing)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    cache, table = _cache(pages, tokens)
    state = _stacked_state(cache, table)
    q = jnp.full((1, 1, N, H), 0.1, jnp.float32)
    kv = jnp.asarray(np.random.default_rng(0).standard_normal((1, K, H)), jnp.float32)
    qa = qb = q
    per_layer, stacked = jax.jit(_step_per_layer), jax.jit(_step_stacked)
    for _ in range(steps):
        cache, qa = per_layer(cache, qa, kv)
        state, qb = stacked(state, qb, kv)
    diff = float(jnp.max(jnp.abs(qa - qb)))
    if not diff <= 1e-6:
        raise AssertionError(f"bench_decode_scaling: the layouts disagree by {diff}")
    return diff


def _time_steps(cases: dict, repeats: int):
    """``cases``: name -> (step, state, q, kv). Each step's state is donated and carried."""
    import jax

    carried = {}
    fns = {}
    for name, (step, state, q, kv) in cases.items():
        fn = jax.jit(step, donate_argnums=0)
        carried[name] = [state, q]

        def run(fn=fn, name=name, kv=kv):
            slot = carried[name]
            slot[0], slot[1] = fn(slot[0], slot[1], kv)
            return slot[1]

        fns[name] = run
    return _common.time_interleaved(fns, repeats=repeats, warmup=2)


def _temp_bytes(step, state, q, kv) -> int:
    import jax

    compiled = jax.jit(step, donate_argnums=0).lower(state, q, kv).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main(argv=None):
    parser = _common.make_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    run = _common.start_run("bench_decode_scaling", args, cpu_devices=1)
    import jax.numpy as jnp

    check_layouts_agree()  # both layouts compute the same step before anything is timed
    repeats = args.repeats or (3 if args.quick else 10)
    pools = [80, 320, 2560] if args.quick else [80, 320, 1280, 2560, 10240]
    stacked_up_to = 320 if args.quick else 2560
    seq = 1024
    q = jnp.full((1, 1, N, H), 0.1, jnp.float32)
    kv = jnp.full((1, K, H), 0.2, jnp.float32)

    cases, temps = {}, {}
    for P in pools:
        cache, table = _cache(P, seq)
        cases[("layers", P)] = (_step_per_layer, cache, q, kv)
        temps[("layers", P)] = _temp_bytes(_step_per_layer, cache, q, kv)
        if P <= stacked_up_to:
            stacked = _stacked_state(cache, table)
            cases[("stacked", P)] = (_step_stacked, stacked, q, kv)
            temps[("stacked", P)] = _temp_bytes(_step_stacked, stacked, q, kv)
    # Each layout timed interleaved with itself: a stacked step (seconds, gigabytes copied)
    # between two per-layer steps would evict their caches and slow them unevenly.
    timing = {}
    for layout in ("layers", "stacked"):
        mine = {key: case for key, case in cases.items() if key[0] == layout}
        timing.update(_time_steps(mine, repeats))
    base = {layout: timing[(layout, pools[0])].best for layout in ("layers", "stacked")}
    lines = [
        "## Step time against pool size",
        "",
        f"One sequence of {seq} tokens, {L} layers, K={K}, C={C}, H={H}; best (median) of "
        f"{repeats} interleaved steps; temp = the compiled step's temporary bytes "
        "(`compiled.memory_analysis()`); one layer's K pool is `K * P * C * H * 4` bytes.",
        "",
        "| pages | layer pool MiB | per-layer pools | vs 80 pages | temp MiB | stacked (0.2) "
        "| vs 80 pages | temp MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    series = {"layers": [], "stacked": []}
    for P in pools:
        row = [f"{P}", f"{K * P * C * H * 4 / _common.MiB:.1f}"]
        for layout in ("layers", "stacked"):
            t = timing.get((layout, P))
            if t is None:
                row += ["-", "-", "-"]
                continue
            series[layout].append((P, t.best))
            row += [
                f"{_common.ms(t.best)} ({_common.ms(t.median)})",
                f"{t.best / base[layout]:.2f}x",
                f"{temps[(layout, P)] / _common.MiB:.1f}",
            ]
        lines.append("| " + " | ".join(row) + " |")
    at_2560 = timing.get(("layers", 2560))
    if at_2560 is not None:
        ratio = at_2560.best / base["layers"]
        verdict = "met" if ratio <= 1.25 else "MISSED"
        lines += ["", f"Goal, at most 1.25x from 80 to 2,560 pages: {ratio:.2f}x ({verdict})."]

    # Sequence length at a fixed pool.
    P = 2560
    lengths = [256, 1024, 4096] if args.quick else [256, 1024, 4096, 16384]
    cases = {}
    for tokens in lengths:
        cache, _ = _cache(P, tokens)
        cases[tokens] = (_step_per_layer, cache, q, kv)
    timing = _time_steps(cases, repeats)
    lines += [
        "",
        "## Step time against sequence length",
        "",
        f"Pool of {P} pages; per-layer pools. KV read = keys and values of every layer.",
        "",
        "| tokens | step | vs 256 tokens | KV read per step MiB |",
        "|---:|---:|---:|---:|",
    ]
    first = timing[lengths[0]].best
    for tokens in lengths:
        t = timing[tokens]
        read = 2 * L * K * tokens * H * 4 / _common.MiB
        lines.append(
            f"| {tokens} | {_common.ms(t.best)} ({_common.ms(t.median)}) | "
            f"{t.best / first:.2f}x | {read:.1f} |"
        )
        series.setdefault("tokens", []).append((tokens, t.best))
    lines += ["", *_figure(run, series)]
    run.write("Decode step time against pool size and sequence length", lines)


def _figure(run, series) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(figure skipped: matplotlib is not installed)"]
    fig, (a, b) = plt.subplots(2, 1, figsize=(6.4, 7.2), constrained_layout=True)
    for layout, label in (("layers", "per-layer pools (0.3)"), ("stacked", "stacked pool (0.2)")):
        pts = series[layout]
        if pts:
            a.plot([p for p, _ in pts], [t * 1e3 for _, t in pts], "o-", label=label)
    a.set(xscale="log", yscale="log", xlabel="pages in the pool", ylabel="decode step (ms)")
    a.set_title("Same 1,024-token sequence, growing pool")
    a.legend()
    a.grid(alpha=0.3)
    pts = series["tokens"]
    b.plot([p for p, _ in pts], [t * 1e3 for _, t in pts], "o-", color="C0")
    b.set(xscale="log", yscale="log", xlabel="tokens in the sequence", ylabel="decode step (ms)")
    b.set_title("Fixed pool, growing sequence")
    b.grid(alpha=0.3)
    path = run.out.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [f"![decode step time]({path.name})"]


if __name__ == "__main__":
    main()
