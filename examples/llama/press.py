"""Prefill once, compress the cached KV with a press, answer: kvpress's loop on jax-longctx.

kvpress (NVIDIA's PyTorch library of KV-cache compression "presses") prefills the context,
lets a press remove a fraction of the cached KV, then answers the question from what is left.
This module does the same over the library's paged cache, for one sequence at a time, and
adds what kvpress has no counterpart for: the removed pages are actually freed (the kept pages
are gathered into a smaller pool, whose bytes are measured from the arrays), or demoted to
pinned host memory with exact fetch-back; the pages may be quantized (int8 / fp8 / int4 /
kivi2); and the page size is a knob (1 = token granularity).

1. :func:`prefill` runs the prompt through the model once, ``chunk`` tokens at a time
   (``paged.write_layer`` + ``paged.ragged_paged_attention``), writing every layer's K/V into
   a fresh paged cache, and observes the attention the retention policies are fed: the page
   mass summed over every prompt query (H2O) and, for the last ``window`` queries one by one,
   their page masses (SnapKV's observation window, TOVA's last query, Scissorhands' steps).
2. :func:`select_pages` turns an ``offload.RetentionPolicy`` (or any rule) into ``keep [M]``.
3. :func:`answer` applies the selection and continues: the ``forced`` tokens (the question,
   when the context was compressed before it: kvpress's question-agnostic mode) and then
   ``max_new`` greedy tokens, all in one jitted program per shape.

Shapes: ``M`` page-table slots (``capacity / C``), ``N`` query heads, ``W`` window.
"""

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import offload
import paged
from examples.llama.model import Llama

__all__ = ["Answer", "Prefilled", "answer", "prefill", "pool_bytes", "select_pages"]


class Prefilled(NamedTuple):
    """A prompt in the cache, with what the policies observe.

    Attributes:
      cache: ``paged.PagedKVCache``, one row; slot ``j`` of its table holds page ``j + 1``.
      prompt_mass: ``[N, M]`` float32 attention probability per page, summed over every
        prompt query and layer.
      window_mass: ``[W, N, M]`` float32 the same for each of the last ``W`` queries.
      length: tokens in the cache.
      seconds: wall time of the prefill (time to first token, without the answer).
    """

    cache: paged.PagedKVCache
    prompt_mass: jax.Array
    window_mass: jax.Array
    length: int
    seconds: float


class Answer(NamedTuple):
    """What :func:`answer` produced and what it cost.

    Attributes:
      tokens: ``[max_new]`` int32 greedy tokens.
      kept_pages: prompt pages read from the device.
      live_pages: prompt pages before the press.
      device_bytes: bytes of the device pools the answer read (kept + new pages, measured
        from the arrays; the full pool's bytes when nothing was freed).
      full_bytes: bytes of the pools before the press.
      moved_bytes: bytes copied to host and back (``mode="demote"``).
      seconds: wall time of the answer (forced tokens + ``max_new`` decode steps).
    """

    tokens: np.ndarray
    kept_pages: int
    live_pages: int
    device_bytes: int
    full_bytes: int
    moved_bytes: int
    seconds: float


def pool_bytes(*pools) -> int:
    """Bytes of page pools (float arrays or ``paged.QuantizedPages``), from their arrays."""
    return int(sum(leaf.nbytes for pool in pools for leaf in jax.tree.leaves(pool)))


def _forward(model: Llama, cache, tokens, positions, attend, count=None):
    """The model over ``tokens [B, T]``, each layer's K/V written first (``count`` real tokens
    per row); ``attend(q, cache, layer) -> (out, page_mass | None)``. Returns
    ``(logits [B, T, V], cache, mass summed over layers)``."""
    x = model.embed_inputs(tokens)
    mass = 0.0
    for layer, block in enumerate(model.blocks):
        q, k, v = block.attn.project(block.attn_norm(x), positions)
        cache = paged.write_layer(cache, layer, k, v, positions[:, 0], count=count)
        out, m = attend(q, cache, layer)
        mass = mass + (0.0 if m is None else m)
        x = x + block.attn.output(out)
        x = x + block.mlp(block.mlp_norm(x))
    return model.logits(x), cache, mass


