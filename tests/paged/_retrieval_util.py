"""Caches for the retrieval tests: random permuted page ids, lengths at the page edges,
NaN garbage in every slot no query may read, in every format; and numpy oracles of the key
bounds, the selection and attention over a set of pages, written from the definitions."""

import jax.numpy as jnp
import numpy as np

import paged
from paged import KVFormat

FORMATS = {
    "float32": None,
    "int8": KVFormat("int8"),
    "fp8": KVFormat("fp8"),
    "int4": KVFormat("int4", group_size=4),
    "kivi2": KVFormat("kivi2"),
    "kivi2_window": KVFormat("kivi2", residual=3),
}


def edge_lengths(C: int, M: int) -> list[int]:
    return [1, C, C + 1, M * C - 1, M * C, 2 * C + 1]


def make_table(rng, lengths, C: int, M: int, P: int) -> np.ndarray:
    """Distinct random page ids per row (one spare page past the length where it fits)."""
    ids = rng.permutation(np.arange(1, P))
    table = np.zeros((len(lengths), M), np.int32)
    used = 0
    for b, n in enumerate(lengths):
        pages = min(M, -(-n // C) + 1)
        table[b, :pages] = ids[used : used + pages]
        used += pages
    assert used < P, "make_table: too few pages"
    return table


def readable(table, lengths, C: int, P: int) -> np.ndarray:
    """``[P, C]`` bool: slots some row reads."""
    ok = np.zeros((P, C), bool)
    for b, n in enumerate(lengths):
        for j in range(table.shape[1]):
            for c in range(C):
                if j * C + c < n and 0 < table[b, j] < P:
                    ok[table[b, j], c] = True
    return ok


def make_cache(kind: str, rng, *, L=2, K=2, C=4, H=8, M=5, P=48, lengths=None):
    """A cache of ``kind`` with NaN (float: values; quantized: scales) in unreadable slots."""
    lengths = edge_lengths(C, M) if lengths is None else lengths
    B = len(lengths)
    table = make_table(rng, lengths, C, M, P)
    fmt = FORMATS[kind]
    if fmt is not None and fmt.kind == "kivi2":
        cache = paged.init_paged_cache(L, K, P, C, H, B, M, kv_format=fmt)
        cache = paged.with_page_table(cache, jnp.asarray(table), jnp.zeros(B, jnp.int32))
        S = max(lengths)
        k = jnp.asarray(rng.standard_normal((L, B, S, K, H)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((L, B, S, K, H)), jnp.float32)
        cache = paged.write(cache, k, v, 0, count=jnp.asarray(lengths, jnp.int32))
        free = np.setdiff1d(np.arange(P), table)  # pages no row holds, the null page too

        def poison(pool):
            scale = pool.scale.at[:, :, free].set(jnp.nan)
            zero = pool.zero.at[:, :, free].set(jnp.nan)
            return paged.QuantizedPages(pool.data, scale, pool.format, zero, pool.residual,
                                        pool.residual_len, pool.grouping)  # fmt: skip

        return cache._replace(k_pages=poison(cache.k_pages), v_pages=poison(cache.v_pages))
    ok = readable(table, lengths, C, P)[None, None, :, :, None]
    k = np.where(ok, rng.standard_normal((L, K, P, C, H)), np.nan).astype(np.float32)
    v = np.where(ok, rng.standard_normal((L, K, P, C, H)), np.nan).astype(np.float32)
    k, v = jnp.asarray(k), jnp.asarray(v)
    if fmt is not None:
        k, v = paged.quantize_pages(k, fmt), paged.quantize_pages(v, fmt)
    return paged.PagedKVCache(k, v, jnp.asarray(table), jnp.asarray(lengths, jnp.int32))


def read_keys(cache, layer: int) -> np.ndarray:
    """``[B, S, K, H]`` float64: the keys attention reads (``paged.gather_kv``)."""
    k, _ = paged.gather_kv(cache, layer)
    return np.asarray(k, np.float64)


def bounds_oracle(cache, lengths=None):
    """``(k_min, k_max) [L, K, P, H]`` float64 from the definition (see ``paged._summaries``)."""
    L, K, P, C, H = cache.k_pages.shape
    table = np.asarray(cache.page_table)
    lengths = np.asarray(cache.lengths if lengths is None else lengths)
    lo = np.full((L, K, P, H), np.inf)
    hi = np.full((L, K, P, H), -np.inf)
    kivi = cache.kv_format is not None and cache.kv_format.kind == "kivi2"
    stored = np.asarray(cache.k_pages.dequantize(), np.float64) if kivi else None
    for layer in range(L):
        read = read_keys(cache, layer)
        filled = np.asarray(cache.k_pages.residual_len)[layer, 0] if kivi else None
        for b in range(table.shape[0]):
            for j in range(table.shape[1]):
                p = table[b, j]
                if not 0 < p < P:
                    continue
                for c in range(C):
                    pos = j * C + c
                    if pos >= lengths[b]:
                        continue
                    vals = [read[b, pos]]  # [K, H]
                    if kivi and (j + 1) * C <= filled[b]:
                        vals.append(stored[layer, :, p, c])
                    for x in vals:
                        lo[layer, :, p] = np.minimum(lo[layer, :, p], x)
                        hi[layer, :, p] = np.maximum(hi[layer, :, p], x)
    return lo, hi


def selection_oracle(q, k_min, k_max, table, lengths, C, budget, sink, recent):
    """``(sets, scores)``: the selected slots of each row and the ``[B, M]`` bounds, from the
    definition in ``paged._retrieval`` (float64)."""
    q = np.asarray(q, np.float64)
    B, T, N, H = q.shape
    K = k_min.shape[0]
    G = N // K
    M = table.shape[1]
    P = k_min.shape[1]
    scores = np.full((B, M), -np.inf)
    sets = []
    for b in range(B):
        n = -(-int(lengths[b]) // C)
        pri = np.full(M, -np.inf)
        for j in range(M):
            p = int(table[b, j])
            if not (j < n and 0 < p < P):
                continue
            lo, hi = k_min[:, p].astype(np.float64), k_max[:, p].astype(np.float64)
            if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
                s = np.inf
            else:
                s = -np.inf
                for t in range(T):
                    for h in range(N):
                        qh = q[b, t, h]
                        s = max(s, np.sum(np.maximum(qh * lo[h // G], qh * hi[h // G])))
            scores[b, j] = s
            forced = j < sink or j >= n - recent
            pri[j] = np.inf if forced else min(s, 1e300)
        order = np.argsort(-pri, kind="stable")
        sets.append(sorted(int(j) for j in order[:budget] if pri[j] > -np.inf))
    return sets, scores


def attention_oracle(q, cache, layer, lengths, slots_per_row, scale=None):
    """``[B, T, N, H]`` float64 causal attention of the last ``T`` positions over the tokens
    of the given page-table slots only (below the lengths), from the read keys and values."""
    q = np.asarray(q, np.float64)
    B, T, N, H = q.shape
    k = read_keys(cache, layer)
    _, v = paged.gather_kv(cache, layer)
    v = np.asarray(v, np.float64)
    K = k.shape[2]
    C = cache.page_size
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    out = np.zeros((B, T, N, H))
    for b in range(B):
        n = int(lengths[b])
        keys = [i for i in range(n) if i // C in set(slots_per_row[b])]
        for t in range(T):
            qpos = n - T + t
            vis = [i for i in keys if i <= qpos]
            if not vis:
                continue
            for h in range(N):
                kh = h // (N // K)
                logits = np.array([q[b, t, h] @ k[b, i, kh] for i in vis]) * scale
                w = np.exp(logits - logits.max())
                w /= w.sum()
                out[b, t, h] = sum(w[a] * v[b, i, kh] for a, i in enumerate(vis))
    return out
