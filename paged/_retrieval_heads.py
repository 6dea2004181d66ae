"""Query-aware retrieval with one page selection per kv head (Quest's own granularity).

:func:`paged.retrieval_attention` with ``per_kv_head=True``: each kv head ranks the pages by
its own bound (the maximum over its ``G`` query heads and the ``T`` queries) and reads its own
``budget`` pages, instead of one table shared by the heads (ranked by the maximum over every
head). The heads then read different pages: attention runs as ``K`` one-head calls of
``paged.paged_attention`` (``vmap`` over the kv heads), each over its own compacted table.
The bytes read per step are the same (``budget`` pages per kv head either way).
"""

import functools

import jax
import jax.numpy as jnp

from paged._attention import PagedAttentionOutput, paged_attention

__all__ = ["per_kv_head_attention"]


@functools.partial(jax.jit, static_argnames=("C", "budget", "sink", "recent", "softcap", "scale"))
def per_kv_head_attention(
    q, k_pages, v_pages, bounds, page_table, lengths, sinks, *, C, budget, sink, recent,
    softcap, scale,
):  # fmt: skip
    """``PagedAttentionOutput`` of ``q [B, T, N, H]`` with each kv head over its own selection
    (arguments as :func:`paged.retrieval_attention`'s, checked there)."""
    from paged._retrieval import (  # the selection and compaction this builds on
        _logit_bounds,
        _table_impl,
        retrieval_pool,
        select_from_scores,
    )

    K, P, _ = bounds.k_min.shape
    B, T, N, H = q.shape
    G = N // K
    table = page_table.astype(jnp.int32)
    scores = _logit_bounds(q, bounds, table)  # [B, K, M]
    q_heads = q.reshape(B, T, K, G, H)  # [B, T, K, G, H]: kv head k serves query heads k*G..
    one_head = lambda pool: jax.tree.map(lambda a: a[:, None], pool)  # [K, 1, ...] per leaf
    sinks_heads = None if sinks is None else sinks.reshape(K, G)
    positions = lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T, dtype=jnp.int32)

    def head(score, q_h, k_h, v_h, sinks_h):
        sel = select_from_scores(score, table, lengths, P, C, budget, sink, recent)
        rt = _table_impl(sel.slots, table, lengths, C)
        res = paged_attention(
            q_h, retrieval_pool(k_h, rt.offset), retrieval_pool(v_h, rt.offset),
            rt.page_table, rt.lengths, q_positions=positions - rt.offset[:, None],
            softcap=softcap, scale=scale, sinks=sinks_h,
        )  # fmt: skip
        return res.out, res.lse

    out, lse = jax.vmap(head, in_axes=(1, 2, 0, 0, 0 if sinks is not None else None), out_axes=2)(
        scores, q_heads, one_head(k_pages), one_head(v_pages), sinks_heads
    )  # out [B, T, K, G, H], lse [B, T, K, G]
    return PagedAttentionOutput(out.reshape(B, T, N, H), lse.reshape(B, T, N), None)