@functools.partial(jax.jit, static_argnums=(0, 5))
def _prefill_chunk(graphdef, state, cache, tokens, start, per_query: bool, n):
    """``tokens [1, T]`` at positions ``start ...``, ``n`` of them real. Returns
    ``(cache, mass)``: ``[N, M]`` summed over the queries, or ``[T, N, M]`` per query."""
    model = nnx.merge(graphdef, state)
    T = tokens.shape[1]
    positions = start + jnp.arange(T, dtype=jnp.int32)[None]
    if per_query:  # every query its own sequence on the row's table: one mass per query
        table = jnp.repeat(cache.page_table, T, axis=0)
        lengths = start + jnp.arange(T, dtype=jnp.int32) + 1
        cu, num = jnp.arange(T + 1, dtype=jnp.int32), n
    else:
        table, lengths = cache.page_table, (start + n)[None]
        cu, num = jnp.stack([0, n]).astype(jnp.int32), 1

    def attend(q, cache, layer):
        res = paged.ragged_paged_attention(
            q[0], cache.k_pages[layer], cache.v_pages[layer], table, lengths, cu, num,
            return_page_mass=True,
        )  # fmt: skip
        valid = (jnp.arange(T) < n)[:, None, None]
        mass = jnp.where(valid, res.page_mass, 0.0) if per_query else res.page_mass[0]
        return res.out[None], mass

    _, cache, mass = _forward(model, cache, tokens, positions, attend, count=n[None])
    return cache, mass


