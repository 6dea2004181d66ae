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

:func:`answer_retrieval` is the query-aware alternative (Quest): nothing is removed; every
decoded token's attention in every layer reads only the ``budget`` pages its own query
selects by the pages' key bounds (``paged.select_pages_by_query``), and the answer reports the
fraction of the KV pages it read.

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

__all__ = [
    "Answer",
    "Prefilled",
    "answer",
    "answer_retrieval",
    "pool_bytes",
    "prefill",
    "select_adaptive",
    "select_pages",
]


class Prefilled(NamedTuple):
    """A prompt in the cache, with what the policies observe.

    Attributes:
      cache: ``paged.PagedKVCache``, one row; slot ``j`` of its table holds page ``j + 1``.
      prompt_mass: ``[L, N, M]`` float32 attention probability per layer, query head and
        page, summed over every prompt query.
      window_mass: ``[W, L, N, M]`` float32 the same for each of the last ``W`` queries.
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
      kept_pages: prompt pages read from the device (the mean over layers and kv heads
        for a per-layer or per-head selection).
      live_pages: prompt pages before the press.
      device_bytes: bytes of the device pools the answer read (kept + new pages, measured
        from the arrays; the full pool's bytes when nothing was freed).
      full_bytes: bytes of the pools before the press.
      moved_bytes: bytes copied to host and back (``mode="demote"``).
      seconds: wall time of the answer (forced tokens + ``max_new`` decode steps).
      read_fraction: :func:`answer_retrieval` only (else None): the pages each decode step
        read over the live pages, averaged over the steps and layers (a page's keys and
        values are read whole, so this is the fraction of the KV bytes read).
      bounds_fraction: :func:`answer_retrieval` only: the bytes of the key bounds a step
        reads for its selection (every live page's), over the live KV bytes.
    """

    tokens: np.ndarray
    kept_pages: float
    live_pages: int
    device_bytes: int
    full_bytes: int
    moved_bytes: int
    seconds: float
    read_fraction: float | None = None
    bounds_fraction: float | None = None


def pool_bytes(*pools) -> int:
    """Bytes of page pools (float arrays or ``paged.QuantizedPages``), from their arrays."""
    return int(sum(leaf.nbytes for pool in pools for leaf in jax.tree.leaves(pool)))


def _forward(model: Llama, cache, tokens, positions, attend, count=None):
    """The model over ``tokens [B, T]``, each layer's K/V written first (``count`` real tokens
    per row); ``attend(q, cache, layer) -> (out, page_mass [..., N, M] | None)``. Returns
    ``(logits [B, T, V], cache, masses [..., L, N, M] | None)``."""
    x = model.embed_inputs(tokens)
    masses = []
    for layer, block in enumerate(model.blocks):
        q, k, v = block.attn.project(block.attn_norm(x), positions)
        cache = paged.write_layer(cache, layer, k, v, positions[:, 0], count=count)
        out, m = attend(q, cache, layer)
        masses.append(m)
        x = x + block.attn.output(out)
        x = x + block.mlp(block.mlp_norm(x))
    mass = None if masses[0] is None else jnp.stack(masses, axis=-3)  # [..., L, N, M]
    return model.logits(x), cache, mass


@functools.partial(jax.jit, static_argnums=(0, 5))
def _prefill_chunk(graphdef, state, cache, tokens, start, per_query: bool, n):
    """``tokens [1, T]`` at positions ``start ...``, ``n`` of them real. Returns
    ``(cache, mass)``: ``[L, N, M]`` summed over the queries, or ``[T, L, N, M]`` per query."""
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
        k, v = cache.k_pages[layer], cache.v_pages[layer]
        if per_query:  # kivi2: each query's row reads the sequence's full-precision window
            k, v = _repeat_rows(k, T), _repeat_rows(v, T)
        res = paged.ragged_paged_attention(
            q[0], k, v, table, lengths, cu, num,
            return_page_mass=True,
        )  # fmt: skip
        valid = (jnp.arange(T) < n)[:, None, None]
        mass = jnp.where(valid, res.page_mass, 0.0) if per_query else res.page_mass[0]
        return res.out[None], mass

    _, cache, mass = _forward(model, cache, tokens, positions, attend, count=n[None])
    return cache, mass


