"""Decode tokens/s of the example model: the paged decode loop vs a contiguous KV cache vs recompute.

Rerun from the repository root:
        python -m benchmarks.bench_decode            (contexts 2K and 32K; minutes idle, most
                                             of it the 32K prefills and dense forwards)
        python -m benchmarks.bench_decode --quick    (contexts 512 and 2K, about a minute idle)
        python -m benchmarks.bench_decode --contexts 2048,8192,32768 --new-tokens 128

One sequence (batch 1) of the committed checkpoint (``examples/longctx_lm/checkpoint``,
``train.load_checkpoint``; ``--random-weights``: a fresh ``ModelConfig()`` model; the time of
a step does not depend on the weights), greedy decoding after a passkey prompt of
``context`` tokens, one CPU device, float32. Three methods, the same weights and the model's
own layers (``embed_inputs``, ``block.attn.project`` / ``output``, ``block.mlp``,
``logits``, as ``generate._cached_forward`` uses them):

* ``paged``: the example's server, ``generate.Server``: chunked prefill into a paged pool,
  then the jitted decode loop ``generate._decode`` (``lax.fori_loop``; per token
  ``paged.ensure_next_page``, ``paged.write_layer``, ``paged.paged_attention``). Timed: the
  decode loop alone, called exactly as ``Server.generate`` calls it: ``generate._decode`` is
  wrapped for one ``Server.generate`` call to record its arguments (the post-prefill cache,
  the free-page stack, the first token), and the recorded call is then re-run (the arrays are
  immutable, so every run decodes the same tokens from the same state). Prefill is not
  timed.
* ``contiguous``: the baseline. A jitted ``fori_loop`` in this file keeps K/V in
  ``[L, B, S_max, K, H]`` arrays, writes each token's K/V with ``lax.dynamic_update_slice``
  and attends with ``ringattn.blockwise_attention`` (one query, explicit positions, causal:
  the slots past the token are hidden and their blocks skipped). Prefill (one blockwise
  forward over the prompt writing the caches) is not timed.
* ``contiguous heads-major einsum``: the same loop on ``[L, B, K, S_max, H]`` caches with a
  plain masked einsum / softmax / einsum over all ``S_max`` slots (``bench_paged``'s
  contiguous kernel). ``blockwise_attention`` works heads-major inside, so on the
  token-major cache it relayouts the cache every call; this row shows what that costs.
* ``dense recompute``: no cache. Every token re-runs the whole model over the sequence
  (``generate.generate_dense``'s method) with ``attention.blockwise()`` (``dense()`` would
  need ``T x T`` memory at 32K), on a fixed ``S_max`` buffer so one compile serves every
  step (causality keeps the padding out of the real tokens). Timed: a host loop of a few
  tokens (``--dense-tokens``, default 8, 2 above 4K, 1 above 8K; each is a full forward).

Before timing, the script checks once, at a 64-token prompt, that the four methods and
``generate.generate_dense`` with ``attention.dense()`` emit the same greedy tokens.
Reported: tokens/s per method and context (median of ``--repeats`` interleaved runs after a
warm-up run; best next to it) and the ratio to contiguous (above 1 is faster).
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import _common

CHECKPOINT = "examples/longctx_lm/checkpoint"
HEADS_MAJOR = "contiguous heads-major einsum"
METHODS = ("contiguous", HEADS_MAJOR, "paged", "dense recompute")
BASELINE = "contiguous"
PAGE_SIZE = 16
CHUNK = 256


def load_model(random_weights: bool = False):
    from examples.longctx_lm import train
    from examples.longctx_lm.model import ModelConfig

    if random_weights:
        model = train.init_model(ModelConfig(), 0)
        return model, "random weights (`train.init_model(ModelConfig(), 0)`)"
    model, meta = train.load_checkpoint(CHECKPOINT)
    step = meta["history"][-1]["step"] if meta.get("history") else "?"
    return model, f"the committed checkpoint (`{CHECKPOINT}`, step {step})"


def make_prompt(context: int, seed: int = 0) -> np.ndarray:
    """A passkey prompt of ``context`` tokens (the sample up to its answer is irrelevant for
    timing; the check uses it as is)."""
    from examples.longctx_lm import data

    batch = data.make_batch(data.TaskConfig("passkey", length=context), 1, seed)
    return np.asarray(batch.tokens[0])


def s_max(context: int, new_tokens: int) -> int:
    """Cache / buffer length: prompt + new tokens, rounded up to 128."""
    return -(-(context + new_tokens) // 128) * 128


# ------------------------------------------------------------------------------------------
# (a) paged: generate.Server, with its decode loop captured
# ------------------------------------------------------------------------------------------
def paged_decode(model, prompt: np.ndarray, new_tokens: int):
    """``(tokens, rerun)``: ``Server.generate``'s tokens, and a zero-argument re-run of the
    decode loop exactly as it called it (the same arguments, ``new_tokens`` steps)."""
    from examples.longctx_lm import generate

    max_len = len(prompt) + new_tokens
    pages = -(-(max_len + CHUNK) // PAGE_SIZE) + 2
    server = generate.Server(
        model, num_pages=pages, page_size=PAGE_SIZE, max_len=max_len, batch=1, chunk=CHUNK
    )
    real, recorded = generate._decode, []

    def recording(*args, **kwargs):
        recorded.append((args, kwargs))
        return real(*args, **kwargs)

    generate._decode = recording
    try:
        (tokens,) = server.generate([prompt], new_tokens)
    finally:
        generate._decode = real
    ((args, kwargs),) = recorded

    def rerun():
        return real(*args, **kwargs)[0]

    return np.asarray(tokens), rerun


# ------------------------------------------------------------------------------------------
# (c) contiguous KV cache
# ------------------------------------------------------------------------------------------
def _contiguous_attend(q, k, v, q_pos):
    """One decode query ``q [B, 1, N, H]`` at ``q_pos [B, 1]`` against ``k, v [B, S, K, H]``
    holding keys at positions ``0..S-1`` (causal: slots past ``q_pos`` are hidden)."""
    import ringattn

    B, S = k.shape[:2]
    kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    pos = ringattn.Positions(q_pos, kv_pos)
    return ringattn.blockwise_attention(q, k, v, causal=True, positions=pos).out


def _heads_major_attend(q, k, v, q_pos):
    """The same attention on a heads-major cache ``k, v [B, K, S, H]``: a masked einsum /
    softmax / einsum over all ``S`` slots (no blocks, no transposes; as in bench_paged)."""
    B, _, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, K, N // K, H)
    s = jnp.einsum("bkgh,bksh->bkgs", qg, k, preferred_element_type=jnp.float32) / np.sqrt(H)
    visible = jnp.arange(S, dtype=jnp.int32)[None, :] <= q_pos  # [B, S]
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bkgs,bksh->bkgh", p.astype(v.dtype), v)
    return out.reshape(B, 1, N, H)


def _to_cache(x, heads_major: bool):
    """``[B, T, K, H]`` -> the cache's layout (``[B, K, T, H]`` when heads-major)."""
    return jnp.swapaxes(x, 1, 2) if heads_major else x


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def contiguous_prefill(graphdef, state, tokens, S: int, heads_major: bool = False):
    """K/V caches ``[L, B, S, K, H]`` (heads-major: ``[L, B, K, S, H]``) of ``tokens [B, T]``
    (positions ``0..T-1``, ``T <= S``)."""
    from examples.longctx_lm.attention import blockwise
    from examples.longctx_lm.model import previous_tokens

    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    K, H = cfg.num_kv_heads, cfg.head_dim
    shape = (cfg.num_layers, B, K, S, H) if heads_major else (cfg.num_layers, B, S, K, H)
    kc, vc = jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)
    attend = blockwise()
    x = model.embed_inputs(tokens, previous_tokens(tokens))
    for layer, block in enumerate(model.blocks):
        q, k, v = block.attn.project(block.attn_norm(x), positions)
        at = (layer, 0, 0, 0, 0)
        kc = jax.lax.dynamic_update_slice(kc, _to_cache(k, heads_major)[None], at)
        vc = jax.lax.dynamic_update_slice(vc, _to_cache(v, heads_major)[None], at)
        x = x + block.attn.output(attend(q, k, v, positions))
        x = x + block.mlp(block.mlp_norm(x))
    return kc, vc


