"""Query-aware page retrieval (Quest-style): each decode step reads only the pages its query
can need.

With each page's key bounds (:class:`paged.PageKeyBounds`: elementwise ``min_h, max_h`` of
its keys per kv head), the logit of query ``q`` against any key ``k`` of the page satisfies

    ``q . k = sum_h q_h k_h <= sum_h max(q_h * min_h, q_h * max_h)``

(each term is linear in ``k_h``, so its maximum over ``[min_h, max_h]`` sits at an end). This
is Quest's criticality estimate (Tang et al., 2024) and a true upper bound of the unscaled
logit (so of the scaled, soft-capped one: both are increasing). Heads share one page table,
so the selection is per sequence: the bound of a page is the **maximum** over the ``T``
queries, over the ``G = N / K`` query heads of each kv head (GQA group) and then over the kv
heads. A page that any query head could attend to strongly ranks high.

:func:`select_pages_by_query` keeps, per sequence, the first ``sink_pages`` live pages
(attention sinks), the last ``recent_pages`` (the open page, being written), and the
``budget`` minus those pages with the largest bounds; only *live* slots (below
``ceil(lengths / C)``, holding a real page ``0 < id < P``) are candidates. A live page whose
bounds are not finite (never summarised, or NaN keys) ranks right after the forced pages:
it is read rather than guessed at.

:func:`retrieval_table` compacts a selection into a page table ``[B, budget]`` in position
order with matching lengths: the keys already carry their rotary embedding, so attention
over the compacted table equals attention over exactly the selected pages for any query
whose causal horizon covers them (decode queries at the end of the sequence; the tail of
recent pages keeps its positions relative to the queries, shifted by ``offset``).
:func:`retrieval_attention` does the three steps for one layer. A kivi2 pool, whose residual
window is addressed by position, is shifted with :func:`retrieval_pool` (the window's pages
must all be selected: ``retrieval_attention`` raises ``recent_pages`` to the window's).

Budget ``>=`` the live pages selects everything: the result is ``paged.paged_attention``'s
(tested against ``paged.paged_attention_reference`` on every format).

References:
  Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", 2024;
  Sun et al., "ShadowKV", 2024; Liu et al., "RetrievalAttention", 2024.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from paged._checks import check_array, check_table, describe, int_option
from paged._quantized import QuantizedPages
from paged._summaries import PageKeyBounds

__all__ = [
    "PageSelection",
    "RetrievalTable",
    "page_logit_bounds",
    "retrieval_pool",
    "retrieval_table",
    "select_pages_by_query",
]

_FINITE_TOP = 3.0e38  # scores are clipped below this; unsummarised live pages rank at it


class PageSelection(NamedTuple):
    """The pages each sequence reads this step.

    Attributes:
      slots: ``[B, budget]`` int32 page-table slots in increasing order; unused entries
        (fewer live pages than the budget) are ``M`` and come last.
      count: ``[B]`` int32 selected slots per sequence (``min(budget, live pages)``).
      scores: ``[B, M]`` float32 upper bound of each slot's logit (``-inf`` for slots that
        are not live; ``+inf`` for a live page without finite bounds).
    """

    slots: Int[Array, "B budget"]
    count: Int[Array, " B"]
    scores: Float[Array, "B M"]


class RetrievalTable(NamedTuple):
    """A selection compacted into a page table (:func:`retrieval_table`).

    Attributes:
      page_table: ``[B, budget]`` int32 page ids of the selected slots in position order
        (0 past ``count``).
      lengths: ``[B]`` int32 tokens of the selected pages (``C`` per page, the open page's
        own count for it).
      offset: ``[B]`` int32 positions removed before the last selected page: a query or key at
        position ``p`` in the contiguous tail of selected pages sits at ``p - offset`` in
        the compacted sequence.
    """

    page_table: Int[Array, "B budget"]
    lengths: Int[Array, " B"]
    offset: Int[Array, " B"]


def _check_q_bounds(fn: str, q, bounds, page_table, lengths):
    if not hasattr(q, "ndim") or q.ndim not in (3, 4):
        raise ValueError(f"{fn}: q: expected [B, T, N, H] (or [B, N, H]) floats, got {describe(q)}")
    q = q if q.ndim == 4 else q[:, None]
    check_array(fn, "q", q, 4, jnp.floating)
    if not isinstance(bounds, PageKeyBounds):
        raise ValueError(f"{fn}: bounds: expected a paged.PageKeyBounds, got {bounds!r}")
    if bounds.k_min.ndim != 3:
        raise ValueError(
            f"{fn}: bounds: expected one layer's [K, P, H] bounds (bounds.layer(l)), got "
            f"k_min {describe(bounds.k_min)}"
        )
    K, P, H = bounds.k_min.shape
    if tuple(bounds.k_max.shape) != (K, P, H):
        raise ValueError(f"{fn}: bounds.k_max: expected shape {(K, P, H)}, got {describe(bounds.k_max)}")  # fmt: skip
    B, _, N, Hq = q.shape
    if Hq != H or N % K:
        raise ValueError(
            f"{fn}: q: expected head dim H={H} and N a multiple of K={K} (the bounds' "
            f"[K, P, H]), got {q.shape}"
        )
    check_table(fn, page_table, lengths, B)
    return q


class Budget(NamedTuple):
    """A selection's static sizes (checked): ``budget`` pages read, of which the first
    ``sink`` and the last ``recent`` live pages always."""

    budget: int
    sink: int
    recent: int


def _check_budget(fn: str, budget, sink_pages, recent_pages) -> Budget:
    budget = int_option(fn, "budget", budget, minimum=1)
    sink = int_option(fn, "sink_pages", sink_pages, minimum=0)
    recent = int_option(fn, "recent_pages", recent_pages, minimum=0)
    if sink + recent > budget:
        raise ValueError(
            f"{fn}: budget: expected at least sink_pages + recent_pages = {sink + recent} "
            f"pages (always read), got {budget}"
        )
    return Budget(budget, sink, recent)


def page_logit_bounds(
    q: Float[Array, "B T N H"],
    bounds: PageKeyBounds,
    page_table: Int[Array, "B M"],
) -> Float[Array, "B K M"]:
    """Upper bound of the logit of each page-table slot per kv head, over a GQA group.

    ``out[b, k, j] = max_{t, g} sum_h max(q_h * min_h, q_h * max_h)`` for query head
    ``n = k * G + g`` of query ``t`` and the bounds of page ``page_table[b, j]`` (unscaled:
    multiply by the attention scale for the scaled logit). Pages with non-finite bounds
    (empty, unsummarised, NaN) give ``+inf``; liveness is not applied here. Jittable.

    Args:
      q: ``[B, T, N, H]`` (or ``[B, N, H]``) queries.
      bounds: one layer's :class:`paged.PageKeyBounds` ``[K, P, H]``.
      page_table: ``[B, M]`` int page ids (ids outside ``[0, P)`` read page 0's bounds).

    Returns:
      ``[B, K, M]`` float32.

    Raises:
      ValueError: on shapes that disagree.

    Example:
      >>> b = PageKeyBounds(jnp.array([[[-1.0, 0.0]]]), jnp.array([[[2.0, 1.0]]]))
      >>> page_logit_bounds(jnp.array([[[1.0, -1.0]]]), b, jnp.array([[0]])).tolist()
      [[[2.0]]]
    """
    fn = "page_logit_bounds"
    check_array(fn, "page_table", page_table, 2, jnp.integer)
    q = _check_q_bounds(fn, q, bounds, page_table, jnp.zeros(page_table.shape[:1], jnp.int32))
    return _logit_bounds(q, bounds, page_table)


@jax.jit
def _logit_bounds(q, bounds, page_table):
    K, P, H = bounds.k_min.shape
    B, T, N, _ = q.shape
    ids = jnp.clip(page_table.astype(jnp.int32), 0, P - 1)
    lo, hi = bounds.k_min[:, ids], bounds.k_max[:, ids]  # [K, B, M, H]
    finite = jnp.all(jnp.isfinite(lo) & jnp.isfinite(hi) & (lo <= hi), axis=-1)  # [K, B, M]
    lo, hi = jnp.where(finite[..., None], lo, 0.0), jnp.where(finite[..., None], hi, 0.0)
    qg = q.astype(jnp.float32).reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
    pos, neg = jnp.maximum(qg, 0.0), jnp.minimum(qg, 0.0)
    hp = jax.lax.Precision.HIGHEST
    s = jnp.einsum("btkgh,kbmh->bkgtm", pos, hi, precision=hp)
    s = s + jnp.einsum("btkgh,kbmh->bkgtm", neg, lo, precision=hp)
    s = jnp.max(s, axis=(2, 3))  # [B, K, M]
    return jnp.where(finite.transpose(1, 0, 2), s, jnp.inf)


def select_pages_by_query(
    q: Float[Array, "B T N H"],
    bounds: PageKeyBounds,
    page_table: Int[Array, "B M"],
    lengths: Int[Array, " B"],
    *,
    page_size: int,
    budget: int,
    sink_pages: int = 1,
    recent_pages: int = 1,
) -> PageSelection:
    """The ``budget`` pages of each sequence its queries can attend to most (Quest).

    Pure and jittable with the options static (``jax.jit(functools.partial(
    select_pages_by_query, page_size=16, budget=64))``); vmappable over a leading axis.

    Per sequence ``b``, with ``n_b = ceil(lengths[b] / C)`` pages and the live slots those
    ``j < n_b`` holding a real page: the first ``sink_pages`` and the last
    ``recent_pages`` live slots are always selected, then the others in decreasing order of
    their logit bound (:func:`page_logit_bounds`, maxed over kv heads), ties to the earlier
    slot, until ``budget`` slots or every live slot is selected.

    Args:
      q: ``[B, T, N, H]`` (or ``[B, N, H]``) queries of this step (RoPE applied).
      bounds: one layer's :class:`paged.PageKeyBounds` ``[K, P, H]`` (``bounds.layer(l)``).
      page_table: ``[B, M]`` int page ids.
      lengths: ``[B]`` int tokens per sequence (the queries' own tokens included).
      page_size: ``C``.
      budget: pages read per sequence (static), ``>= sink_pages + recent_pages``; may exceed
        ``M`` (then every live page is selected).
      sink_pages: leading pages always read (default 1).
      recent_pages: trailing pages always read (default 1: the open page).

    Returns:
      :class:`PageSelection` ``(slots [B, budget], count [B], scores [B, M])``.

    Raises:
      ValueError: on shapes that disagree or a bad option.

    Example:
      >>> b = PageKeyBounds(jnp.zeros((1, 5, 2)), jnp.array([[[0.0, 0], [1, 0], [5, 0], [2, 0],
      ...                                                     [0, 0]]]))
      >>> sel = select_pages_by_query(jnp.ones((1, 1, 1, 2)), b, jnp.array([[1, 2, 3, 4]]),
      ...                             jnp.array([8]), page_size=2, budget=3)
      >>> sel.slots.tolist(), sel.count.tolist()  # sink 0, recent 3, then slot 1 (bound 5)
      ([[0, 1, 3]], [3])
    """
    fn = "select_pages_by_query"
    q = _check_q_bounds(fn, q, bounds, page_table, lengths)
    C = int_option(fn, "page_size", page_size, minimum=1)
    rule = _check_budget(fn, budget, sink_pages, recent_pages)
    return _select_impl(q, bounds, page_table, lengths, C, rule)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _select_impl(q, bounds, page_table, lengths, C: int, rule: Budget):
    P = bounds.k_min.shape[1]
    table = page_table.astype(jnp.int32)
    score = jnp.max(_logit_bounds(q, bounds, table), axis=1)  # [B, M]
    return select_from_scores(score, table, lengths, (P, C), rule)


def select_from_scores(score, table, lengths, sizes: tuple[int, int], rule: Budget):
    """The :class:`PageSelection` of bounds ``score [B, M]`` over ``table [B, M]`` of a pool
    of ``sizes = (P, C)`` (pages, tokens per page) by ``rule`` (jittable; the sizes
    static)."""
    (P, C), (budget, sink, recent) = sizes, rule
    M = table.shape[1]
    n_pages = (jnp.maximum(lengths.astype(jnp.int32), 0) + C - 1) // C
    idx = jnp.arange(M, dtype=jnp.int32)[None]
    live = (idx < n_pages[:, None]) & (table > 0) & (table < P)
    forced = live & ((idx < sink) | (idx >= n_pages[:, None] - recent))
    score = jnp.where(live, score, -jnp.inf)
    clipped = jnp.where(jnp.isinf(score), _FINITE_TOP, jnp.clip(score, -0.9 * _FINITE_TOP, 0.9 * _FINITE_TOP))  # fmt: skip
    priority = jnp.where(forced, jnp.inf, jnp.where(live, clipped, -jnp.inf))
    width = max(budget, M)
    priority = jnp.pad(priority, ((0, 0), (0, width - M)), constant_values=-jnp.inf)
    top, slot = jax.lax.top_k(priority, budget)  # ties: the lower index first
    chosen = top > -jnp.inf
    slots = jnp.sort(jnp.where(chosen, slot, M).astype(jnp.int32), axis=-1)
    return PageSelection(slots, jnp.sum(chosen, axis=-1, dtype=jnp.int32), score)


def retrieval_table(
    selection: PageSelection,
    page_table: Int[Array, "B M"],
    lengths: Int[Array, " B"],
    *,
    page_size: int,
) -> RetrievalTable:
    """A selection as a compacted page table: attend over it with ``paged.paged_attention``.

    ``paged.paged_attention(q, k_pages, v_pages, rt.page_table, rt.lengths,
    q_positions=q_positions - rt.offset[:, None])`` (the default ``q_positions`` when the
    queries are the sequence's last tokens) equals attention over exactly the selected pages
    for queries inside the contiguous tail of selected pages (a decode step's queries with
    ``recent_pages`` covering them). A kivi2 pool needs :func:`retrieval_pool` first.
    Jittable with ``page_size`` static.

    Args:
      selection: a :class:`PageSelection` (``slots [B, budget]``).
      page_table: ``[B, M]`` int page ids the selection was made over.
      lengths: ``[B]`` int tokens per sequence.
      page_size: ``C``.

    Returns:
      :class:`RetrievalTable` ``(page_table [B, budget], lengths [B], offset [B])``.

    Raises:
      ValueError: on shapes that disagree.

    Example:
      >>> sel = PageSelection(jnp.array([[0, 2, 4]]), jnp.array([3]), jnp.zeros((1, 5)))
      >>> rt = retrieval_table(sel, jnp.array([[7, 8, 9, 10, 11]]), jnp.array([9]), page_size=2)
      >>> rt.page_table.tolist(), rt.lengths.tolist(), rt.offset.tolist()
      ([[7, 9, 11]], [5], [4])
    """
    fn = "retrieval_table"
    if not isinstance(selection, PageSelection):
        raise ValueError(f"{fn}: selection: expected a paged.PageSelection, got {selection!r}")
    B, _ = check_table(fn, page_table, lengths, None)
    check_array(fn, "selection.slots", selection.slots, 2, jnp.integer)
    if selection.slots.shape[0] != B:
        raise ValueError(f"{fn}: selection.slots: expected {B} rows, got {describe(selection.slots)}")  # fmt: skip
    C = int_option(fn, "page_size", page_size, minimum=1)
    return _table_impl(selection.slots, page_table, lengths, C)


@functools.partial(jax.jit, static_argnums=3)
def _table_impl(slots, page_table, lengths, C: int):
    table = page_table.astype(jnp.int32)
    M = table.shape[1]
    chosen = slots < M
    ids = jnp.take_along_axis(table, jnp.clip(slots, 0, M - 1), axis=1)
    tokens = jnp.clip(lengths.astype(jnp.int32)[:, None] - slots * C, 0, C)
    tokens = jnp.where(chosen, tokens, 0)
    count = jnp.sum(chosen, axis=-1, dtype=jnp.int32)
    last = jnp.max(jnp.where(chosen, slots, -1), axis=-1)
    offset = jnp.where(count > 0, (last - (count - 1)) * C, 0)
    return RetrievalTable(
        jnp.where(chosen, ids, 0), jnp.sum(tokens, axis=-1, dtype=jnp.int32), offset
    )


def retrieval_pool(
    pool: Float[Array, "K P C H"] | QuantizedPages, offset: Int[Array, " B"]
) -> Float[Array, "K P C H"] | QuantizedPages:
    """A layer's pool as a compacted table (:class:`RetrievalTable`) reads it.

    A kivi2 pool's residual window (each row's most recent pages, addressed by position) is
    rotated and its written lengths moved back by ``offset``, so the window pages sit at
    their compacted positions; every window page must be selected (``recent_pages >=
    KVFormat.residual_pages(C)``). Any other pool is returned as it is. Jittable.

    Args:
      pool: ``[K, P, C, H]`` float pool or :class:`paged.QuantizedPages` (one layer).
      offset: ``[B]`` int, ``RetrievalTable.offset`` (a multiple of ``C``).

    Returns:
      The pool to pass to ``paged.paged_attention`` with the compacted table.

    Raises:
      ValueError: if ``offset`` is not ``[B]`` ints for a kivi2 pool's ``B`` rows.
    """
    residual = getattr(pool, "residual", None)
    if residual is None:
        return pool
    check_array("retrieval_pool", "offset", offset, 1, jnp.integer)
    if offset.shape[0] != residual.shape[-3]:
        raise ValueError(
            f"retrieval_pool: offset: expected {residual.shape[-3]} rows (the pool's residual "
            f"rows), got {describe(offset)}"
        )
    return _shift_window(pool, offset.astype(jnp.int32))


@jax.jit
def _shift_window(pool, offset):
    C = pool.shape[-2]
    res = pool.residual  # [*lead, B, W * C, H]
    W = res.shape[-2] // C
    B, H = res.shape[-3], res.shape[-1]
    pages = res.reshape(*res.shape[:-2], W, C, H)
    shift = offset // C  # [B]
    src = jnp.mod(jnp.arange(W, dtype=jnp.int32)[None] + shift[:, None], W)  # [B, W]
    src = src.reshape((1,) * (res.ndim - 3) + (B, W, 1, 1))
    pages = jnp.take_along_axis(pages, src, axis=-3)
    return dataclasses.replace(
        pool, residual=pages.reshape(res.shape), residual_len=pool.residual_len - offset
    )
