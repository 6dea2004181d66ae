"""Attention over a query-aware page selection: :func:`paged.retrieval_attention`.

The selection, the compacted table and the shifted pools are :mod:`paged._retrieval`'s; this
module runs ``paged.paged_attention`` over them, with one table shared by the kv heads or
(``per_kv_head=True``, Quest's own granularity) one selection per kv head: each kv head ranks
the pages by its own bound (the maximum over its ``G`` query heads and the ``T`` queries) and
reads its own ``budget`` pages, as ``K`` one-head calls (``vmap`` over the kv heads) over
their own compacted tables. The bytes read per step are the same (``budget`` pages per kv
head either way).
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from paged._attention import PagedAttentionOutput, paged_attention
from paged._checks import check_pages, int_option
from paged._quantized import QuantizedPages
from paged._retrieval import (
    _check_budget,
    _check_q_bounds,
    _logit_bounds,
    _select_impl,
    _table_impl,
    retrieval_pool,
    select_from_scores,
)
from paged._summaries import PageKeyBounds

__all__ = ["retrieval_attention"]


@functools.partial(jax.jit, static_argnames=("C", "rule", "logits"))
def per_kv_head_attention(q, pools, bounds, view, sinks, *, C, rule, logits):
    """``PagedAttentionOutput`` of ``q [B, T, N, H]`` with each kv head over its own selection
    of ``rule`` (a ``Budget``); ``pools = (k_pages, v_pages)``, ``view = (page_table,
    lengths)``, ``logits = (softcap, scale)`` (as :func:`paged.retrieval_attention`'s, checked
    there)."""
    (k_pages, v_pages), (page_table, lengths), (softcap, scale) = pools, view, logits
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
        sel = select_from_scores(score, table, lengths, (P, C), rule)
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


def retrieval_attention(
    q: Float[Array, "B T N H"],
    k_pages: Float[Array, "K P C H"] | QuantizedPages,
    v_pages: Float[Array, "K P C H"] | QuantizedPages,
    bounds: PageKeyBounds,
    page_table: Int[Array, "B M"],
    lengths: Int[Array, " B"],
    *,
    budget: int,
    sink_pages: int = 1,
    recent_pages: int = 1,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: Float[Array, " N"] | None = None,
    per_kv_head: bool = False,
) -> PagedAttentionOutput:
    """Decode attention of one layer over the ``budget`` pages its queries select.

    :func:`select_pages_by_query`, :func:`retrieval_table` (and :func:`retrieval_pool` for
    kivi2) and ``paged.paged_attention`` (causal, queries at the sequence's last ``T``
    positions). Jittable with the options bound. With ``budget`` at least the live pages it
    equals ``paged.paged_attention`` over the whole table. For kivi2 pools ``recent_pages`` is
    raised to the residual window's pages (``KVFormat.residual_pages(C)``), which the budget
    must hold beside the sinks.

    Args:
      q: ``[B, T, N, H]`` queries at positions ``lengths - T ... lengths - 1``.
      k_pages: ``[K, P, C, H]`` key pool (float or :class:`paged.QuantizedPages`).
      v_pages: ``[K, P, C, H]`` value pool.
      bounds: the layer's :class:`paged.PageKeyBounds` ``[K, P, H]``.
      page_table: ``[B, M]`` int page ids.
      lengths: ``[B]`` int tokens per sequence (the queries' included).
      budget: pages read per sequence (static).
      sink_pages: leading pages always read.
      recent_pages: trailing pages always read; must cover the ``T`` queries' pages.
      softcap: as in ``paged.paged_attention``.
      scale: as in ``paged.paged_attention``.
      sinks: ``[N]`` per-query-head sink logits, as in ``paged.paged_attention``.
      per_kv_head: False (default): one selection per sequence, shared by the heads (ranked
        by the maximum bound over every head; one attention call). True: each kv head selects
        its own ``budget`` pages by its own group's bound (Quest's granularity; ``K``
        one-head attention calls). Either way ``budget`` pages per kv head are read.

    Returns:
      ``paged.PagedAttentionOutput`` ``(out [B, T, N, H], lse [B, T, N], None)``.

    Raises:
      ValueError: on shapes that disagree or a bad option.
    """
    fn = "retrieval_attention"
    q4 = _check_q_bounds(fn, q, bounds, page_table, lengths)
    K, P, C, H = check_pages(fn, k_pages, v_pages)
    if (K, P, H) != tuple(bounds.k_min.shape):
        raise ValueError(
            f"{fn}: bounds: expected [K, P, H] = {(K, P, H)} (the pools'), got "
            f"{tuple(bounds.k_min.shape)}"
        )
    if getattr(k_pages, "residual", None) is not None:
        recent_pages = max(int_option(fn, "recent_pages", recent_pages, minimum=0),
                           k_pages.format.residual_pages(C))  # fmt: skip
    rule = _check_budget(fn, budget, sink_pages, recent_pages)
    if per_kv_head:
        res = per_kv_head_attention(
            q4, (k_pages, v_pages), bounds, (page_table, lengths), sinks, C=C, rule=rule,
            logits=(softcap, scale),
        )  # fmt: skip
        if q.ndim == 3:
            return PagedAttentionOutput(res.out[:, 0], res.lse[:, 0], None)
        return res
    sel = _select_impl(q4, bounds, page_table, lengths, C, rule)
    rt = _table_impl(sel.slots, page_table, lengths, C)
    T = q4.shape[1]
    q_positions = lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T, dtype=jnp.int32)
    q_positions = q_positions - rt.offset[:, None]
    res = paged_attention(
        q4, retrieval_pool(k_pages, rt.offset), retrieval_pool(v_pages, rt.offset),
        jax.lax.stop_gradient(rt.page_table), rt.lengths, q_positions=q_positions,
        softcap=softcap, scale=scale, sinks=sinks,
    )  # fmt: skip
    if q.ndim == 3:
        return PagedAttentionOutput(res.out[:, 0], res.lse[:, 0], None)
    return res
