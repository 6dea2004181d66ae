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
# # A paged KV cache: allocator life cycle, prefix cache, page-size waste, paged decode
#
# `paged.PageAllocator` is the host-side bookkeeping (free list, reference counts, prefix
# cache, copy-on-write forks, metrics); `paged.PagedKVCache` and `paged.paged_attention` are
# the jittable device side. This notebook walks a sequence's life cycle, measures prefix-cache
# hits across requests sharing a system prompt, plots the memory wasted in partly filled pages
# against the page size, and checks paged decode against dense attention.
# `NOTEBOOK_SCALE=small` runs the tiny sizes the test suite uses; `NOTEBOOK_RESULTS=path.json`
# writes the numbers (and the plot beside them).
#
# On Colab, run the first code cell: it installs the library (`%pip`; the tests and CI skip
# it). From a clone with the `[notebooks]` extra installed, skip it.

# %% tags=["skip-execution"]
# %pip install -q "jax-longctx[notebooks] @ git+https://github.com/jax-longctx/jax-longctx"

# %%
import os
import sys

import jax

# 8 emulated CPU devices (as in the other notebooks): before JAX creates any array.
jax.config.update("jax_num_cpu_devices", 8)

from offload.serving import enable_compilation_cache

# Compiled programs are kept on disk (offload.serving.default_compilation_cache_dir()): a rerun
# starts sooner; JAX_LONGCTX_NO_COMPILATION_CACHE=1 turns that off.
enable_compilation_cache()

import json

import jax.numpy as jnp
import matplotlib
import numpy as np

if "ipykernel" not in sys.modules:  # a script or a test: draw to files, not to a window
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm.auto import tqdm

import paged
import ringattn

SMALL = os.environ.get("NOTEBOOK_SCALE", "") == "small"
RESULTS = os.environ.get("NOTEBOOK_RESULTS")
print("devices:", len(jax.devices()), jax.devices()[0].platform, "| jax", jax.__version__)

# %% [markdown]
# ## 1. The allocator's life cycle
#
# admit (reuse the longest cached page-aligned prefix, allocate the rest) -> write the KV on
# the device -> commit (the written full pages join the prefix cache) -> extend (room for new
# tokens) / fork (a child shares the full pages; the partial last page is copied) -> free
# (keyed pages stay cached, evictable; the others return to the free list). Page 0 is the
# reserved null page, so a pool of `P` pages has `P - 1` usable ones.

# %%
C_TOY = 4
toy = paged.PageAllocator(num_pages=17, page_size=C_TOY, max_pages_per_seq=6)
STAT_FIELDS = ("pages_used", "pages_free", "pages_cached", "pages_shared", "tokens_uncommitted")
life = []


def record(step):
    s = toy.stats()
    row = {"step": step, **{f: int(getattr(s, f)) for f in STAT_FIELDS}, "waste": s.waste}
    row["hit rate"] = s.prefix_hit_rate
    life.append(row)
    assert s.pages_used + s.pages_free + s.pages_cached == s.num_pages  # every page accounted


prompt = np.arange(10, 20)  # 10 token ids: 2 full pages and a partial one
adm = toy.admit("a", prompt)
record(f"admit a ({adm.num_tokens} tokens, {adm.num_cached_tokens} cached)")
toy.commit("a")
record("commit a")
toy.extend("a", 12, token_ids=[20, 21])  # fills the third page
toy.commit("a")
record("extend a to 12, commit")
plan = toy.fork("a", "a-beam")  # 3 full pages: all shared, nothing to copy
record(f"fork a -> a-beam (copies {len(plan.src)})")
plan = toy.extend("a-beam", 13, token_ids=[99])
toy.commit("a-beam")
record("extend a-beam to 13, commit")
toy.free("a")
record("free a")
adm_b = toy.admit("b", np.concatenate([prompt, [20, 21, 7, 7]]))  # shares a's 12 tokens
record(f"admit b ({adm_b.num_tokens} tokens, {adm_b.num_cached_tokens} cached)")
toy.commit("b")
toy.free("a-beam")
toy.free("b")
record("free a-beam and b")

SHORT = {f: f.replace("pages_", "").replace("tokens_", "") for f in STAT_FIELDS}
header = f"{'step':>36} | " + " | ".join(f"{SHORT[f]:>11}" for f in STAT_FIELDS)
print(header + " |  waste | hit rate")
for row in life:
    cells = " | ".join(f"{row[f]:>11}" for f in STAT_FIELDS)
    print(f"{row['step']:>36} | {cells} | {row['waste']:6.1%} | {row['hit rate']:6.1%}")