@functools.partial(jax.jit, static_argnums=(0, 7, 8))
def contiguous_decode(graphdef, state, kc, vc, length, token, prev, steps: int,
                      heads_major: bool = False):  # fmt: skip
    """``steps`` greedy tokens ``[B, steps]`` from caches holding ``length [B]`` tokens;
    ``token`` / ``prev [B]``: the token at position ``length`` and the one before it.
    ``heads_major``: ``[L, B, K, S, H]`` caches and the einsum attention, else
    ``[L, B, S, K, H]`` and ``ringattn.blockwise_attention``."""
    model = nnx.merge(graphdef, state)
    B = token.shape[0]

    def step(i, carry):
        kc, vc, length, token, prev, out = carry
        positions = length[:, None]  # [B, 1]
        x = model.embed_inputs(token[:, None], prev[:, None])
        for layer, block in enumerate(model.blocks):
            q, k, v = block.attn.project(block.attn_norm(x), positions)
            # One position for every row (rows decode in lockstep from the same length here;
            # a ragged batch would scatter per row instead).
            at = (layer, 0, 0, length[0], 0) if heads_major else (layer, 0, length[0], 0, 0)
            kc = jax.lax.dynamic_update_slice(kc, _to_cache(k, heads_major)[None], at)
            vc = jax.lax.dynamic_update_slice(vc, _to_cache(v, heads_major)[None], at)
            attend = _heads_major_attend if heads_major else _contiguous_attend
            x = x + block.attn.output(attend(q, kc[layer], vc[layer], positions))
            x = x + block.mlp(block.mlp_norm(x))
        nxt = jnp.argmax(model.logits(x)[:, -1], axis=-1).astype(jnp.int32)
        return kc, vc, length + 1, nxt, token, out.at[:, i].set(nxt)

    out = jnp.zeros((B, steps), jnp.int32)
    carry = (kc, vc, length, token, prev, out)
    return jax.lax.fori_loop(0, steps, step, carry)[-1]


