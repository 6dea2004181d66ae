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
# # The long-context LM: load the checkpoint, generate from a paged / offloaded cache, sweep budgets
#
# `examples/longctx_lm` is a small Llama-style model (400k parameters) trained on passkey
# retrieval and associative recall up to 1024 tokens; its checkpoint is committed. This
# notebook loads it, decodes greedily from a paged KV cache (`generate.Server`: prefix caching
# across calls, a jitted decode loop), demotes most prompt pages to pinned host memory and
# checks the result is unchanged, and sweeps retention budgets (how much of the prompt stays
# on the device) for several policies. `NOTEBOOK_SCALE=small` uses shorter prompts and fewer
# of them; `NOTEBOOK_RESULTS=path.json` writes the numbers (and the plot beside them).
#
# `examples/` and the checkpoint live in the repository, not in the wheel: run this notebook
# from a clone (on Colab the second cell clones the repository).
#
# On Colab, run the first code cell: it installs the library (`%pip`; the tests and CI skip
# it). From a clone with the `[notebooks]` extra installed, skip it.

# %% tags=["skip-execution"]
# %pip install -q "jax-longctx[notebooks] @ git+https://github.com/jax-longctx/jax-longctx"

# %%
import importlib.util
import os
import sys

if "google.colab" in sys.modules and importlib.util.find_spec("examples") is None:
    # The example model and its checkpoint are in the repository: clone it and work there.
    import subprocess

    REPOSITORY = "https://github.com/jax-longctx/jax-longctx"  # pyproject.toml [project.urls]
    if not os.path.isdir("jax-longctx"):
        subprocess.run(["git", "clone", "--depth", "1", REPOSITORY, "jax-longctx"], check=True)
    os.chdir("jax-longctx")  # the kernel imports from its working directory
elif importlib.util.find_spec("examples") is None and os.path.isdir("../examples"):
    os.chdir("..")  # Jupyter started in notebooks/ of a clone: work from the repository root

# %%
import jax

# 8 emulated CPU devices (as in the other notebooks): before JAX creates any array.
jax.config.update("jax_num_cpu_devices", 8)

from offload.serving import enable_compilation_cache

# Compiled programs are kept on disk (offload.serving.default_compilation_cache_dir()): a rerun
# starts sooner; JAX_LONGCTX_NO_COMPILATION_CACHE=1 turns that off.
enable_compilation_cache()

import json
import pathlib
import time

import matplotlib
import numpy as np

if "ipykernel" not in sys.modules:  # a script or a test: draw to files, not to a window
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm.auto import tqdm

import examples.longctx_lm
import offload
from examples.longctx_lm import attention, data, generate, train

SMALL = os.environ.get("NOTEBOOK_SCALE", "") == "small"
RESULTS = os.environ.get("NOTEBOOK_RESULTS")
print("devices:", len(jax.devices()), jax.devices()[0].platform, "| jax", jax.__version__)

# %% [markdown]
# ## 1. Load the committed checkpoint
#
# Orbax restores the parameters; `config.json` holds the model's configuration and its
# training history (accuracy on fresh samples every 100 steps).

# %%
CHECKPOINT = pathlib.Path(examples.longctx_lm.__file__).parent / "checkpoint"
t0 = time.perf_counter()
model, meta = train.load_checkpoint(str(CHECKPOINT))
print(f"loaded {CHECKPOINT.name} in {time.perf_counter() - t0:.1f} s: {meta['model']}")
last = meta["history"][-1]
print(
    f"step {last['step']}, trained at {last['context']} tokens: passkey {last['passkey']:.0%}, "
    f"recall {last['recall']:.0%} (32 fresh samples each)"
)

LENGTH = 256 if SMALL else 1024  # prompt tokens
SAMPLES = 4 if SMALL else 8
BATCH = 4
KEY_LEN = 8
full_forward = {
    task: train.evaluate(model, task, LENGTH, SAMPLES, 11, attention.blockwise())
    for task in data.TASKS
}
print(f"teacher-forced accuracy at {LENGTH} tokens, {SAMPLES} fresh samples: {full_forward}")