def _repeat_rows(pool, rows: int):
    """A layer's pool with kivi2's per-sequence window (``residual [K, 1, W * C, H]``,
    ``residual_len [K, 1]``) repeated for ``rows`` rows reading the one sequence: each row's
    length masks what lies past it. Other pools are returned as they are."""
    if not isinstance(pool, paged.QuantizedPages) or pool.residual is None:
        return pool
    return dataclasses.replace(pool, residual=jnp.repeat(pool.residual, rows, axis=-3),
                               residual_len=jnp.repeat(pool.residual_len, rows, axis=-1))  # fmt: skip


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
    prompt, window = pre.prompt_mass.sum(0), pre.window_mass.sum(1)  # over layers
    if policy.kind == "h2o":
        state = update(state, prompt[None])
    elif policy.kind == "snapkv":
        state = update(state, window.sum(0)[None])
    elif policy.kind == "tova":
        state = update(state, window[-1][None])
    elif policy.kind == "scissorhands":
        for w in range(window.shape[0]):
            state = update(state, window[w][None])
    sel = offload.select_keep(state, pre.cache.lengths, policy=policy, page_table=pre.cache.page_table)  # fmt: skip
    return np.asarray(sel.keep[0])


def select_adaptive(pre: Prefilled, kind: str, ratio: float, *, num_kv_heads: int,
                    recent: int = 1, pool_size: int = 1, beta: float = 20.0,
                    floor: float = 0.2) -> np.ndarray:  # fmt: skip
    """``keep [L, K, M]`` bool: SnapKV's scores with a budget that adapts per layer or head.

    Scores are the observation window's attention mass per layer and kv head (the group's
    query heads summed), max-pooled over ``pool_size`` pages; the last ``recent`` live pages
    are always kept. Of the ``L * K * n_live`` (layer, head, page) units, the fraction
    ``1 - ratio`` is kept:

    * ``"pyramidkv"`` (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
      Pyramidal Information Funneling"): layer ``l`` keeps a budget falling linearly from the
      first layer to the last, the last keeping ``1 / beta`` of the mean, the total unchanged
      (when the first layer's share would pass the live pages, it keeps them all and the last
      layer's share rises to keep the total, as kvpress's ``PyramidKVPress`` does); every head
      of a layer keeps the same pages.
    * ``"adakv"`` (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
      Allocation"): each layer's budget (the mean) is shared among its heads by one top-k
      over all of them, each head keeping at least ``floor`` of the mean (Ada-KV's safeguard).
    """
    if kind not in ("pyramidkv", "adakv"):
        raise ValueError(f"select_adaptive: kind: expected 'pyramidkv' or 'adakv', got {kind!r}")  # fmt: skip
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"select_adaptive: ratio: expected a fraction removed in [0, 1), got {ratio}")  # fmt: skip
    window = np.asarray(pre.window_mass.sum(0), np.float64)  # [L, N, M]
    L, N, M = window.shape
    K = num_kv_heads
    if N % K:
        raise ValueError(f"select_adaptive: num_kv_heads: expected a divisor of {N}, got {K}")
    scores = window.reshape(L, K, N // K, M).sum(2)  # [L, K, M]
    if pool_size > 1:
        pad = pool_size // 2
        padded = np.pad(scores, ((0, 0), (0, 0), (pad, pad)))
        scores = np.max(np.stack([padded[..., i : i + M] for i in range(pool_size)]), axis=0)
    n_live = -(-pre.length // pre.cache.page_size)
    live = np.arange(M) < n_live
    forced = live & (np.arange(M) >= n_live - recent)
    scores = np.where(forced, np.inf, np.where(live, scores, -np.inf))
    mean = max(1, round((1.0 - ratio) * n_live))
    keep = np.zeros((L, K, M), bool)
    if kind == "pyramidkv":
        low = mean / beta
        high = 2 * mean - low
        if high > n_live:  # kvpress's rule: the first layer keeps everything, the total stays
            high = n_live
            low = 2 * mean - high
        budgets = np.rint(high - (high - low) * np.arange(L) / max(L - 1, 1)).astype(int)
        for l in range(L):
            top = np.argsort(-scores[l].sum(0), kind="stable")[: min(max(budgets[l], recent), n_live)]  # fmt: skip
            keep[l, :, top] = True
    else:
        least = min(n_live, max(recent, int(np.ceil(floor * mean))))
        for l in range(L):
            order = np.argsort(-scores[l], axis=1, kind="stable")  # [K, M]
            for k in range(K):
                keep[l, k, order[k, :least]] = True
            rest = np.where(keep[l], -np.inf, scores[l]).ravel()
            extra = max(0, mean * K - keep[l].sum())
            keep[l].ravel()[np.argsort(-rest, kind="stable")[:extra]] = True
    return keep & live


@functools.partial(jax.jit, static_argnums=(0, 8))
def _answer(graphdef, state, cache, tables, forced, n_forced, start, cold, max_new: int):
    """``forced [1, T]`` (``n_forced`` real) at ``start``, then ``max_new`` greedy tokens;
    layer ``l``'s kv head ``k`` reads ``tables[l, k] [1, M]`` (0 = absent; ``tables`` is
    ``[L, 1, 1, M]`` when every head reads the same pages) and, with
    ``cold = (cold_table, k, v)``, the cold pool. Returns ``tokens [max_new]``."""
    model = nnx.merge(graphdef, state)
    per_head = tables.shape[1] > 1

    def attend_fn(lengths, q_positions):
        def attend(q, cache, layer):
            k, v = cache.k_pages[layer], cache.v_pages[layer]
            if per_head:  # one walk per kv head, each over its own pages
                G = q.shape[2] // tables.shape[1]
                outs = [
                    paged.paged_attention(
                        q[:, :, h * G : (h + 1) * G], _head(k, h), _head(v, h),
                        tables[layer, h], lengths, q_positions=q_positions,
                    ).out
                    for h in range(tables.shape[1])
                ]  # fmt: skip
                return jnp.concatenate(outs, axis=2), None
            table = tables[layer, 0]
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


def _head(pool, h: int):
    """Kv head ``h`` of a layer's pool ``[K, P, C, H]`` as a one-head pool ``[1, P, C, H]``."""
    if isinstance(pool, paged.QuantizedPages):
        take = lambda a: None if a is None else a[h : h + 1]
        return dataclasses.replace(pool, data=take(pool.data), scale=take(pool.scale), zero=take(pool.zero))  # fmt: skip
    return pool[h : h + 1]


def _take_pages(pool, ids: np.ndarray):
    """The pool ``[L, K, P, C, H]`` (or ``QuantizedPages``) restricted to pages ``ids``:
    ``[P']`` the same for every layer and head, or ``[L, K, P']`` one list each."""
    if isinstance(pool, paged.LayerPools):  # a cache's per-layer pools: layer by layer
        ids = np.asarray(ids)
        return paged.LayerPools(
            _take_pages(layer[None], ids if ids.ndim == 1 else ids[l : l + 1])[0]
            for l, layer in enumerate(pool.layers)
        )
    ids = jnp.asarray(ids)
    if ids.ndim == 1:
        take = lambda a: None if a is None else a[:, :, ids]
    else:
        take = lambda a: None if a is None else jnp.take_along_axis(a, ids.reshape(ids.shape + (1,) * (a.ndim - 3)), axis=2)  # fmt: skip
    if isinstance(pool, paged.QuantizedPages):
        if pool.format.kind == "kivi2":
            raise NotImplementedError("answer: freeing kivi2 pages (their residual window is per row)")  # fmt: skip
        return dataclasses.replace(pool, data=take(pool.data), scale=take(pool.scale), zero=take(pool.zero))  # fmt: skip
    return take(pool)


def _bucket(size: int, smallest: int) -> int:
    """A padding multiple for a pool of ``size`` pages: ``smallest``, or 1/8 of the power of
    two below ``size`` (at most 1/8 more pages than needed, a few distinct sizes)."""
    return max(smallest, (1 << max(size.bit_length() - 1, 0)) // 8)


def answer(model: Llama, pre: Prefilled, keep: np.ndarray | None, forced: Sequence[int],
           max_new: int, *, mode: str = "drop", bucket: int = 64,
           page_bucket: int = 8) -> Answer:  # fmt: skip
    """Continues ``pre`` with the ``forced`` tokens, then ``max_new`` greedy tokens, reading
    the prompt pages ``keep`` from the device: ``[M]`` for every layer and head (None: all),
    ``[L, M]`` per layer or ``[L, K, M]`` per layer and kv head (:func:`select_adaptive`;
    each head then walks its own pages).

    ``mode="drop"``: the other prompt pages are freed: the kept pages and the pages the
    answer writes are gathered into a smaller pool (the device bytes of :class:`Answer`).
    kivi2 pages (a full-precision window per row beside the pool) are masked out of the
    tables instead, not freed: the device bytes stay those of the full pool.
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
    L, K = cache.k_pages.shape[:2]
    M = cache.page_table.shape[1]
    if n + len(forced) + max_new > M * C:
        raise ValueError(f"answer: forced + max_new: {len(forced)} + {max_new} tokens do not fit the capacity {M * C} after {n}")  # fmt: skip
    live_n = -(-n // C)
    live = np.arange(M) < live_n
    keep = np.ones(M, bool) if keep is None else np.asarray(keep, bool)
    if keep.shape not in ((M,), (L, M), (L, K, M)):
        raise ValueError(f"answer: keep: expected [{M}], [{L}, {M}] or [{L}, {K}, {M}] bool, got shape {keep.shape}")  # fmt: skip
    keep = keep[None, None] if keep.ndim == 1 else keep[:, None] if keep.ndim == 2 else keep
    keep = np.broadcast_to(keep, (L, K, M)) & live
    uniform = bool((keep == keep[:1, :1]).all())
    per_head = not bool((keep == keep[:, :1]).all())
    if mode == "demote" and not uniform:
        raise NotImplementedError("answer: mode='demote' with a per-layer or per-head selection")
    # Slots every layer and head keeps in the same place: the open page (the answer writes
    # into it) and the slots still to be written. They get the same compact ids everywhere.
    common = np.arange(M) >= live_n
    if n % C:
        common[n // C] = True
    keep = keep | (common & live)
    full_bytes = pool_bytes(cache.k_pages, cache.v_pages)
    t0 = time.perf_counter()
    moved, cold = 0, None
    absent = live & ~keep[0, 0]
    absent_ids = np.nonzero(absent)[0] + 1  # page of slot j is j + 1
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
        cold_table[0, absent] = np.arange(1, absent_ids.size + 1)
        cold = (jnp.asarray(cold_table), cold_k, cold_v)
        moved = int(out.nbytes + back.nbytes)
    # Free what is not resident: gather each (layer, head)'s resident pages into a compact
    # pool, the common slots first (ids 1..F everywhere), then its kept prompt pages.
    n_common = int(common.sum())
    own = keep & ~common  # [L, K, M]
    size = 1 + n_common + int(own.sum(-1).max())
    size += -size % _bucket(size, page_bucket)  # few distinct sizes: fewer compiles
    tables = np.zeros((L, K, M), np.int32)
    tables[:, :, common] = np.arange(1, n_common + 1)
    ids = np.zeros((L, K, size), np.int32)
    ids[:, :, 1 : n_common + 1] = np.nonzero(common)[0] + 1
    for l in range(L):
        for h in range(K):
            slots = np.nonzero(own[l, h])[0]
            tables[l, h, slots] = np.arange(n_common + 1, n_common + 1 + slots.size)
            ids[l, h, n_common + 1 : n_common + 1 + slots.size] = slots + 1
    write_table = np.where(common, tables[0, 0], 0)[None]
    kivi2 = cache.kv_format is not None and cache.kv_format.kind == "kivi2"
    if kivi2 and not (keep | common).all():
        # kivi2 keeps a full-precision window per row beside its pages, so its pool is not
        # compacted here: the removed pages are masked out of every table (the attention
        # reads exactly the kept ones) but their bytes stay on the device.
        if mode == "demote" or per_head:
            raise NotImplementedError("answer: kivi2 pages with mode='demote' or a per-head selection")  # fmt: skip
        k_pages, v_pages, write_table = cache.k_pages, cache.v_pages, cache.page_table
        tables = np.where(keep | common, np.arange(1, M + 1), 0).astype(np.int32)
    elif (keep | common).all() and cold is None:  # nothing to free
        k_pages, v_pages, tables = cache.k_pages, cache.v_pages, np.broadcast_to(cache.page_table, (L, K, M))  # fmt: skip
        write_table = cache.page_table
    elif uniform:
        k_pages, v_pages = _take_pages(cache.k_pages, ids[0, 0]), _take_pages(cache.v_pages, ids[0, 0])  # fmt: skip
    else:
        k_pages, v_pages = _take_pages(cache.k_pages, ids), _take_pages(cache.v_pages, ids)
    small = cache._replace(k_pages=k_pages, v_pages=v_pages)
    # Dropped slots inside the length hold the null page: attention masks them.
    small = paged.with_page_table(small, np.asarray(write_table), np.array([n], np.int32))
    tables = np.asarray(tables)[:, :, None, :]  # [L, K, 1, M]
    if not per_head:
        tables = tables[:, :1]
    device_bytes = pool_bytes(k_pages, v_pages) + (0 if cold is None else pool_bytes(cold[1], cold[2]))  # fmt: skip
    T = bucket * -(-max(len(forced), 1) // bucket)
    padded = np.zeros((1, T), np.int32)
    padded[0, : len(forced)] = forced
    graphdef, state = nnx.split(model)
    tokens = _answer(graphdef, state, small, jnp.asarray(tables), jnp.asarray(padded), jnp.int32(len(forced)), jnp.int32(n), cold, max_new)  # fmt: skip
    tokens = np.asarray(tokens)
    seconds = time.perf_counter() - t0
    kept = float((keep & live).sum()) / (L * K)  # mean over layers and heads
    return Answer(tokens, kept, int(live_n), device_bytes, full_bytes, moved, seconds)


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8, 9, 10, 11))
def _answer_retrieval(graphdef, state, cache, forced, n_forced, start, max_new: int,
                      budget: int, sink: int, recent: int, dense_layers: int, per_kv_head: bool):  # fmt: skip
    """``forced [1, T]`` (``n_forced`` real) over every page, then ``max_new`` greedy tokens,
    each layer's attention over the ``budget`` pages its query selects. Returns ``(tokens
    [max_new], pages read, live pages)`` (the last two summed over steps and layers)."""
    model = nnx.merge(graphdef, state)
    C = cache.page_size
    T = forced.shape[1]
    positions = start + jnp.arange(T, dtype=jnp.int32)[None]
    end = start + n_forced

    def dense(q, cache, layer):
        k, v = cache.k_pages[layer], cache.v_pages[layer]
        return paged.paged_attention(q, k, v, cache.page_table, end[None], q_positions=positions).out, None  # fmt: skip

    logits, cache, _ = _forward(model, cache, forced, positions, dense, count=n_forced[None])
    bounds = paged.page_key_bounds(cache, end[None])
    first = jnp.argmax(logits[0, n_forced - 1]).astype(jnp.int32)

    def step(i, carry):
        cache, bounds, token, out, read, live = carry
        pos = (end + i)[None]  # [1]
        lengths = pos + 1
        x = model.embed_inputs(token[None, None])
        for layer, block in enumerate(model.blocks):
            q, k, v = block.attn.project(block.attn_norm(x), pos[:, None])
            cache = paged.write_layer(cache, layer, k, v, pos)
            bounds = paged.refresh_key_bounds(bounds, cache, pos, 1, layer=layer, lengths=lengths)
            live = live + (lengths[0] + C - 1) // C
            if layer < dense_layers:  # Quest's first layers: every page
                att = paged.paged_attention(q, cache.k_pages[layer], cache.v_pages[layer],
                                            cache.page_table, lengths)  # fmt: skip
                read = read + (lengths[0] + C - 1) // C
                x = x + block.attn.output(att.out)
                x = x + block.mlp(block.mlp_norm(x))
                continue
            if per_kv_head:  # each kv head its own budget pages (Quest's granularity)
                att = paged.retrieval_attention(
                    q, cache.k_pages[layer], cache.v_pages[layer], bounds.layer(layer),
                    cache.page_table, lengths, budget=budget, sink_pages=sink,
                    recent_pages=recent, per_kv_head=True,
                )  # fmt: skip
                read = read + jnp.minimum(budget, (lengths[0] + C - 1) // C)
                x = x + block.attn.output(att.out)
                x = x + block.mlp(block.mlp_norm(x))
                continue
            sel = paged.select_pages_by_query(
                q, bounds.layer(layer), cache.page_table, lengths, page_size=C, budget=budget,
                sink_pages=sink, recent_pages=recent,
            )  # fmt: skip
            rt = paged.retrieval_table(sel, cache.page_table, lengths, page_size=C)
            kp = paged.retrieval_pool(cache.k_pages[layer], rt.offset)
            vp = paged.retrieval_pool(cache.v_pages[layer], rt.offset)
            att = paged.paged_attention(q, kp, vp, rt.page_table, rt.lengths,
                                        q_positions=pos[:, None] - rt.offset[:, None])  # fmt: skip
            read = read + sel.count[0]
            x = x + block.attn.output(att.out)
            x = x + block.mlp(block.mlp_norm(x))
        nxt = jnp.argmax(model.logits(x)[0, -1]).astype(jnp.int32)
        return cache, bounds, nxt, out.at[i].set(token), read, live

    out = jnp.zeros(max_new, jnp.int32)
    zero = jnp.int32(0)
    carry = (cache, bounds, first, out, zero, zero)
    # The last token is emitted without a step after it (it is never attended from).
    _, _, last, out, read, live = jax.lax.fori_loop(0, max_new - 1, step, carry)
    return out.at[max_new - 1].set(last), read, live


def answer_retrieval(model: Llama, pre: Prefilled, forced: Sequence[int], max_new: int, *,
                     ratio: float, sink_pages: int = 1, recent_pages: int | None = None,
                     dense_layers: int = 2, per_kv_head: bool = True,
                     bucket: int = 64) -> Answer:  # fmt: skip
    """Continues ``pre`` with ``forced`` and ``max_new`` greedy tokens, Quest-style: all
    pages stay on the device; the ``forced`` tokens (the question or the prompt's last
    token: prefill) attend over every page, as Quest's prefill does, and every decoded token
    reads in every layer only the ``budget = ceil((1 - ratio) * live)`` pages (``live``: the
    pages at the last decode step, at least ``sink_pages + recent_pages``) its own query selects
    (``paged.select_pages_by_query``: the first ``sink_pages`` and last ``recent_pages``
    pages always, the rest by the upper bound of their logit from the pages' key bounds,
    which ``paged.refresh_key_bounds`` keeps current as tokens are written). The first
    ``dense_layers`` layers read every page, as Quest does for its first two layers (their
    attention is spread too widely for a few pages to hold it); their reads count in the
    fraction read. ``per_kv_head=True`` (default, Quest's granularity) lets each kv head select
    its own ``budget`` pages (``paged.retrieval_attention(..., per_kv_head=True)``);
    ``False`` reads one table shared by the heads, ranked by the maximum bound over every
    head (the same bytes read; on SmolLM2 at 1K tokens it lost a digit of the needle at a
    ratio of 0.75 where the per-head selection kept it at 0.9).

    ``ratio`` is the fraction of the KV bytes NOT read per decode step (kvpress's
    ``compression_ratio``: ``0.9`` reads about 10%); the measured fraction read is
    :attr:`Answer.read_fraction` (slightly above ``1 - ratio`` for the earlier steps, which
    have fewer live pages: the budget is fixed, so the jitted loop's shapes are static), and the bounds a
    step reads for its selection are :attr:`Answer.bounds_fraction` (``1 / C`` of float32
    KV). ``ratio = 0`` selects every page: the tokens are :func:`answer`'s with no press.
    kivi2 pages read their full-precision window: ``recent_pages`` is raised to it.

    ``recent_pages=None`` (default) always reads the pages of the tokens after the context
    (``forced`` and the answer: ``ceil((len(forced) + max_new) / C) + 1`` trailing pages), as
    the static presses of :func:`answer` always keep them; the budget is then those pages and
    the sinks plus ``ceil((1 - ratio) * n_context_pages)`` selected context pages, so a ratio
    means the same fraction of the context for retrieval as for a press.
    """
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"answer_retrieval: ratio: expected a fraction not read in [0, 1), got {ratio}")  # fmt: skip
    if max_new < 1:
        raise ValueError(f"answer_retrieval: max_new: expected >= 1, got {max_new}")
    if not len(forced):
        raise ValueError("answer_retrieval: forced: expected at least one token (for a query-aware run: the prompt's last token)")  # fmt: skip
    cache, C, n = pre.cache, pre.cache.page_size, pre.length
    M = cache.page_table.shape[1]
    if n + len(forced) + max_new > M * C:
        raise ValueError(f"answer_retrieval: forced + max_new: {len(forced)} + {max_new} tokens do not fit the capacity {M * C} after {n}")  # fmt: skip
    # The live pages of the last decode step: ratio 0 then reads every page at every step.
    live = -(-(n + len(forced) + max_new - 1) // C)
    if recent_pages is None:
        recent_pages = -(-(len(forced) + max_new) // C) + 1
        context_pages = max(0, live - recent_pages - sink_pages)
        budget = sink_pages + recent_pages + int(np.ceil((1.0 - ratio) * context_pages - 1e-9))
    else:
        budget = max(sink_pages + recent_pages, int(np.ceil((1.0 - ratio) * live - 1e-9)))
    fmt = cache.kv_format
    if fmt is not None and fmt.kind == "kivi2":
        recent_pages = max(recent_pages, fmt.residual_pages(C))
        budget = max(budget, sink_pages + recent_pages)
    budget = min(budget, live)
    T = bucket * -(-len(forced) // bucket)
    padded = np.zeros((1, T), np.int32)
    padded[0, : len(forced)] = forced
    graphdef, state = nnx.split(model)
    t0 = time.perf_counter()
    tokens, read, seen = _answer_retrieval(
        graphdef, state, cache, jnp.asarray(padded), jnp.int32(len(forced)), jnp.int32(n),
        max_new, budget, sink_pages, recent_pages, dense_layers, bool(per_kv_head),
    )  # fmt: skip
    tokens = np.asarray(tokens)
    seconds = time.perf_counter() - t0
    read, seen = int(read), int(seen)
    read_fraction = read / seen if seen else 1.0
    H = cache.k_pages.shape[-1]
    kv_page = pool_bytes(cache.k_pages, cache.v_pages) / (cache.k_pages.shape[2])  # per page
    bounds_fraction = 2 * 4 * H * cache.k_pages.shape[0] * cache.k_pages.shape[1] / kv_page
    full = pool_bytes(cache.k_pages, cache.v_pages)
    bounds_bytes = 2 * 4 * H * cache.k_pages.shape[0] * cache.k_pages.shape[1] * cache.k_pages.shape[2]  # fmt: skip
    return Answer(tokens, float(budget), live, full + bounds_bytes, full, 0, seconds,
                  read_fraction, bounds_fraction)  # fmt: skip