# %% [markdown]
# ## 2. Prefix cache hits across requests that share a system prompt
#
# `R` requests share a system prompt of `P_SYS` tokens and then ask different questions.
# The first request computes everything; each later one finds the system prompt's full pages
# in the cache (only whole pages are shared, and the last page of a prompt is always
# recomputed). Expected hits of request `i > 0`: `min(floor(P_SYS / C), ceil(T_i / C) - 1) * C`
# tokens.

# %%
C = 16
R = 8 if SMALL else 64
P_SYS = 200 if SMALL else 1000
rng = np.random.default_rng(0)
system_prompt = rng.integers(0, 1000, P_SYS)
question_lengths = rng.integers(5, 120, R)
M_MAX = -(-(P_SYS + int(question_lengths.max())) // C)
server_alloc = paged.PageAllocator(num_pages=R * M_MAX + 1, page_size=C, max_pages_per_seq=M_MAX)
hits = []
for i in tqdm(range(R), desc="requests"):
    # Each question starts with its own token (>= 1000), so questions never share a page.
    question = np.concatenate([[1000 + i], rng.integers(0, 1000, question_lengths[i] - 1)])
    adm = server_alloc.admit(("req", i), np.concatenate([system_prompt, question]))
    hits.append(adm.num_cached_tokens)
    server_alloc.commit(("req", i))  # the prefill wrote its KV
    server_alloc.free(("req", i))  # done: its keyed pages stay cached
prefix = server_alloc.stats()
prompt_lengths = P_SYS + question_lengths
expected_hits = [0] + [min(P_SYS // C, -(-int(t) // C) - 1) * C for t in prompt_lengths[1:]]
expected_rate = sum(expected_hits) / int(prompt_lengths.sum())
print(
    f"{R} requests, system prompt {P_SYS} tokens, pages of {C}: prefix hit rate "
    f"{prefix.prefix_hit_rate:.1%} (expected {expected_rate:.1%}); tokens hit "
    f"{prefix.tokens_hit} of {prefix.tokens_admitted}; evictions {prefix.evictions}"
)
assert hits == expected_hits and abs(prefix.prefix_hit_rate - expected_rate) < 1e-12

# %% [markdown]
# ## 3. Waste vs page size
#
# A sequence of `l` tokens holds `ceil(l / C)` pages; the unfilled slots of its last page are
# waste. Over a long-tailed length distribution (log-normal, median 300 tokens), the
# allocator's `stats().waste` is compared with the count from the lengths, and plotted with
# the other side of the trade: the page table (int32 per page) shrinks as pages grow.

# %%
NUM_SEQS = 300 if SMALL else 3000
lengths = np.clip(rng.lognormal(np.log(300), 1.0, NUM_SEQS).astype(int), 1, 8192)
PAGE_SIZES = (4, 16, 64, 256, 1024)
waste, waste_counted, table_bytes = {}, {}, {}
for page in tqdm(PAGE_SIZES, desc="page sizes"):
    pages_needed = -(-lengths // page)
    alloc = paged.PageAllocator(
        int(pages_needed.sum()) + 1, page, max_pages_per_seq=int(pages_needed.max())
    )
    for seq, length in enumerate(lengths):
        alloc.allocate(seq, int(length))
    waste[page] = alloc.stats().waste
    table_bytes[page] = alloc.stats().page_table_bytes
    slots = int((pages_needed * page).sum())
    waste_counted[page] = (slots - int(lengths.sum())) / slots
    assert abs(waste[page] - waste_counted[page]) < 1e-12
for page in PAGE_SIZES:
    print(
        f"page size {page:>5}: waste {waste[page]:6.2%} (counted {waste_counted[page]:6.2%}),"
        f" page tables {table_bytes[page]:>9,} bytes"
    )

fig, ax = plt.subplots(figsize=(5, 3.2))
ax.plot(PAGE_SIZES, [100 * waste[p] for p in PAGE_SIZES], "o-", label="waste (% of slots)")
ax.set_xscale("log", base=2)
ax.set_xlabel("tokens per page C")
ax.set_ylabel("waste (% of allocated slots)")
ax2 = ax.twinx()
ax2.plot(PAGE_SIZES, [table_bytes[p] for p in PAGE_SIZES], "s--", color="gray")
ax2.set_yscale("log")
ax2.set_ylabel("page-table bytes (gray)")
ax.set_title(f"{NUM_SEQS} sequences, median {int(np.median(lengths))} tokens")
fig.tight_layout()
if RESULTS:
    fig.savefig(os.path.join(os.path.dirname(os.path.abspath(RESULTS)), "paged_cache_waste.png"))
plt.show()

# %% [markdown]
# ## 4. Paged decode against dense attention
#
# Sequences of lengths 1, C, C + 1 and longer are grown a page at a time in turn, so their
# pages interleave in the pool; one is forked (the child shares its full pages). The prefill
# K/V is written through the page table, then a decode query per sequence attends over its
# pages with `paged.paged_attention` (jitted) and is compared with `attention_reference`
# over the same tokens laid out densely.

# %%
N, K, H = 8, 2, 64
S_LONG = 200 if SMALL else 3000
seq_lengths = [1, C, C + 1, S_LONG]
M = -(-max(seq_lengths) // C) + 1
pool = paged.PageAllocator(
    num_pages=2 * sum(-(-n // C) for n in seq_lengths) + 4, page_size=C, max_pages_per_seq=M
)
for seq in range(len(seq_lengths)):
    pool.allocate(seq, 0)
grown = [0] * len(seq_lengths)
while grown != seq_lengths:  # one page per sequence in turn: interleaved page ids
    for seq, n in enumerate(seq_lengths):
        if grown[seq] < n:
            grown[seq] = min(n, grown[seq] + C)
            pool.extend(seq, grown[seq])
plan = pool.fork(3, "fork")  # the long one: full pages shared, the partial last one copied
rows = [0, 1, 2, 3, "fork"]
lens = np.array([*seq_lengths, seq_lengths[3]], np.int32)
B = len(rows)
S_MAX = int(lens.max())
kk, kv, kq = jax.random.split(jax.random.key(1), 3)
k_dense = jax.random.normal(kk, (B, S_MAX, K, H))
v_dense = jax.random.normal(kv, (B, S_MAX, K, H))
k_dense, v_dense = k_dense.at[4].set(k_dense[3]), v_dense.at[4].set(v_dense[3])  # a fork
cache = paged.init_paged_cache(1, K, pool.stats().num_pages + 1, C, H, batch=B, max_pages_per_seq=M)
cache = paged.with_page_table(cache, pool.page_table(rows))
cache = paged.write(cache, k_dense[None], v_dense[None], 0, count=jnp.asarray(lens))
cache = paged.copy_pages(cache, plan)  # the fork's private copy of the partial page
paged.validate(cache)
for seq in rows:
    pool.commit(seq)
print("page table (first 8 columns):\n", np.asarray(cache.page_table)[:, :8])

q_dec = jax.random.normal(kq, (B, 1, N, H))
decode = jax.jit(paged.paged_attention)
out = decode(q_dec, cache.k_pages[0], cache.v_pages[0], cache.page_table, cache.lengths).out
decode_errors = []
for b in range(B):
    n = int(lens[b])
    want = ringattn.attention_reference(
        q_dec[b : b + 1], k_dense[b : b + 1, :n], v_dense[b : b + 1, :n]
    ).out
    decode_errors.append(float(jnp.max(jnp.abs(out[b : b + 1] - want))))
for seq, n, err in zip(rows, lens, decode_errors, strict=True):
    print(f"sequence {seq!s:>5} ({n:>5} tokens): max |err| vs dense {err:.1e}")
assert max(decode_errors) < 1e-5
print("pool after the forks:", pool.stats())

# %% [markdown]
# ## Summary
#
# With `NOTEBOOK_RESULTS=path.json` the numbers go there (the test suite checks them).

# %%
summary = {
    "life cycle": life,
    "prefix": {
        "page size": C,
        "system prompt tokens": P_SYS,
        "prompt lengths": [int(t) for t in prompt_lengths],
        "hits per request": hits,
        "hit rate": prefix.prefix_hit_rate,
        "tokens hit": prefix.tokens_hit,
        "tokens admitted": prefix.tokens_admitted,
    },
    "waste": {
        "page sizes": list(PAGE_SIZES),
        "waste": [waste[p] for p in PAGE_SIZES],
        "counted": [waste_counted[p] for p in PAGE_SIZES],
        "page table bytes": [table_bytes[p] for p in PAGE_SIZES],
        "sequences": NUM_SEQS,
        "lengths": [int(n) for n in lengths],
    },
    "decode": {"lengths": [int(n) for n in lens], "errors": decode_errors},
}
print(json.dumps(summary["prefix"] | {"waste": summary["waste"]["waste"]}, indent=1))
if RESULTS:
    with open(RESULTS, "w") as f:
        json.dump(summary, f, indent=2)
