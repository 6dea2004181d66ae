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
# # jax-longctx quickstart
#
# Exact long-context attention on a device mesh, a paged KV cache and KV offload, all as pure
# JAX functions. This notebook runs on a CPU with 8 emulated devices (Colab included); set
# `QUICKSTART_SCALE=small` for the tiny sizes the test suite uses.
#
# On Colab, run the first code cell: it installs the library (`%pip`; the tests and CI skip
# it). From a clone with the `[notebooks]` extra installed, skip it.

# %% tags=["skip-execution"]
# %pip install -q "jax-longctx[notebooks] @ git+https://github.com/jax-longctx/jax-longctx"

# %%
import os

import jax

# 8 emulated CPU devices: this must run before JAX creates any array.
jax.config.update("jax_num_cpu_devices", 8)

from offload.serving import enable_compilation_cache

# Compiled programs are kept on disk (offload.serving.default_compilation_cache_dir()): a rerun
# starts sooner; JAX_LONGCTX_NO_COMPILATION_CACHE=1 turns that off.
enable_compilation_cache()

import time
from functools import partial

import jax.numpy as jnp
import numpy as np

import ringattn

SMALL = os.environ.get("QUICKSTART_SCALE", "") == "small"
print("devices:", len(jax.devices()), jax.devices()[0].platform, "| jax", jax.__version__)

# %% [markdown]
# ## 1. Blockwise attention on one device
#
# `blockwise_attention` is exact: an online softmax over blocks that never builds the `T x S`
# matrix, skips blocks the mask hides, and has a memory-linear custom VJP. Every fast path is
# checked against the dense float32 `attention_reference`. Every attention function returns an
# `AttentionOutput(out, lse)`; options such as `causal` are static, so bind them with
# `functools.partial` before `jax.jit`.

# %%
B, T, N, K, H = 1, (512 if SMALL else 4096), 8, 2, 64  # GQA: 8 query heads share 2 kv heads
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(kq, (B, T, N, H))
k = jax.random.normal(kk, (B, T, K, H))
v = jax.random.normal(kv, (B, T, K, H))

fast = jax.jit(partial(ringattn.blockwise_attention, causal=True))
jax.block_until_ready(fast(q, k, v))  # compile
start = time.perf_counter()
result = jax.block_until_ready(fast(q, k, v))  # AttentionOutput: out [B, T, N, H], lse [B, T, N]
elapsed = time.perf_counter() - start
want = ringattn.attention_reference(q, k, v, causal=True)
err_fwd = float(jnp.max(jnp.abs(result.out - want.out)))


def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v, causal=True).out ** 2)


grads = jax.jit(jax.grad(loss(ringattn.blockwise_attention), argnums=(0, 1, 2)))(q, k, v)
want_grads = jax.grad(loss(ringattn.attention_reference), argnums=(0, 1, 2))(q, k, v)
err_grad = max(float(jnp.max(jnp.abs(g - w))) for g, w in zip(grads, want_grads, strict=True))
print(
    f"blockwise causal attention, T={T}: {elapsed * 1e3:.1f} ms, "
    f"max |err| forward {err_fwd:.1e}, gradients {err_grad:.1e}"
)
assert err_fwd < 1e-5 and err_grad < 1e-4

# %% [markdown]
# Partial attentions over disjoint key sets merge exactly through their `(out, lse)`:

# %%
half = T // 2
first = ringattn.blockwise_attention(q, k[:, :half], v[:, :half])
second = ringattn.blockwise_attention(
    q,
    k[:, half:],
    v[:, half:],
    positions=ringattn.Positions(q=None, kv=jnp.arange(half, T, dtype=jnp.int32)[None]),
)
merged = ringattn.merge_attention(first.out, first.lse, second.out, second.lse)
err_merge = float(jnp.max(jnp.abs(merged.out - ringattn.attention_reference(q, k, v).out)))
print(f"merge of two halves vs full attention: max |err| {err_merge:.1e}")
assert err_merge < 1e-5

