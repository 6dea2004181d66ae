# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Planning long-context serving with `offload.planning.plan`
#
# The article "The engineering truth of long-context inference, 2026: PagedAttention, Ring
# Attention and KV cache offloading in practice, from 128K to 1M context" (in Chinese:
# 长上下文推理的工程真相 2026) is at heart a decision procedure: three iron rules and a decision
# tree (its section 5), twelve engineering rules (section 7) and three incidents (section 8).
# `offload.planning.plan(workload, hardware)` is that procedure as a pure-Python function
# over frozen dataclasses: it answers the article's questions (KV bytes, page size, sequence parallelism
# and its strategy, offload tiers, quantization, the sizing percentile) from *your* numbers,
# with the model's weights and tensor parallelism counted, and every answer carries the
# reasons that produced it: the rule, the numbers, the source (the article's section, or where
# this repository's own measurements disagree with the article, the results file). No JAX
# arrays, no devices: it runs anywhere in a second or two.
#
# On Colab, run the first code cell: it installs the library (`%pip`; the tests and CI skip
# it). From a clone with the `[notebooks]` extra installed, skip it.

# %% tags=["skip-execution"]
# %pip install -q "jax-longctx[notebooks] @ git+https://github.com/jax-longctx/jax-longctx"

# %%
import dataclasses
import json
import os
import sys

import matplotlib

INTERACTIVE = "ipykernel" in sys.modules
if not INTERACTIVE:  # a script (the test suite): draw off screen
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from offload.planning import Hardware, LengthDistribution, ModelShape, Workload, plan

GiB = 2**30
RESULTS = {}  # what this notebook computed (written to $NOTEBOOK_RESULTS when set)


def show(p, width=150):
    """Print a plan as a table: field, value, then its reasons (wrapped to ``width``; each
    reason's source, the article's section or a results file, is left out here: ``p.format()``
    prints everything)."""
    for row in p.rows():
        value = row.value
        if row.field == "cost":
            value = (
                f"prefill {value.total_s:,.2f} s, decode {value.decode_step_s * 1e3:,.2f} ms/token"
            )
        elif isinstance(value, float):
            value = f"{value:,.4g}"
        elif isinstance(value, int) and not isinstance(value, bool) and value > 10_000:
            value = f"{value:,}"
        print(f"{row.field:<29} {value}")
        for reason in row.reasons:
            text = f"[{reason.rule}] {reason.text}"
            while text:
                print(f"{'':<31}{text[: width - 31]}")
                text = text[width - 31 :]


# %% [markdown]
# ## 1. The article's worked example: Llama-3-70B at 256K tokens on 8 H100s
#
# The article (section 1.1) computes the KV cache as `2 x 80 layers x 64 heads x 128 x 2 bytes =
# 2.5 MB` per token and 640 GB per 256K request. Llama-3-70B has 64 *query* heads but only 8
# *kv* heads (grouped-query attention), so its real KV is 320 KB per token and 80 GB per
# request. The planner shows both. The model is served the usual way, tensor parallel over the
# 8 GPUs of the node (TP=8): each GPU holds 1/8 of the 70.6B bf16 weights (17.6 GB) and one of
# the 8 kv heads, so one 256K request is 10 GiB per GPU and needs no sequence parallelism.
# `Hardware.h100_sxm` is the H100's published peaks, each labelled as an assumption; we keep
# 8 of each GPU's 80 GB for activations.

# %%
llama = ModelShape(
    layers=80,
    query_heads=64,
    kv_heads=8,
    head_dim=128,
    kv_format="bfloat16",
    params=70_553_706_496,  # Llama-3-70B
)
h100 = Hardware.h100_sxm(device_memory=72 * 10**9, host_memory=1024 * GiB, disk=8 * 1024 * GiB)
every_request_256k = LengthDistribution.from_percentiles(262144, 262144, 262144)
article = plan(Workload(llama, every_request_256k, tensor_parallel=8), h100)
show(article)
RESULTS["article kv bytes per token"] = article.kv_bytes_per_token.value
RESULTS["article kv bytes per token, all heads"] = article.kv_bytes_per_token_all_heads.value
RESULTS["article kv bytes per token per device"] = article.kv_bytes_per_token_per_device.value
RESULTS["article kv bytes per request"] = article.kv_bytes_per_request.value
RESULTS["article weight bytes per device"] = article.weight_bytes_per_device.value
RESULTS["article degree"] = article.degree.value
RESULTS["article strategy"] = article.strategy.value

# %% [markdown]
# If Llama-3-70B really had 64 kv heads, as the article counts, one request would need 640 GiB,
# 80 GiB per GPU at TP=8: more than the 54 GB the weights leave. With the default (exact KV
# formats only) the planner keeps bf16 and offloads the rest to host memory. Lossy formats are
# opt-in (`quantization=("int8",)`): int8 pages (0.516x of bf16) then fit, and the reason says
# that int8's accuracy was measured only on this repo's toy model, not on a real one.

# %%
as_the_article_counts = dataclasses.replace(llama, kv_heads=64)
exact = plan(Workload(as_the_article_counts, every_request_256k, tensor_parallel=8), h100)
print(f"exact: {exact.kv_format.value}, host {exact.tiers.value.host / GiB:,.1f} GiB per request")
counted = plan(
    Workload(as_the_article_counts, every_request_256k, tensor_parallel=8, quantization=("int8",)),
    h100,
)
print(f"kv format: {counted.kv_format.value}, {counted.kv_bytes_per_token.value:,} bytes/token")
print(*counted.kv_format.reasons, sep="\n")
print(f"degree {counted.degree.value}, strategy {counted.strategy.value}")
RESULTS["64 kv heads, exact: kv format"] = exact.kv_format.value
RESULTS["64 kv heads, exact: host bytes"] = exact.tiers.value.host
RESULTS["64 kv heads: kv format"] = counted.kv_format.value
RESULTS["64 kv heads: degree"] = counted.degree.value