# %% [markdown]
# ## 2. Generate from a paged KV cache
#
# Passkey prompts end at the question; the model must emit the 8 digits it saw at a random
# depth. `Server.generate` prefills the prompts into pages (chunked, attending with
# `paged.ragged_paged_attention`), then decodes all rows in one jitted loop. The first prompt
# is also decoded by the oracle that recomputes the whole sequence every step (its first 4
# tokens at the small size: one compilation per length): the tokens must agree. A second
# call with the same prompts finds their pages in the prefix cache.

# %%
cfg = data.TaskConfig("passkey", length=LENGTH + 1, key_len=KEY_LEN)
tokens = data.make_batch(cfg, SAMPLES, 2024).tokens
prompts, answers = tokens[:, :-KEY_LEN], tokens[:, -KEY_LEN:]
C = 16


def make_server():
    pages = SAMPLES * (-(-(LENGTH + 64) // C) + 4) + 8  # room to cache every prompt
    return generate.Server(
        model, num_pages=pages, page_size=C, max_len=LENGTH + 32, batch=BATCH, chunk=256
    )


def run(server, retention=None, salt=None):
    """Greedy answers for every prompt, in batches of BATCH: ``[SAMPLES, KEY_LEN]``."""
    out = []
    for start in range(0, SAMPLES, BATCH):
        rows = list(prompts[start : start + BATCH])
        out += server.generate(rows, KEY_LEN, retention=retention, salt=salt)
    return np.stack(out)


server = make_server()
t0 = time.perf_counter()
paged_out = run(server)
first_seconds = time.perf_counter() - t0
t0 = time.perf_counter()
again = run(server)
second_seconds = time.perf_counter() - t0
hit_rate = server.allocator.stats().prefix_hit_rate
ORACLE_TOKENS = 4 if SMALL else KEY_LEN  # greedy decoding: a prefix of the same answer
oracle = generate.generate_dense(model, prompts[0], ORACLE_TOKENS, attention.blockwise())
paged_accuracy = float(np.mean((paged_out == answers).all(1)))
print(
    f"paged decode: {paged_accuracy:.0%} of {SAMPLES} passkeys exact ({first_seconds:.1f} s "
    f"with compilation); again with the prefix cache: {second_seconds:.1f} s, prefix hit rate "
    f"over both calls {hit_rate:.0%}"
)
print("prompt 0: answer", answers[0], "| paged", paged_out[0], "| oracle", oracle)
assert (oracle == paged_out[0, :ORACLE_TOKENS]).all() and (again == paged_out).all()

# %% [markdown]
# ## 3. Offload most of the prompt to pinned host memory
#
# After prefill, SnapKV keeps 10% of each prompt's pages on the device (ranked by the
# attention of the last 16 prompt queries); `mode="demote"` copies the others to pinned host
# memory with an `offload.OffloadManager`, fetches them back into a cold pool and decodes
# with `offload.mixed_residency_attention`: the answers must be those of the full cache.
# `mode="drop"` never reads them again (the approximation the budget sweep measures).

# %%
snapkv = offload.RetentionPolicy(
    "snapkv", 0.1, page_size=C, recent=1, pool_size=3, head_reduce="max"
)
demoted = run(server, generate.Retention(snapkv, mode="demote", scrub=True), salt="demote")
info = server.last_info
print(
    f"demote: {info.kept_pages.tolist()} of {info.prompt_pages.tolist()} prompt pages on "
    f"device, {info.moved_bytes:,} bytes to host and back; answers equal to the full "
    f"cache's: {bool((demoted == paged_out).all())}"
)
assert (demoted == paged_out).all()

# %% [markdown]
# ## 4. Retention budget sweep
#
# Each policy keeps a fraction of the prompt's pages (the page the decode writes into always
# stays) and drops the rest. Two numbers per point: exact-match accuracy against the true
# passkey, and agreement with the full cache's answers. Every call uses its own salt, so no
# request reuses another's pages: each prefill observes the whole prompt (H2O's accumulated
# mass). `benchmarks/bench_quality.py` runs the full version (more policies, depths, samples).

# %%
POLICIES = {
    "recency": {},
    "streaming": {"sink": 1},
    "h2o": {"sink": 1, "recent": 1},
    "snapkv": {"recent": 1, "pool_size": 3, "head_reduce": "max"},
}
if SMALL:
    POLICIES = {kind: POLICIES[kind] for kind in ("recency", "snapkv")}
BUDGETS = (0.1, 0.5) if SMALL else (0.05, 0.1, 0.2, 0.5)
accuracy = {kind: [] for kind in POLICIES}
agreement = {kind: [] for kind in POLICIES}
sweep = [(kind, budget) for kind in POLICIES for budget in BUDGETS]
for kind, budget in tqdm(sweep, desc="budget sweep"):
    policy = offload.RetentionPolicy(kind, budget, page_size=C, **POLICIES[kind])
    got = run(server, generate.Retention(policy, mode="drop"), salt=f"{kind}-{budget}")
    accuracy[kind].append(float(np.mean((got == answers).all(1))))
    agreement[kind].append(float(np.mean((got == paged_out).all(1))))
print(f"{'policy':>10} | " + " | ".join(f"{b:>9.0%}" for b in BUDGETS) + " |   100%")
for kind in POLICIES:
    cells = " | ".join(
        f"{a:4.0%} {g:4.0%}" for a, g in zip(accuracy[kind], agreement[kind], strict=True)
    )
    print(f"{kind:>10} | {cells} | {paged_accuracy:4.0%}")
print("(cells: accuracy vs the passkey, agreement with the full cache)")

fig, ax = plt.subplots(figsize=(5.5, 3.5))
for kind in POLICIES:
    ax.plot(
        [*BUDGETS, 1.0],
        [100 * a for a in accuracy[kind]] + [100 * paged_accuracy],
        "o-",
        label=kind,
    )
ax.set_xscale("log")
ax.set_xticks([*BUDGETS, 1.0], [f"{b:.0%}" for b in [*BUDGETS, 1.0]])
ax.set_xlabel("budget (fraction of prompt pages on device)")
ax.set_ylabel("passkey exact match (%)")
ax.set_title(f"{SAMPLES} passkey prompts of {LENGTH} tokens")
ax.legend(fontsize=8)
fig.tight_layout()
if RESULTS:
    fig.savefig(os.path.join(os.path.dirname(os.path.abspath(RESULTS)), "long_context_lm.png"))
plt.show()

# %% [markdown]
# ## Summary
#
# With `NOTEBOOK_RESULTS=path.json` the numbers go there (the test suite checks them).

# %%
summary = {
    "length": LENGTH,
    "prompt tokens": int(prompts.shape[1]),
    "page size": C,
    "samples": SAMPLES,
    "teacher-forced accuracy": full_forward,
    "paged accuracy": paged_accuracy,
    "oracle agrees": bool((oracle == paged_out[0, :ORACLE_TOKENS]).all()),
    "oracle tokens": ORACLE_TOKENS,
    "second call agrees": bool((again == paged_out).all()),
    "prefix hit rate": hit_rate,
    "demote agrees": bool((demoted == paged_out).all()),
    "demote kept pages": info.kept_pages.tolist(),
    "demote prompt pages": info.prompt_pages.tolist(),
    "demote moved bytes": info.moved_bytes,
    "budgets": list(BUDGETS),
    "accuracy": accuracy,
    "agreement": agreement,
}
print(json.dumps({k: summary[k] for k in ("paged accuracy", "accuracy", "agreement")}))
if RESULTS:
    with open(RESULTS, "w") as f:
        json.dump(summary, f, indent=2)
