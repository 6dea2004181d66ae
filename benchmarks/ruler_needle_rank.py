"""Where the Quest bound ranks the needle's page, against the attention it actually gets.

For one RULER single-needle sample on SmolLM2-135M, the prompt is prefilled up to a decode step
inside the answer (after ``--digits`` of the number), and for that step's query in every layer
and kv head it reports:

* the needle page's attention share (the largest over the kv head's query heads, exact
  softmax over every key);
* its rank among the context's pages by that attention (0 = the most attended page);
* its rank by the selection score ``paged.select_pages_by_query`` uses with
  ``per_kv_head=True`` (``paged.page_logit_bounds``: the Quest bound, maximum over the group's
  query heads).

The needle is "read" by a kv head when its rank by bound is below the context pages the
retrieval press selects at a ratio (``ceil((1 - ratio) * pages)``). The summary counts, over
the (layer, kv head) pairs whose needle share is at least 0.1 (the heads that retrieve it),
how many would read it at ratios 0.8, 0.9 and 0.95.

Beyond the needle, at ratio 0.9 it reports the attention each selection holds, per query head
(the share of its attention on the context's pages that falls on the selected ones), for the
pages the bound selects and for the best possible pages (the top by true attention): what the
bound loses is what a sparse step renormalises away.

Run from the repository root (one 4K prefill, about a minute alone on 2 cores)::

    python -m benchmarks.ruler_needle_rank [--length 4096] [--seed 0] [--digits 3]

writes ``benchmarks/results/ruler/4k/needle_rank.md`` (``--out`` to change).
"""

import argparse
import math
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
RATIOS = (0.8, 0.9, 0.95)
RETRIEVING = 0.1  # the needle share that makes a head a retrieval head here


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--digits", type=int, default=3, help="answer digits before the step looked at")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    if args.digits < 0 or args.digits > 6:
        p.error(f"--digits: expected 0..6 (the needle has 7), got {args.digits}")
    return args


def main(argv=None, *, loaded=None) -> dict:
    """Runs the command; ``loaded = (model, tokenizer)`` skips loading SmolLM2 (tests)."""
    args = parse(sys.argv[1:] if argv is None else argv)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import paged
    from examples.llama import press, ruler
    from examples.llama.generate import load_model

    model, tok = load_model() if loaded is None else loaded
    count = lambda text: len(tok.encode(text).ids)
    sample = ruler.make_sample("niah_single", args.length, args.seed, count)
    (needle,) = sample.expected
    C = args.page_size
    ctx = tok.encode(sample.context).ids
    answer = tok.encode(" " + needle).ids
    ids = ctx + tok.encode(sample.question + sample.answer_prefix).ids + answer[: args.digits + 1]
    needle_page = count(sample.context[: sample.context.find(needle)]) // C
    n = len(ids) - 1  # the step looked at attends over n + 1 tokens
    pre = press.prefill(model, ids[:-1], capacity=len(ids) + 2 * C, page_size=C, window=8)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, cache, token, pos):
        m = nnx.merge(graphdef, state)
        queries = []

        def attend(q, cache, layer):
            queries.append(q)
            k, v = cache.k_pages[layer], cache.v_pages[layer]
            return paged.paged_attention(q, k, v, cache.page_table, pos[None] + 1).out, None

        _, cache, _ = press._forward(m, cache, token[None, None], pos[None, None], attend)
        return cache, jnp.stack(queries)[:, 0, 0]  # [L, N, H]

    cache, qs = step(state, pre.cache, jnp.int32(ids[-1]), jnp.int32(n))
    pages = -(-(n + 1) // C)
    table = np.asarray(cache.page_table[0, :pages])
    bounds = paged.page_key_bounds(cache, jnp.array([n + 1]))
    cfg = model.cfg
    K, N, H = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    G = N // K
    context = np.arange(1, len(ctx) // C)  # the context's pages but the sink
    rows, retrieving = [], {r: 0 for r in RATIOS}
    heads = 0
    budget = math.ceil((1 - 0.9) * len(context))
    held_bound, held_best = [], []  # per query head: context attention on the selected pages
    for layer in range(cfg.num_layers):
        keys = np.asarray(cache.k_pages[layer])[:, table].reshape(K, -1, H)[:, : n + 1]
        q = np.asarray(qs[layer])  # [N, H]
        score = np.asarray(paged.page_logit_bounds(qs[layer][None, None], bounds.layer(layer), jnp.asarray(table)[None]))[0]  # fmt: skip
        for k in range(K):
            share = 0.0
            mass = np.zeros(pages)
            for h in range(k * G, (k + 1) * G):
                logits = keys[k] @ q[h] / math.sqrt(H)
                p = np.exp(logits - logits.max())
                p /= p.sum()
                per_page = np.add.reduceat(p, np.arange(0, n + 1, C))
                if per_page[needle_page] > share:
                    share, mass = per_page[needle_page], per_page
                ctx_mass = per_page[context]
                total = ctx_mass.sum()
                if total > 0:
                    chosen = context[np.argsort(-score[k, context], kind="stable")[:budget]]
                    held_bound.append(per_page[chosen].sum() / total)
                    held_best.append(np.sort(ctx_mass)[::-1][:budget].sum() / total)
            by_mass = int((mass[context] > mass[needle_page]).sum())
            by_bound = int((score[k, context] > score[k, needle_page]).sum())
            rows.append((layer, k, share, by_mass, by_bound))
            if share >= RETRIEVING:
                heads += 1
                for r in RATIOS:
                    retrieving[r] += by_bound < math.ceil((1 - r) * len(context))
    lines = [
        "# Where the Quest bound ranks the needle's page (SmolLM2-135M, RULER single needle)",
        "",
        f"Command: `python -m benchmarks.ruler_needle_rank --length {args.length} --seed {args.seed} "
        f"--digits {args.digits}`. One sample ({len(ctx)} context tokens, {len(context) + 1} "
        f"context pages of {C}; the needle {needle} on page {needle_page}); the decode step "
        f"after {args.digits} of its digits.",
        "",
        f"Heads retrieving the needle (share >= {RETRIEVING}): {heads} (layer, kv head) pairs. "
        "Of them, the needle page is among the pages the retrieval press selects by bound at "
        + ", ".join(f"ratio {r}: **{retrieving[r]}**" for r in RATIOS) + ".",
        "",
        f"At ratio 0.9 ({budget} of the {len(context)} context pages), the share of a query "
        "head's attention on the context that the selected pages hold, mean (median) over the "
        f"{len(held_bound)} query heads: by bound **{np.mean(held_bound):.2f}** "
        f"({np.median(held_bound):.2f}); the best {budget} pages {np.mean(held_best):.2f} "
        f"({np.median(held_best):.2f}).",
        "",
        "| layer | kv head | needle share | rank by attention | rank by bound |",
        "|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    lines += [f"| {a} | {b} | {c:.2f} | {d} | {e} |" for a, b, c, d, e in rows]
    out = args.out or HERE / "results" / "ruler" / f"{args.length // 1024}k" / "needle_rank.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(lines[4])
    print(lines[6])
    print(f"wrote {out}")
    held = {"bound": float(np.mean(held_bound)), "best": float(np.mean(held_best))}
    return {"heads": heads, "retrieving": retrieving, "rows": rows, "held": held}


if __name__ == "__main__":
    main()
