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
# # Ring attention: strategies, layouts, bytes per hop, causal work per device
#
# One long causal sequence is split over 8 devices (emulated on the CPU, as on Colab). This
# notebook runs every distribution strategy of `ringattn.sharded_attention` (ring, all-gather,
# Ulysses, USP) and every sequence layout (contiguous, zigzag, striped), checks each against
# the dense float32 `attention_reference`, counts the bytes each strategy moves, and plots
# the causal work each device does under each layout. `NOTEBOOK_SCALE=small` runs the tiny
# sizes the test suite uses; `NOTEBOOK_RESULTS=path.json` writes the numbers (and the plot
# beside them).
#
# On Colab, run the first code cell: it installs the library (`%pip`; the tests and CI skip
# it). From a clone with the `[notebooks]` extra installed, skip it.

# %% tags=["skip-execution"]
# %pip install -q "jax-longctx[notebooks] @ git+https://github.com/jax-longctx/jax-longctx"

# %%
import os
import sys

import jax

# 8 emulated CPU devices: this must run before JAX creates any array.
jax.config.update("jax_num_cpu_devices", 8)

from offload.serving import enable_compilation_cache

# Compiled programs are kept on disk (offload.serving.default_compilation_cache_dir()): a rerun
# starts sooner; JAX_LONGCTX_NO_COMPILATION_CACHE=1 turns that off.
enable_compilation_cache()

import json
from functools import partial

import jax.numpy as jnp
import matplotlib
import numpy as np

if "ipykernel" not in sys.modules:  # a script or a test: draw to files, not to a window
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
from jax.sharding import AxisType
from tqdm.auto import tqdm

import ringattn

SMALL = os.environ.get("NOTEBOOK_SCALE", "") == "small"
RESULTS = os.environ.get("NOTEBOOK_RESULTS")
D = 8  # devices along the sequence
print("devices:", len(jax.devices()), jax.devices()[0].platform, "| jax", jax.__version__)

# %% [markdown]
# ## 1. Every strategy and layout against the dense reference
#
# The inputs are global arrays; `to_layout` permutes the sequence once at the data boundary so
# that the 8 equal contiguous shards hold the layout's tokens, and `from_layout` undoes it on
# the output. The positions are permuted with the data and passed along: under a causal mask
# a permuted layout requires them (the order of the tokens is not visible in their values).
# USP needs a 2-D mesh: Ulysses over the first axis (2 devices), the ring over the second (4
# devices). Ulysses turns sequence sharding into head sharding, so the 8 query heads
# must divide over its devices (the 2 kv heads are repeated to 8 there).

# %%
B, S, N, K, H = 1, (1024 if SMALL else 4096), 8, 2, 64  # GQA: 8 query heads, 2 kv heads
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(kq, (B, S, N, H))
k = jax.random.normal(kk, (B, S, K, H))
v = jax.random.normal(kv, (B, S, K, H))
want = ringattn.attention_reference(q, k, v, causal=True).out  # dense float32 oracle