def prefill(model: Llama, ids: Sequence[int], *, capacity: int, page_size: int = 16,
            window: int = 32, chunk: int = 256,
            kv_format: paged.KVFormat | None = None) -> Prefilled:  # fmt: skip
    """Prefills ``ids`` into a fresh one-row cache of ``capacity`` tokens (prompt + anything
    to come), observing the last ``window`` queries one by one."""
    ids = np.asarray(ids, np.int32)
    n = len(ids)
    if n < 1 or n >= capacity:
        raise ValueError(f"prefill: ids: expected 1..{capacity - 1} tokens, got {n}")
    if not 1 <= window <= n:
        raise ValueError(f"prefill: window: expected 1..{n} (the prompt's length), got {window}")
    cfg, C = model.cfg, page_size
    M = -(-capacity // C)
    cache = paged.init_paged_cache(cfg.num_layers, cfg.num_kv_heads, M + 1, C, cfg.head_dim,
                                   batch=1, max_pages_per_seq=M, kv_format=kv_format)  # fmt: skip
    cache = paged.with_page_table(cache, np.arange(1, M + 1, dtype=np.int32)[None], np.zeros(1, np.int32))  # fmt: skip
    graphdef, state = nnx.split(model)
    padded = np.zeros(n + chunk + window, np.int32)
    padded[:n] = ids
    t0 = time.perf_counter()
    mass, pos = 0.0, 0
    while pos < n - window:
        m = min(chunk, n - window - pos)
        cache, add = _prefill_chunk(graphdef, state, cache, jnp.asarray(padded[None, pos : pos + chunk]), jnp.int32(pos), False, jnp.int32(m))  # fmt: skip
        mass, pos = mass + add, pos + m
    cache, win = _prefill_chunk(graphdef, state, cache, jnp.asarray(padded[None, pos : pos + window]), jnp.int32(pos), True, jnp.int32(window))  # fmt: skip
    mass = mass + win.sum(0)
    cache = paged.with_page_table(cache, cache.page_table, np.array([n], np.int32))
    jax.block_until_ready(cache)
    seconds = time.perf_counter() - t0
    return Prefilled(cache, mass, win, n, seconds)


def select_pages(pre: Prefilled, policy: offload.RetentionPolicy) -> np.ndarray:
    """``keep [M]`` bool from an ``offload.RetentionPolicy`` of page granularity, fed as the
    policies are meant to be: H2O the accumulated mass, SnapKV the window's summed mass, TOVA
    its last query, Scissorhands each window query in turn (recency and streaming need none).
    """
    if not isinstance(policy, offload.RetentionPolicy) or policy.granularity != "page":
        raise ValueError(f"select_pages: policy: expected a page RetentionPolicy, got {policy!r}")  # fmt: skip
    if policy.page_size != pre.cache.page_size:
        raise ValueError(f"select_pages: policy.page_size: expected {pre.cache.page_size}, got {policy.page_size}")  # fmt: skip
    M = pre.cache.page_table.shape[1]
    state = offload.init_policy_state(1, M, policy=policy)
    update = functools.partial(offload.update_policy_state, policy=policy)
    if policy.kind == "h2o":
        state = update(state, pre.prompt_mass[None])
    elif policy.kind == "snapkv":
        state = update(state, pre.window_mass.sum(0)[None])
    elif policy.kind == "tova":
        state = update(state, pre.window_mass[-1][None])
    elif policy.kind == "scissorhands":
        for w in range(pre.window_mass.shape[0]):
            state = update(state, pre.window_mass[w][None])
    sel = offload.select_keep(state, pre.cache.lengths, policy=policy, page_table=pre.cache.page_table)  # fmt: skip
    return np.asarray(sel.keep[0])


@functools.partial(jax.jit, static_argnums=(0, 8))
def _answer(graphdef, state, cache, table, forced, n_forced, start, cold, max_new: int):
    """``forced [1, T]`` (``n_forced`` real) at ``start``, then ``max_new`` greedy tokens;
    attention reads ``table`` (0 = absent) and, with ``cold = (cold_table, k, v)``, the cold
    pool. Returns ``tokens [max_new]``."""
    model = nnx.merge(graphdef, state)

    def attend_fn(lengths, q_positions):
        def attend(q, cache, layer):
            k, v = cache.k_pages[layer], cache.v_pages[layer]
            if cold is None:
                res = paged.paged_attention(q, k, v, table, lengths, q_positions=q_positions)
            else:
                res = offload.mixed_residency_attention(
                    q, k, v, table, lengths, cold_table=cold[0], cold_k_pages=cold[1][layer],
                    cold_v_pages=cold[2][layer], q_positions=q_positions,
                )  # fmt: skip
            return res.out, None

        return attend

    T = forced.shape[1]
    positions = start + jnp.arange(T, dtype=jnp.int32)[None]
    end = start + n_forced
    logits, cache, _ = _forward(model, cache, forced, positions, attend_fn(end[None], positions), count=n_forced[None])  # fmt: skip
    first = jnp.argmax(logits[0, n_forced - 1]).astype(jnp.int32)

    def step(i, carry):
        cache, token, out = carry
        pos = (end + i)[None, None]
        logits, cache, _ = _forward(model, cache, token[None, None], pos, attend_fn(pos[0] + 1, pos))  # fmt: skip
        nxt = jnp.argmax(logits[0, -1]).astype(jnp.int32)
        return cache, nxt, out.at[i].set(token)

    out = jnp.zeros(max_new, jnp.int32)
    _, _, out = jax.lax.fori_loop(0, max_new, step, (cache, first, out))
    return out


def _take_pages(pool, ids: np.ndarray):
    """The pool ``[L, K, P, C, H]`` (or ``QuantizedPages``) restricted to pages ``ids``."""
    if isinstance(pool, paged.QuantizedPages):
        if pool.format.kind == "kivi2":
            raise NotImplementedError("answer: freeing kivi2 pages (their residual window is per row)")  # fmt: skip
        take = lambda a: None if a is None else a[:, :, ids]
        return dataclasses.replace(pool, data=take(pool.data), scale=take(pool.scale), zero=take(pool.zero))  # fmt: skip
    return pool[:, :, ids]


def _bucket(size: int, smallest: int) -> int:
    """A padding multiple for a pool of ``size`` pages: ``smallest``, or 1/8 of the power of
    two below ``size`` (at most 1/8 more pages than needed, a few distinct sizes)."""
    return max(smallest, (1 << max(size.bit_length() - 1, 0)) // 8)


def answer(model: Llama, pre: Prefilled, keep: np.ndarray | None, forced: Sequence[int],
           max_new: int, *, mode: str = "drop", bucket: int = 64,
           page_bucket: int = 8) -> Answer:  # fmt: skip
    """Continues ``pre`` with the ``forced`` tokens, then ``max_new`` greedy tokens, reading
    the prompt pages ``keep [M]`` (None: all) from the device.

    ``mode="drop"``: the other prompt pages are freed: the kept pages and the pages the
    answer writes are gathered into a smaller pool (the device bytes of :class:`Answer`).
    ``mode="demote"``: the other pages are copied to pinned host memory with an
    ``offload.OffloadManager`` and fetched back into a cold pool that the attention reads
    (``offload.mixed_residency_attention``): exact, at the bytes moved. The page holding the
    prompt's last token is where the answer writes: it is always kept. ``forced`` is padded
    to a multiple of ``bucket`` tokens and the pools to a few sizes (at most 1/8 more pages,
    at least ``page_bucket``: fewer compiles; the padding pages count in the device bytes).
    """
    if mode not in ("drop", "demote"):
        raise ValueError(f"answer: mode: expected 'drop' or 'demote', got {mode!r}")
    if max_new < 1:
        raise ValueError(f"answer: max_new: expected >= 1, got {max_new}")
    if not len(forced):
        raise ValueError("answer: forced: expected at least one token (for a query-aware run: the prompt's last token)")  # fmt: skip
    cache, C, n = pre.cache, pre.cache.page_size, pre.length
    M = cache.page_table.shape[1]
    if n + len(forced) + max_new > M * C:
        raise ValueError(f"answer: forced + max_new: {len(forced)} + {max_new} tokens do not fit the capacity {M * C} after {n}")  # fmt: skip
    live_n = -(-n // C)
    live = np.arange(M) < live_n
    keep = live.copy() if keep is None else np.asarray(keep, bool) & live
    if keep.shape != (M,):
        raise ValueError(f"answer: keep: expected [{M}] bool, got shape {keep.shape}")
    if n % C:
        keep[n // C] = True  # the open page: the answer writes into it
    future = np.arange(M) >= live_n
    resident = keep | future  # slots whose pages stay on the device
    full_bytes = pool_bytes(cache.k_pages, cache.v_pages)
    t0 = time.perf_counter()
    moved, cold = 0, None
    absent_ids = np.nonzero(live & ~keep)[0] + 1  # page of slot j is j + 1
    if mode == "demote" and absent_ids.size:
        host = offload.make_host_page_pool(cache.k_pages, cache.v_pages, M + 1)
        manager = offload.OffloadManager(host)
        out = manager.page_out(cache.k_pages, cache.v_pages, absent_ids, request_id="press")
        manager.wait(out)
        n_cold = absent_ids.size + 1
        n_cold += -n_cold % _bucket(n_cold, page_bucket)
        empty = lambda pool: _take_pages(pool, np.zeros(n_cold, np.int32))
        back = manager.page_in(empty(cache.k_pages), empty(cache.v_pages), np.arange(1, absent_ids.size + 1), request_id="press")  # fmt: skip
        cold_k, cold_v = manager.wait(back)
        cold_table = np.zeros((1, M), np.int32)
        cold_table[0, live & ~keep] = np.arange(1, absent_ids.size + 1)
        cold = (jnp.asarray(cold_table), cold_k, cold_v)
        moved = int(out.nbytes + back.nbytes)
    # Free what is not resident: gather the resident pages into a compact pool.
    ids = np.concatenate([[0], np.nonzero(resident)[0] + 1]).astype(np.int32)
    ids = np.pad(ids, (0, -ids.size % _bucket(ids.size, page_bucket)))  # fewer compiles
    table = np.zeros((1, M), np.int32)
    table[0, resident] = np.arange(1, resident.sum() + 1)
    if resident.all():
        k_pages, v_pages = cache.k_pages, cache.v_pages
    else:
        k_pages, v_pages = _take_pages(cache.k_pages, ids), _take_pages(cache.v_pages, ids)
    small = cache._replace(k_pages=k_pages, v_pages=v_pages)
    small = paged.with_page_table(small, table, np.array([n], np.int32))
    device_bytes = pool_bytes(k_pages, v_pages) + (0 if cold is None else pool_bytes(cold[1], cold[2]))  # fmt: skip
    T = bucket * -(-max(len(forced), 1) // bucket)
    padded = np.zeros((1, T), np.int32)
    padded[0, : len(forced)] = forced
    graphdef, state = nnx.split(model)
    tokens = _answer(graphdef, state, small, jnp.asarray(table), jnp.asarray(padded), jnp.int32(len(forced)), jnp.int32(n), cold, max_new)  # fmt: skip
    tokens = np.asarray(tokens)
    seconds = time.perf_counter() - t0
    return Answer(tokens, int((keep & live).sum()), int(live_n), device_bytes, full_bytes, moved, seconds)  # fmt: skip
