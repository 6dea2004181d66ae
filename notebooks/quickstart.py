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
# # jax-longctx quickstart
#
# Exact long-context attention on a device mesh, a paged KV cache and KV offload, all as pure
# JAX functions. This notebook runs on a CPU with 8 emulated devices (Colab included); set
# `QUICKSTART_SCALE=small` for the tiny sizes the test suite uses.

# %%
import sys

if "google.colab" in sys.modules:  # Colab: install the library (and nothing else) first
    import os
    import subprocess

    # The distribution name, or a git URL / wheel path of your copy of the repository.
    spec = os.environ.get("JAX_LONGCTX_SPEC", "jax-longctx")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", spec], check=True)

# %%
import os

import jax

# 8 emulated CPU devices: this must run before JAX creates any array.
jax.config.update("jax_num_cpu_devices", 8)

import time

import jax.numpy as jnp

import ringattn

SMALL = os.environ.get("QUICKSTART_SCALE", "") == "small"
print("devices:", len(jax.devices()), jax.devices()[0].platform, "| jax", jax.__version__)

# %% [markdown]
# ## 1. Blockwise attention on one device
#
# `blockwise_attention` is exact: an online softmax over blocks that never builds the `T x S`
# matrix, skips blocks the mask hides, and has a memory-linear custom VJP. Every fast path is
# checked against the dense float32 `attention_reference`.

# %%
B, T, N, K, H = 1, (512 if SMALL else 4096), 8, 2, 64  # GQA: 8 query heads share 2 kv heads
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(kq, (B, T, N, H))
k = jax.random.normal(kk, (B, T, K, H))
v = jax.random.normal(kv, (B, T, K, H))

fast = jax.jit(lambda q, k, v: ringattn.blockwise_attention(q, k, v, causal=True))
out = fast(q, k, v).block_until_ready()
start = time.perf_counter()
out = fast(q, k, v).block_until_ready()
elapsed = time.perf_counter() - start
want = ringattn.attention_reference(q, k, v, causal=True)
err_fwd = float(jnp.max(jnp.abs(out - want)))


def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v, causal=True) ** 2)


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
o1, l1 = ringattn.blockwise_attention(q, k[:, :half], v[:, :half], return_lse=True)
o2, l2 = ringattn.blockwise_attention(
    q,
    k[:, half:],
    v[:, half:],
    return_lse=True,
    kv_positions=jnp.arange(half, T, dtype=jnp.int32)[None],
)
merged, _ = ringattn.merge_attention(o1, l1, o2, l2)
err_merge = float(jnp.max(jnp.abs(merged - ringattn.attention_reference(q, k, v))))
print(f"merge of two halves vs full attention: max |err| {err_merge:.1e}")
assert err_merge < 1e-5

# %% [markdown]
# ## Summary

# %%
summary = {
    "blockwise forward error": err_fwd,
    "blockwise gradient error": err_grad,
    "merge error": err_merge,
}
for name, value in summary.items():
    print(f"{name:>32}: {value:.2e}")