mesh_1d = jax.make_mesh((D,), ("seq",), axis_types=(AxisType.Explicit,))
mesh_2d = jax.make_mesh((2, D // 2), ("uly", "ring"), axis_types=(AxisType.Explicit,) * 2)
CASES = [  # (strategy, layout, mesh, seq_axis, shards of the layout)
    ("ring", "contiguous", mesh_1d, "seq", D),
    ("ring", "zigzag", mesh_1d, "seq", D),
    ("ring", "striped", mesh_1d, "seq", D),
    ("allgather", "contiguous", mesh_1d, "seq", D),
    ("allgather", "zigzag", mesh_1d, "seq", D),
    ("ulysses", "contiguous", mesh_1d, "seq", D),
    ("usp", "contiguous", mesh_2d, ("uly", "ring"), D // 2),
    ("usp", "zigzag", mesh_2d, ("uly", "ring"), D // 2),
]
errors = {}
for strategy, layout, mesh, seq_axis, shards in tqdm(CASES, desc="strategies"):
    permute = partial(ringattn.to_layout, layout=layout, num_shards=shards)
    pos = permute(jnp.arange(S, dtype=jnp.int32)[None])  # the positions travel with the data
    attend = jax.jit(
        partial(
            ringattn.sharded_attention,
            mesh=mesh,
            seq_axis=seq_axis,
            strategy=strategy,
            layout=layout,
            causal=True,
            positions=ringattn.Positions(pos, pos),
        )
    )
    out_sharded = attend(permute(q), permute(k), permute(v)).out  # sharded over the mesh
    # Undo the layout on one device (from_layout's reshape of a striped output that is
    # sharded over Explicit axes needs an out_sharding; on host memory it needs none).
    out = ringattn.from_layout(np.asarray(out_sharded), layout, num_shards=shards)
    errors[f"{strategy}/{layout}"] = float(jnp.max(jnp.abs(out - want)))
for name, err in errors.items():
    print(f"{name:>22}: max |err| vs dense reference {err:.1e}")
assert max(errors.values()) < 1e-5

# %% [markdown]
# ## 2. Bytes moved per device
#
# Computed from the shapes (float32, `L = S / D` tokens per device):
#
# * **ring**: each of the `D - 1` hops sends the local keys and values of the `K` kv heads
#   and their int32 positions: `L (2 K H * 4 + 4)` bytes. Only kv heads travel, so GQA
#   divides the traffic by `G = N / K`.
# * **all-gather**: the same `D - 1` shards of K/V and positions, gathered at once (the
#   whole sequence's K/V then sits on every device).
# * **Ulysses**: two all-to-alls each way; each device keeps `1 / D` of its local `q`, `k`,
#   `v` (kv heads repeated to `lcm(K, D)`) and `out` and sends the rest.
# * **USP** (2 x 4): Ulysses over 2 devices (half of the local `q, k, v, out` leave), then a
#   ring of 4 over `K / 2` kv heads with `S / 4` tokens per device.
#
# `ringattn.hop_bytes` reports what one ring hop of the library sends; it must agree.

# %%
F32 = 4
L = S // D
ring_hop = L * (2 * K * H * F32 + 4)  # K and V of K heads, plus int32 positions
reported_hop = ringattn.hop_bytes(B, L, K, H, "float32")
K_ULYSSES = np.lcm(K, D)  # kv heads after repetition for the all-to-all
ulysses_local = B * L * (N * H + 2 * K_ULYSSES * H + N * H) * F32  # q, k, v, out
L_USP = S // (D // 2)  # tokens per ring device after the Ulysses all-to-all
usp_hop = B * L_USP * (2 * (K // 2) * H * F32 + 4)
reported_usp_hop = ringattn.hop_bytes(B, L_USP, K // 2, H, "float32")
usp_local = B * L * (N * H + 2 * K * H + N * H) * F32
bytes_per_device = {
    "ring": (D - 1) * ring_hop,
    "allgather": (D - 1) * ring_hop,
    "ulysses": int(ulysses_local * (D - 1) / D),
    "usp": int(usp_local * (2 - 1) / 2) + (D // 2 - 1) * usp_hop,
}
print(f"ring hop: {ring_hop:,} bytes from the shapes, {reported_hop:,} from hop_bytes")
print(f"USP ring hop: {usp_hop:,} bytes from the shapes, {reported_usp_hop:,} from hop_bytes")
assert ring_hop == reported_hop and usp_hop == reported_usp_hop
print(f"{'strategy':>10} | bytes sent per device (forward) | messages")
messages = {
    "ring": f"{D - 1} hops",
    "allgather": "1 all-gather",
    "ulysses": "all-to-all: q, k, v in, out back",
    "usp": f"all-to-all over 2, then {D // 2 - 1} hops",
}
for strategy, nbytes in bytes_per_device.items():
    print(f"{strategy:>10} | {nbytes:>31,} | {messages[strategy]}")

# %% [markdown]
# ## 3. Causal work per device, per layout
#
# Under a causal mask, query `p` sees keys `0..p`. Each device owns the queries
# `shard_positions(layout, d, D, L)` and, over the whole ring, meets every key; its work is the
# number of unmasked query-key pairs, counted here from the mask itself
# (`ringattn.attention_mask`). Contiguous shards make the last device do `2 D - 1` times the
# first one's work, and the ring's step time is set by the slowest device. Zigzag gives each
# device one chunk from each end of the sequence (flat by construction); striped deals tokens
# round-robin (nearly flat).

# %%
all_positions = jnp.arange(S, dtype=jnp.int32)[None]
work = {}
for layout in ringattn.LAYOUTS:
    per_device = []
    for d in range(D):
        mine = ringattn.shard_positions(layout, d, D, L)[None]
        mask = ringattn.attention_mask(mine, all_positions, causal=True)  # [1, L, S]
        per_device.append(int(mask.sum()))
    work[layout] = per_device
imbalance = {layout: max(w) / np.mean(w) for layout, w in work.items()}
assert sum(work["contiguous"]) == S * (S + 1) // 2  # every pair counted once
for layout, w in work.items():
    print(f"{layout:>10}: slowest device / mean = {imbalance[layout]:.3f}   {w}")

fig, axes = plt.subplots(1, len(work), figsize=(4 * len(work), 3), sharey=True)
for ax, (layout, w) in zip(axes, work.items(), strict=True):
    ax.bar(range(D), np.asarray(w) / np.mean(w))
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_title(f"{layout} (max/mean {imbalance[layout]:.2f})")
    ax.set_xlabel("device")
axes[0].set_ylabel("causal query-key pairs / mean")
fig.suptitle(f"Causal work per device, S = {S}, {D} devices")
fig.tight_layout()
if RESULTS:
    fig.savefig(os.path.join(os.path.dirname(os.path.abspath(RESULTS)), "ring_work.png"))
plt.show()

# %% [markdown]
# ## Summary
#
# With `NOTEBOOK_RESULTS=path.json` the numbers go there (the test suite checks them).

# %%
summary = {
    "sizes": {"B": B, "S": S, "N": N, "K": K, "H": H, "devices": D},
    "errors": errors,
    "ring hop bytes (shapes)": ring_hop,
    "ring hop bytes (hop_bytes)": reported_hop,
    "usp hop bytes (shapes)": usp_hop,
    "usp hop bytes (hop_bytes)": reported_usp_hop,
    "bytes per device": bytes_per_device,
    "work per device": work,
    "imbalance": imbalance,
}
print(json.dumps({k: summary[k] for k in ("errors", "imbalance")}, indent=1))
if RESULTS:
    with open(RESULTS, "w") as f:
        json.dump(summary, f, indent=2)
