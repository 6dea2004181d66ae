"""Attention mass kept and output error vs device budget, per retention policy.

For each synthetic attention pattern (seeded real ``q``/``k``/``v``, decode with one query at the
end of ``S`` tokens in pages of ``C``), each policy sees the attention of the ``W`` queries that
precede the evaluated one (H2O accumulates all ``W``, SnapKV pools them as its observation
window, TOVA uses the last one, Scissorhands counts in how many of the ``W`` steps each page's
mass reached the mean), keeps a budget of pages on the device, and the evaluated query
attends over the kept pages only (``offload.mixed_residency_attention`` without the cold part).
Against full attention over every page (the same call with the demoted pages fetched) we report

* mass kept: ``exp(lse_kept - lse_full)`` averaged over sequences and heads, in percent;
* output error: ``||out_kept - out_full|| / ||out_full||`` averaged over sequences and heads.

``oracle`` keeps the pages with the most mass of the evaluated query itself (an upper bound no
causal policy can beat). Patterns: ``concentrated`` (4 attention-sink tokens, 8 heavy-hitter
tokens per kv head, a rising recency ramp over the last 64 tokens, weak background), ``mild``
(the same structure with 60% of the signal), ``drifting`` (sinks and recency, but 16
heavy hitters per kv head with their own directions, each query attending a random 4 of them)
and ``uniform`` (plain Gaussian ``q``/``k``: the
control with no structure to exploit).

Run from the repository root: ``python -m benchmarks.bench_policies [--quick]`` (about 30 s
on a 2-core CPU; ``--quick`` halves the shapes); writes ``benchmarks/results/policies.md``
(``--quick``: ``benchmarks/results/quick/policies.md``).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _common
from offload import (
    RetentionPolicy,
    init_policy_state,
    mixed_residency_attention,
    select_keep,
    split_residency,
    token_attention_mass,
    update_policy_state,
)

BUDGETS = (0.05, 0.10, 0.20, 0.30, 0.50)


def make_pattern(name, *, seed, B, S, K, G, H, W):
    """``q [B, W + 1, N, H]`` for positions ``S - W - 1 .. S - 1`` and ``k, v [B, S, K, H]``."""
    rng = np.random.default_rng(seed)
    N = K * G
    v = rng.standard_normal((B, S, K, H)).astype(np.float32)
    if name == "uniform":
        q = rng.standard_normal((B, W + 1, N, H)).astype(np.float32)
        k = rng.standard_normal((B, S, K, H)).astype(np.float32)
        return q, k, v
    if name == "drifting":
        return _drifting(rng, B=B, S=S, K=K, G=G, H=H, W=W, v=v)
    strength = {"concentrated": 1.0, "mild": 0.6}[name]
    u = rng.standard_normal((K, H))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)  # one attention direction per kv head
    a = np.zeros((B, S, K))  # how strongly each key carries that direction
    a[:, :4] = 3.0  # attention sinks
    for b in range(B):
        for h in range(K):
            heavy = rng.choice(np.arange(4, S - 128), size=8, replace=False)
            a[b, heavy, h] = 2.5  # heavy hitters, different per kv head
    a[:, S - 64 :] = np.linspace(0.0, 2.0, 64)[None, :, None]  # recency ramp
    beta = 27.0 * strength  # logits ~ beta * a / sqrt(H): about 10 for sinks at full strength
    k = 0.3 * rng.standard_normal((B, S, K, H)) + a[..., None] * u[None, None]
    q = rng.standard_normal((B, W + 1, N, H)) + beta * np.repeat(u, G, axis=0)[None, None]
    return q.astype(np.float32), k.astype(np.float32), v


def _drifting(rng, *, B, S, K, G, H, W, v):
    """Sinks and recency as in ``concentrated``, but 16 heavy hitters per kv head, each with
    its own direction, and every query attends to a random 4 of them: the heavy set drifts."""
    N = K * G
    beta = 27.0
    u = rng.standard_normal((K, H))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    a = np.zeros((B, S, K))
    a[:, :4] = 3.0
    a[:, S - 64 :] = np.linspace(0.0, 2.0, 64)[None, :, None]
    k = 0.3 * rng.standard_normal((B, S, K, H)) + a[..., None] * u[None, None]
    q = rng.standard_normal((B, W + 1, N, H)) + beta * np.repeat(u, G, axis=0)[None, None]
    for b in range(B):
        for h in range(K):
            heavy = rng.choice(np.arange(4, S - 128), size=16, replace=False)
            d = rng.standard_normal((16, H))
            d /= np.linalg.norm(d, axis=-1, keepdims=True)
            k[b, heavy, h] += 2.5 * d
            for t in range(W + 1):
                chosen = rng.choice(16, size=4, replace=False)
                q[b, t, h * G : (h + 1) * G] += beta * d[chosen].sum(0)
    return q.astype(np.float32), k.astype(np.float32), v


def to_pages(k, v, C):
    """Scatters contiguous ``[B, S, K, H]`` KV into pools under shuffled page ids."""
    B, S, K, H = k.shape
    M = S // C
    rng = np.random.default_rng(123)
    table = rng.permutation(np.arange(1, B * M + 1)).reshape(B, M).astype(np.int32)
    pool_k = np.zeros((K, B * M + 1, C, H), np.float32)
    pool_v = np.zeros_like(pool_k)
    pool_k[:, table.ravel()] = k.reshape(B * M, C, K, H).transpose(2, 0, 1, 3)
    pool_v[:, table.ravel()] = v.reshape(B * M, C, K, H).transpose(2, 0, 1, 3)
    return jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(table)


def make_policies(budget, C, obs_window):
    recent_pages = max(1, obs_window // C)
    return {
        "recency": RetentionPolicy("recency", budget, page_size=C),
        "streaming": RetentionPolicy("streaming", budget, page_size=C, sink=1),
        "h2o": RetentionPolicy("h2o", budget, page_size=C, sink=1, recent=recent_pages),
        "snapkv": RetentionPolicy(
            "snapkv", budget, page_size=C, recent=recent_pages, head_reduce="max"
        ),
        "tova": RetentionPolicy("tova", budget, page_size=C),
        "scissorhands": RetentionPolicy(
            "scissorhands", budget, page_size=C, sink=1, recent=recent_pages
        ),
        "oracle": RetentionPolicy("tova", budget, page_size=C),
    }


@jax.jit
def _full(q, pool_k, pool_v, table, lengths):
    empty = jnp.zeros_like(table)
    return mixed_residency_attention(q, pool_k, pool_v, empty, lengths, cold_table=table)


@jax.jit
def _kept(q, pool_k, pool_v, device_table, lengths):
    return mixed_residency_attention(q, pool_k, pool_v, device_table, lengths)


def run_pattern(name, *, B, S, K, G, H, C, W, seed):
    q_all, k, v = make_pattern(name, seed=seed, B=B, S=S, K=K, G=G, H=H, W=W)
    N, M = K * G, S // C
    lengths = jnp.full((B,), S, jnp.int32)
    q_hist = jnp.asarray(q_all[:, :W])
    q_eval = jnp.asarray(q_all[:, W:])
    k_j = jnp.asarray(k)
    # Page mass of the history queries (positions S-W-1 .. S-2) and of the evaluated one.
    hist_pos = jnp.broadcast_to(jnp.arange(S - W - 1, S - 1, dtype=jnp.int32), (B, W))
    tok_hist = token_attention_mass(q_hist, k_j, lengths, q_positions=hist_pos)  # [B, N, S]
    page_hist = tok_hist.reshape(B, N, M, C).sum(-1)
    tok_last = token_attention_mass(q_hist[:, -1:], k_j, lengths, q_positions=hist_pos[:, -1:])
    page_last = tok_last.reshape(B, N, M, C).sum(-1)
    # Scissorhands observes the history one decode step at a time.
    page_steps = [
        token_attention_mass(q_hist[:, t : t + 1], k_j, lengths, q_positions=hist_pos[:, t : t + 1])
        .reshape(B, N, M, C)
        .sum(-1)
        for t in range(W)
    ]
    page_eval = token_attention_mass(q_eval, k_j, lengths).reshape(B, N, M, C).sum(-1)
    pool_k, pool_v, table = to_pages(k, v, C)
    full = _full(q_eval, pool_k, pool_v, table, lengths)
    rows = {}
    for budget in BUDGETS:
        for pname, pol in make_policies(budget, C, W).items():
            feed = {"h2o": [page_hist], "snapkv": [page_hist], "tova": [page_last]}.get(pname, [])
            if pname == "scissorhands":
                feed = page_steps
            if pname == "oracle":
                feed = [page_eval]
            state = init_policy_state(B, M, policy=pol)
            for obs in feed:
                state = update_policy_state(state, obs, policy=pol)
            sel = select_keep(state, lengths, policy=pol, page_table=table)
            device_table, _ = split_residency(table, sel.keep, sel.demote)
            res = _kept(q_eval, pool_k, pool_v, device_table, lengths)
            mass = jnp.exp(res.lse - full.lse)  # [B, 1, N]
            err = jnp.linalg.norm(res.out - full.out, axis=-1) / jnp.linalg.norm(full.out, axis=-1)
            rows[(pname, budget)] = (100.0 * float(jnp.mean(mass)), float(jnp.mean(err)))
    return rows


def format_table(name, rows, policies):
    head = "| policy | " + " | ".join(f"{int(b * 100)}%" for b in BUDGETS) + " |"
    sep = "|---|" + "---|" * len(BUDGETS)
    lines = [f"### Pattern `{name}`: attention mass kept % (relative output error)", "", head, sep]
    for p in policies:
        cells = [f"{rows[(p, b)][0]:.1f} ({rows[(p, b)][1]:.3f})" for b in BUDGETS]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(results):
    """Relates the numbers to the article's claim (``offload.planning.ARTICLE``): 20% heavy
    hitters keep 95%+."""
    lines = [
        "### The 20% / 95% claim",
        "",
        "The article (The engineering truth of long-context inference, 2026) says keeping "
        "the top 20% heavy-hitter blocks on the device preserves 95%+ of the attention quality. "
        "Measured here as attention mass kept by H2O at a 20% page budget (oracle = the best "
        "any selection of that size can do for this query):",
        "",
    ]
    for name, rows in results.items():
        h2o, oracle = rows[("h2o", 0.2)][0], rows[("oracle", 0.2)][0]
        first = next((b for b in BUDGETS if rows[("h2o", b)][0] >= 95.0), None)
        reach = (
            f"H2O first reaches 95% at {int(first * 100)}%"
            if first
            else ("H2O stays below 95% up to 50%")
        )
        ok = "supported" if h2o >= 95.0 else "not supported"
        lines.append(f"- `{name}`: H2O {h2o:.1f}%, oracle {oracle:.1f}% → {ok}; {reach}.")
    lines += [
        "",
        "So the claim holds when attention is concentrated on sinks, a few heavy hitters and "
        "recent tokens (the regime the H2O paper reports for trained LLMs); it fails when the mass is "
        "spread (mild, drifting) and cannot hold on unstructured attention (uniform: any policy "
        "keeps about its budget's share of mass). Relative output errors above 1 on spread "
        "patterns are expected: the full output averages many random values, so its norm is "
        "small. The synthetic history queries share the evaluated query's structure, which is "
        "why the causal policies track the oracle on the static patterns; `drifting` shows the "
        "gap when the heavy set changes from query to query (H2O's accumulation beats TOVA's "
        "single last query there).",
        "",
    ]
    return lines


def main(argv=None):
    args = _common.make_parser(__doc__).parse_args(argv)
    run = _common.start_run("bench_policies", args, cpu_devices=1, argv=argv)
    cfg = (
        dict(B=2, S=2048, K=2, G=4, H=64, C=16, W=16)
        if args.quick
        else dict(B=4, S=4096, K=2, G=4, H=64, C=16, W=16)
    )
    start = time.perf_counter()
    policies = list(make_policies(0.1, cfg["C"], cfg["W"]))
    out = [
        f"Shapes: B={cfg['B']} sequences × S={cfg['S']} tokens, pages of C={cfg['C']} "
        f"(M={cfg['S'] // cfg['C']} pages), N={cfg['K'] * cfg['G']} query heads over "
        f"K={cfg['K']} kv heads, H={cfg['H']}; decode of one query, policies fed by the "
        f"W={cfg['W']} previous queries; budget = fraction of pages kept on the device (page "
        "granularity, ceil). streaming, H2O and Scissorhands keep 1 sink page; H2O, SnapKV "
        "and Scissorhands a 1-page recent window (the observation window); SnapKV ranks by "
        "the max over heads; Scissorhands is fed the W queries one step at a time (plain "
        "counts, no history decay); "
        "oracle = top pages by the evaluated query's own mass.",
        "",
    ]
    results = {}
    for name in ("concentrated", "mild", "drifting", "uniform"):
        results[name] = run_pattern(name, seed=0, **cfg)
        out += [format_table(name, results[name], policies), ""]
    out += verdict(results)
    out.append(f"Total time: {time.perf_counter() - start:.1f} s.")
    run.write("Retention policies: attention mass kept vs device budget", out)


if __name__ == "__main__":
    main()