def contiguous(model, prompt: np.ndarray, new_tokens: int, *, heads_major: bool = False):
    """``(tokens, rerun)`` of the contiguous-cache decode (prefill done once, untimed)."""
    graphdef, state = nnx.split(model)
    S = s_max(len(prompt), new_tokens)
    # Prefill all but the last prompt token (as Server does): its logits give the first token.
    head = jnp.asarray(prompt[None, :-1], jnp.int32)
    kc, vc = jax.block_until_ready(contiguous_prefill(graphdef, state, head, S, heads_major))
    length = jnp.asarray([len(prompt) - 1], jnp.int32)
    token = jnp.asarray(prompt[None, -1], jnp.int32)
    prev = jnp.asarray(prompt[None, -2], jnp.int32)

    def rerun():
        return contiguous_decode(
            graphdef, state, kc, vc, length, token, prev, new_tokens, heads_major
        )

    return np.asarray(rerun()[0]), rerun


# ------------------------------------------------------------------------------------------
# (b) dense recompute
# ------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def dense_step(graphdef, state, buf, n):
    """Re-runs the model over the whole buffer ``[B, S]`` holding ``n`` real tokens; writes the
    greedy next token at ``n``. Returns ``(buf, token [B])``."""
    from examples.longctx_lm.attention import blockwise

    model = nnx.merge(graphdef, state)
    B, S = buf.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    logits = model(buf, positions, blockwise())
    nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, n - 1, 1, keepdims=False), -1)
    nxt = nxt.astype(jnp.int32)
    return jax.lax.dynamic_update_index_in_dim(buf, nxt[:, None], n, 1), nxt


def dense_recompute(model, prompt: np.ndarray, new_tokens: int):
    """``(tokens, run)``: ``run()`` decodes ``new_tokens`` tokens, one full forward each."""
    graphdef, state = nnx.split(model)
    S = s_max(len(prompt), new_tokens)
    buf0 = np.zeros((1, S), np.int32)
    buf0[0, : len(prompt)] = prompt
    buf0 = jnp.asarray(buf0)

    def run():
        buf, out = buf0, []
        for i in range(new_tokens):
            buf, nxt = dense_step(graphdef, state, buf, len(prompt) + i)
            out.append(nxt)
        return jnp.stack(out, axis=1)

    return np.asarray(run()[0]), run


# ------------------------------------------------------------------------------------------
def check_greedy_agreement(model, context: int = 64, new_tokens: int = 8) -> np.ndarray:
    """The three methods and ``generate_dense(attention.dense())`` emit the same tokens."""
    from examples.longctx_lm import attention, generate

    prompt = make_prompt(context, seed=1)
    want = generate.generate_dense(model, prompt, new_tokens, attention.dense())
    got = {
        "paged": paged_decode(model, prompt, new_tokens)[0],
        "contiguous": contiguous(model, prompt, new_tokens)[0],
        HEADS_MAJOR: contiguous(model, prompt, new_tokens, heads_major=True)[0],
        "dense recompute": dense_recompute(model, prompt, new_tokens)[0],
    }
    bad = {m: t.tolist() for m, t in got.items() if not np.array_equal(t, want)}
    assert not bad, f"bench_decode: greedy tokens differ from generate_dense {want.tolist()}: {bad}"
    return want