# %% [markdown]
# ## 2. Your own numbers
#
# Replace these with your model, your request log and your cluster. Here: a GQA model with 48
# layers, 32 query heads over 8 kv heads, its size not given (`params=None`: the plan says it
# counts no weights, so `device_memory` is what is left for KV); a long-tailed request log
# (median about 4K, p99 about 128K, as the article's rule 3 describes production traffic); 70%
# of requests share a 2K system prompt; two nodes of 8 GPUs with 40 GiB each for KV (peaks
# given without labels: the plan reports them as given by the caller). Rule 1 sizes for p95 +
# 2 sigma of the samples, not for the longest request, and iron rule 2 picks pages of 64 for
# the heavy prefix reuse; its reason gives the saving this repo *measured*
# (`benchmarks/results/paged_memory.md`), set by the shared prefix's share of resident tokens,
# not the article's 30-40%.

# %%
rng = np.random.default_rng(0)
samples = np.minimum(np.ceil(rng.lognormal(np.log(4096), 1.45, size=2000)), 1 << 20).astype(int)
mine = ModelShape(layers=48, query_heads=32, kv_heads=8, head_dim=128)
cluster = Hardware(
    devices=16,
    devices_per_node=8,
    device_memory=40 * GiB,
    device_flops=989e12,
    memory_bandwidth=3.35e12,
    intra_node_bandwidth=450e9,
    inter_node_bandwidth=25e9,
    host_memory=2048 * GiB,
    disk=16 * 1024 * GiB,
)
lengths = LengthDistribution.from_samples(samples)
workload = Workload(mine, lengths, prefix_reuse=0.7, prefix_tokens=2048)
yours = plan(workload, cluster)
print(
    f"{lengths.count} requests: p50 {lengths.p50:,.0f}, p95 {lengths.p95:,.0f}, "
    f"p99 {lengths.p99:,.0f}, max {lengths.max_length:,}, sigma {lengths.sigma:,.0f}"
)
show(yours)
RESULTS["yours: sizing length"] = yours.sizing_length.value
RESULTS["yours: page size"] = yours.page_size.value
RESULTS["yours: prefix saving"] = yours.prefix_saving.value
RESULTS["yours: kv bytes per request"] = yours.kv_bytes_per_request.value
RESULTS["yours: max sequences per device"] = yours.max_sequences_per_device.value

# %% [markdown]
# ## 3. The same model and cluster as the context grows
#
# Iron rule 1: no sequence parallelism under 128K. Past 128K the planner picks the smallest
# group that holds a request; iron rule 3 (with the article's case B, a cross-node ring): past
# 512K the group stays inside one node and the rest of the request goes to pinned host memory,
# then disk. Quantization stays off (the default: lossy formats are opt-in) to show the tiers,
# and each device keeps 20 GiB for KV.

# %%
sweep = [2**k for k in range(13, 22)] + [3 << 19]  # 8K ... 2M, and 1.5M
rows = []
smaller = dataclasses.replace(cluster, device_memory=20 * GiB)
for length in sweep:
    fixed = LengthDistribution.from_percentiles(length, length, length)
    p = plan(Workload(mine, fixed), smaller)
    t = p.tiers.value
    rows.append(
        (
            length,
            p.degree.value,
            p.strategy.value,
            p.kv_format.value,
            t.device,
            t.host,
            t.disk,
            p.cost.value.total_s,
        )
    )
sweep_rows = sorted(rows)
print(
    f"{'tokens':>10} {'degree':>6} {'strategy':>9} {'format':>9} {'device GiB':>11} "
    f"{'host GiB':>9} {'disk GiB':>9} {'prefill s':>10}"
)
for length, degree, strategy, fmt, device, host, disk, prefill in sweep_rows:
    print(
        f"{length:>10,} {degree:>6} {strategy or '-':>9} {fmt:>9} {device / GiB:>11,.1f} "
        f"{host / GiB:>9,.1f} {disk / GiB:>9,.1f} {prefill:>10,.2f}"
    )
RESULTS["sweep degrees"] = {str(r[0]): r[1] for r in sweep_rows}
RESULTS["sweep host bytes"] = {str(r[0]): r[5] for r in sweep_rows}

fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5))
xs = [r[0] for r in sweep_rows]
left.step(xs, [r[1] for r in sweep_rows], where="post")
left.axvline(128 * 1024, ls="--", c="gray")
left.axvline(512 * 1024, ls=":", c="gray")
left.set(
    xscale="log",
    xlabel="tokens per request",
    ylabel="sequence-parallel degree",
    title="iron rules 1 and 3",
)
for i, tier in ((4, "device"), (5, "host"), (6, "disk")):
    right.plot(xs, [r[i] / GiB for r in sweep_rows], marker="o", label=tier)
right.set(
    xscale="log",
    yscale="symlog",
    xlabel="tokens per request",
    ylabel="GiB per request",
    title="KV tiers",
)
right.legend()
fig.tight_layout()
if INTERACTIVE:
    plt.show()
else:
    plt.close(fig)

# %% [markdown]
# What this notebook computed; with `NOTEBOOK_RESULTS=path.json` set it also writes these
# numbers there (the test suite checks them).

# %%
print(json.dumps(RESULTS, indent=1))
if os.environ.get("NOTEBOOK_RESULTS"):
    with open(os.environ["NOTEBOOK_RESULTS"], "w") as f:
        json.dump(RESULTS, f, indent=1)