# %% [markdown]
# ## 2. Ring attention over the 8-device mesh
#
# One long causal sequence is split over the `seq` axis. The zigzag layout gives every
# device the same causal work; `to_layout` permutes the sequence once at the data boundary
# and `from_layout` undoes it. Only the `K` key/value heads travel the ring.

# %%
from jax.sharding import AxisType

mesh = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Explicit,))
S_LONG = 1024 if SMALL else 16384
kq, kk, kv, ku = jax.random.split(jax.random.key(1), 4)
# Keys with structure, as real attention has: the first tokens (sinks) and every tenth page of
# 16 tokens carry a shared direction `u` per kv head, which later queries look for.
u = jax.random.normal(ku, (K, H))
u = u / jnp.linalg.norm(u, axis=-1, keepdims=True)
position = jnp.arange(S_LONG)
heavy = (position < 4) | ((position // 16) % 10 == 3)


def with_heavy_hitters(keys):
    return keys + 4.0 * heavy[None, :, None, None] * u


q_long = jax.random.normal(kq, (1, S_LONG, N, H))
k_long = with_heavy_hitters(jax.random.normal(kk, (1, S_LONG, K, H)))
v_long = jax.random.normal(kv, (1, S_LONG, K, H))

zig = partial(ringattn.to_layout, layout="zigzag", num_shards=8)
# The positions are permuted with the data: they say where each token truly is (a permuted
# layout under a causal mask needs them; with them any token order gives the right answer).
pos_zig = zig(jnp.arange(S_LONG, dtype=jnp.int32)[None])
ring = jax.jit(
    partial(
        ringattn.sharded_attention,
        mesh=mesh,
        seq_axis="seq",
        strategy="ring",
        layout="zigzag",
        causal=True,
        positions=ringattn.Positions(pos_zig, pos_zig),
    )
)
out_zig = ring(zig(q_long), zig(k_long), zig(v_long)).out
out_ring = ringattn.from_layout(out_zig, "zigzag", num_shards=8)
single = jax.jit(partial(ringattn.blockwise_attention, causal=True))(q_long, k_long, v_long).out
err_ring = float(jnp.max(jnp.abs(out_ring - single)))
print(
    f"ring (zigzag, causal) over 8 devices, S={S_LONG}: output sharded as "
    f"{out_zig.sharding.spec}; max |err| vs one device {err_ring:.1e}"
)
assert err_ring < 1e-5

for strategy in ("allgather", "ulysses"):
    other = partial(
        ringattn.sharded_attention, mesh=mesh, seq_axis="seq", strategy=strategy, causal=True
    )
    err = float(jnp.max(jnp.abs(jax.jit(other)(q_long, k_long, v_long).out - single)))
    print(f"strategy {strategy!r}: max |err| vs one device {err:.1e}")
    assert err < 1e-5

# %% [markdown]
# ## 3. A paged KV cache: write the prefill, decode a few tokens
#
# The host-side `PageAllocator` hands out pages (page 0 is the reserved null page) and
# produces the page table; the jittable `PagedKVCache` stores K/V heads-major
# `[L, K, P, C, H]`. The long sequence's KV from section 2 is written as the prefill of
# sequence 0, a second sequence shares the pool. The allocator's life cycle is
# admit (or allocate) -> write on the device -> commit -> extend / fork -> free: `commit` tells
# it which tokens are written (prefix caching only reuses committed pages, and `stats()` counts
# what is still uncommitted), and `extend` returns a `CopyPlan` that `copy_pages` runs.

# %%
import paged

C = 16
B_DEC, DECODE_STEPS = 2, 4
M = -(-(S_LONG + DECODE_STEPS) // C)
alloc = paged.PageAllocator(num_pages=2 * M + 8, page_size=C, max_pages_per_seq=M)
for seq in range(B_DEC):
    alloc.allocate(seq, S_LONG)

k_prefill = jnp.concatenate([k_long, with_heavy_hitters(jax.random.normal(kk, k_long.shape))])
v_prefill = jnp.concatenate([v_long, jax.random.normal(kv, v_long.shape)], axis=0)
cache = paged.init_paged_cache(1, K, 2 * M + 8, C, H, batch=B_DEC, max_pages_per_seq=M)
cache = paged.with_page_table(cache, alloc.page_table(range(B_DEC)))  # host -> device hand-off
cache = paged.write(cache, k_prefill[None], v_prefill[None], 0)  # [L=1, B, S, K, H]
paged.validate(cache)
for seq in range(B_DEC):
    alloc.commit(seq)  # the prefill's KV is on the device

decode = jax.jit(paged.paged_attention)
k_all, v_all = k_prefill, v_prefill
err_paged = 0.0
for step in range(DECODE_STEPS):
    ks = jax.random.split(jax.random.key(100 + step), 3)
    q_new = jax.random.normal(ks[0], (B_DEC, 1, N, H))
    k_new = jax.random.normal(ks[1], (B_DEC, K, H))
    v_new = jax.random.normal(ks[2], (B_DEC, K, H))
    for seq in range(B_DEC):
        plan = alloc.extend(seq, S_LONG + step + 1)  # a CopyPlan, usually empty
        cache = paged.copy_pages(cache, plan)  # copy-on-write of a shared last page, if any
    # The device's own lengths advance with `append`; the host only added pages.
    cache = paged.with_page_table(cache, alloc.page_table(range(B_DEC)))
    cache = paged.append(cache, k_new[None], v_new[None])
    for seq in range(B_DEC):
        alloc.commit(seq)
    out = decode(q_new, cache.k_pages[0], cache.v_pages[0], cache.page_table, cache.lengths).out
    k_all = jnp.concatenate([k_all, k_new[:, None]], axis=1)
    v_all = jnp.concatenate([v_all, v_new[:, None]], axis=1)
    pos = jnp.full((B_DEC, 1), S_LONG + step, jnp.int32)
    positions = ringattn.Positions(q=pos, kv=None)  # the new tokens come after the prefill
    want = ringattn.attention_reference(q_new, k_all, v_all, causal=True, positions=positions).out
    err_paged = max(err_paged, float(jnp.max(jnp.abs(out - want))))
stats = alloc.stats()
print(
    f"paged decode of {DECODE_STEPS} tokens for {B_DEC} sequences: max |err| vs dense "
    f"{err_paged:.1e}; pages used {stats.pages_used}, waste {stats.waste:.2%}, "
    f"tokens not committed {stats.tokens_uncommitted}"
)
assert err_paged < 1e-5 and stats.tokens_uncommitted == 0

# %% [markdown]
# ## 4. Offload: keep a budget of pages on device, demote the rest to host memory
#
# H2O ranks pages by the attention mass they received (`paged_attention` reports it per
# page), keeps 25% of them (the first page as a sink and the two most recent among them), and the
# rest are demoted to a pinned-host page pool and given back to the allocator
# (`release_pages`: freed unless another sequence shares them). Decoding from the device pages
# alone is the policy's approximation; fetching the cold pages back into a staging pool of just
# those pages makes the step exact again. Every byte count shown is measured from the arrays.

# %%
import offload

policy = offload.RetentionPolicy("h2o", 0.25, page_size=C, sink=1, recent=2)


def looking_for_heavy_hitters(key):
    """Decode queries: noise plus each head's kv-head direction `u` (GQA: head n uses n // G)."""
    noise = jax.random.normal(key, (B_DEC, 1, N, H))
    return 0.5 * noise + 8.0 * jnp.repeat(u, N // K, axis=0)


q_obs = looking_for_heavy_hitters(jax.random.key(7))
page_mass = paged.paged_attention(
    q_obs,
    cache.k_pages[0],
    cache.v_pages[0],
    cache.page_table,
    cache.lengths,
    return_page_mass=True,
).page_mass  # PagedAttentionOutput(out, lse, page_mass): [B, N, M] mass per page
state = offload.update_policy_state(
    offload.init_policy_state(B_DEC, M, policy=policy), page_mass, policy=policy
)
selection = offload.select_keep(state, cache.lengths, policy=policy, page_table=cache.page_table)
device_table, cold_table = offload.split_residency(
    cache.page_table, selection.keep, selection.demote
)
# Each demoted page once, and the cold table remapped to staging ids 1..n.
cold_ids, staged_table = offload.staging_table(cold_table)

manager = offload.OffloadManager(
    offload.make_host_page_pool(cache.k_pages, cache.v_pages, num_slots=len(cold_ids))
)
manager.wait(manager.page_out(cache.k_pages, cache.v_pages, cold_ids, request_id="doc"))
# The rows give the demoted pages back to the allocator: the pages nobody else holds are free
# (a page shared through the prefix cache would stay for its other holders).
full_table = cache.page_table
demoted = np.asarray(selection.demote)
freed = np.concatenate(
    [alloc.release_pages(seq, np.flatnonzero(demoted[seq])) for seq in range(B_DEC)]
)
cache = paged.with_page_table(cache, alloc.page_table(range(B_DEC)))  # the device table
assert (np.asarray(cache.page_table) == np.asarray(device_table)).all()
# Bytes per tier, measured from the arrays: device pages still held, host pages demoted.
manager.record_device_pages(cache.k_pages, cache.v_pages, alloc.stats().pages_used)
print(manager.stats.to_markdown())
# The freed pages may now be overwritten: poison them to show they are never read.
k_dev = cache.k_pages.at[:, :, freed].set(jnp.nan)
v_dev = cache.v_pages.at[:, :, freed].set(jnp.nan)

q_step = looking_for_heavy_hitters(jax.random.key(8))
full = paged.paged_attention(
    q_step, cache.k_pages[0], cache.v_pages[0], full_table, cache.lengths
).out
approx = offload.mixed_residency_attention(
    q_step, k_dev[0], v_dev[0], cache.page_table, cache.lengths
)
# Fetch the demoted pages back into a staging pool of just those pages (page 0 null).
staging_k, staging_v = offload.make_staging_pool(cache.k_pages, cache.v_pages, len(cold_ids))
back = manager.page_in(staging_k, staging_v, np.arange(1, len(cold_ids) + 1), request_id="doc")
cold_k, cold_v = manager.wait(back)
exact = offload.mixed_residency_attention(
    q_step,
    k_dev[0],
    v_dev[0],
    cache.page_table,
    cache.lengths,
    cold_table=jnp.asarray(staged_table),
    cold_k_pages=cold_k[0],
    cold_v_pages=cold_v[0],
)
staging_bytes = offload.measure_bytes((cold_k, cold_v))["device"]
pool_bytes = offload.measure_bytes((cache.k_pages, cache.v_pages))["device"]
print(f"staging pool {staging_bytes} bytes for {len(cold_ids)} pages (device pool {pool_bytes})")
assert staging_bytes == (len(cold_ids) + 1) * offload.page_nbytes(cache.k_pages, cache.v_pages)
err_exact = float(jnp.max(jnp.abs(exact.out - full)))
rel_approx = float(jnp.linalg.norm(approx.out - full) / jnp.linalg.norm(full))
kept = float(jnp.mean(exact.mass_kept))
print(
    f"pages on device {int((device_table > 0).sum())}, demoted {len(cold_ids)} (freed "
    f"{len(freed)}); "
    f"attention mass on device pages {kept:.1%}"
)
print(
    f"device-only decode: relative error {rel_approx:.3f}; with cold pages fetched: "
    f"max |err| {err_exact:.1e}"
)
print(manager.stats.transfers("host_to_device"))  # the fetch for this step
assert err_exact < 1e-5

# %% [markdown]
# ## Summary
#
# What this notebook computed; with `QUICKSTART_RESULTS=path.json` set it also writes these
# numbers there (the test suite checks them against its tolerances).

# %%
import json

summary = {
    "blockwise forward error": err_fwd,
    "blockwise gradient error": err_grad,
    "merge error": err_merge,
    "ring (8 devices) error": err_ring,
    "paged decode error": err_paged,
    "offload exact-decode error": err_exact,
    "offload device-only relative error": rel_approx,
    "offload mass kept on device": kept,
}
for name, value in summary.items():
    print(f"{name:>36}: {value:.2e}")
if os.environ.get("QUICKSTART_RESULTS"):
    with open(os.environ["QUICKSTART_RESULTS"], "w") as f:
        json.dump(summary, f, indent=2)