def ratio(x: float) -> str:
    """``1.25x``; three significant digits below 0.1 (dense recompute is ~0.001x)."""
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def bench_context(model, context, new_tokens, dense_tokens, repeats):
    prompt = make_prompt(context)
    t0 = time.perf_counter()
    _, runs_c = contiguous(model, prompt, new_tokens)
    _, runs_h = contiguous(model, prompt, new_tokens, heads_major=True)
    _, runs_p = paged_decode(model, prompt, new_tokens)
    _, runs_d = dense_recompute(model, prompt, dense_tokens)
    print(f"  {context}: set-up (prefills, compiles) {time.perf_counter() - t0:.1f} s", flush=True)
    fns = {"contiguous": runs_c, HEADS_MAJOR: runs_h, "paged": runs_p, "dense recompute": runs_d}
    timing = _common.time_interleaved(fns, repeats=repeats)
    tokens = {m: dense_tokens if m == "dense recompute" else new_tokens for m in METHODS}
    return timing, tokens


def main(argv=None):
    parser = _common.make_parser(__doc__)
    parser.add_argument("--contexts", type=str, default=None, help="e.g. 2048,32768")
    parser.add_argument("--new-tokens", type=int, default=None, help="paged / contiguous steps")
    parser.add_argument(
        "--dense-tokens", type=str, default=None,
        help="dense-recompute tokens per context, one int or one per context",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--random-weights", action="store_true")
    args = parser.parse_args(argv)
    run = _common.start_run("bench_decode", args, cpu_devices=1, argv=argv)

    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    else:
        contexts = [512, 2048] if args.quick else [2048, 32768]
    new_tokens = args.new_tokens or (16 if args.quick else 64)
    if args.dense_tokens:
        dense = [int(x) for x in args.dense_tokens.split(",")]
        dense = dense * len(contexts) if len(dense) == 1 else dense
    else:
        dense = [1 if c > 8192 else 2 if c > 4096 else 4 if args.quick else 8 for c in contexts]
    repeats = args.repeats or (2 if args.quick else 3)

    t0 = time.perf_counter()
    model, weights = load_model(args.random_weights)
    check = check_greedy_agreement(model)
    print(f"greedy tokens agree at a 64-token prompt: {check.tolist()}", flush=True)
    cfg = model.cfg
    lines = [
        f"Model: {weights}; width {cfg.width}, {cfg.num_layers} layers, N={cfg.num_heads}, "
        f"K={cfg.num_kv_heads}, H={cfg.head_dim}, float32, one CPU device (2 cores shared "
        "with other jobs). One sequence (batch 1), greedy, after a passkey prompt of "
        f"`context` tokens. Paged: `generate.Server` (page size {PAGE_SIZE}, prefill chunk "
        f"{CHUNK}), its decode loop `generate._decode` re-run with the arguments "
        "`Server.generate` passed it; contiguous: `[L, B, S_max, K, H]` caches, "
        "`dynamic_update_slice`, `ringattn.blockwise_attention` with one query and explicit "
        "positions (the baseline); heads-major einsum: the same loop on `[L, B, K, S_max, H]` "
        "caches with a masked einsum / softmax / einsum over every slot; dense recompute: a full `attention.blockwise()` forward over the sequence "
        "per token. Prefill is not timed. Median (best) of "
        f"{repeats} interleaved runs after a warm-up run; a run of paged / contiguous is "
        f"{new_tokens} tokens in one jitted loop, a run of dense recompute the number of "
        "tokens in the table (host loop, one forward each).",
        "",
        "Correctness, checked first: at a 64-token prompt all four methods emit the same 8 "
        f"greedy tokens as `generate.generate_dense(..., attention.dense())`: {check.tolist()}.",
        "",
        "| context | method | tokens per run | tokens/s (median) | tokens/s (best) "
        "| ms / token | vs contiguous |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for context, d in zip(contexts, dense, strict=True):
        timing, tokens = bench_context(model, context, new_tokens, d, repeats)
        rate = {m: tokens[m] / timing[m].median for m in METHODS}
        for m in METHODS:
            row = (
                f"| {context} | {m} | {tokens[m]} | {rate[m]:,.1f} "
                f"| {tokens[m] / timing[m].best:,.1f} | {timing[m].median / tokens[m] * 1e3:.2f} "
                f"| {ratio(rate[m] / rate[BASELINE])} |"
            )
            lines.append(row)
            print(row, flush=True)
    lines += [
        "",
        "vs contiguous = tokens/s / the contiguous cache's tokens/s (same run, medians; above "
        "1 is faster). The paged loop also takes a page from the on-device free stack when a "
        "sequence crosses a page boundary; the contiguous loop's cache is preallocated to "
        "`S_max` (prompt + new tokens, rounded up to 128).",
        "",
        f"Total benchmark time: {time.perf_counter() - t0:.0f} s.",
    ]
    run.write("Decode of the example model: paged loop vs contiguous cache vs recompute", lines)


if __name__ == "__main__":
    main()
