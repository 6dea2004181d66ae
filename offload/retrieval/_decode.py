"""The decode over two tiers (the package docs say how): host bounds, the selected fetch,
and the attention over the selected device and staged pages."""

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Shaped

from offload import (
    HostPagePool,
    OffloadStats,
    TransferHandle,
    mixed_residency_attention,
    prefetch_layer,
    wait,
)
from offload._checks import IdList, check_ids, check_int
from paged import (
    PageKeyBounds,
    QuantizedPages,
    retrieval_pool,
    retrieval_table,
    select_pages_by_query,
)

__all__ = [
    "RetrievalDecode",
    "StagedPages",
    "fetch_selected_pages",
    "retrieval_decode_attention",
    "with_host_bounds",
]


def with_host_bounds(
    bounds: PageKeyBounds,
    page_ids: IdList,
    host_slots: IdList,
    *,
    host_bounds: PageKeyBounds | None = None,
    num_slots: int | None = None,
) -> PageKeyBounds:
    """The key bounds of host slots after device pages ``page_ids`` were paged out to them.

    Call it beside ``page_out(k_pages, v_pages, page_ids, host_pool, host_slots)``: the host
    bounds ``[L, K, P_host, H]`` (or ``[K, P_host, H]``) stay on the device, so the pages
    remain candidates of every step's query-aware selection while their data is in host.

    Args:
      bounds: the device pool's ``paged.PageKeyBounds`` ``[L, K, P, H]`` (or one layer).
      page_ids: ``[n]`` device page ids paged out.
      host_slots: ``[n]`` host slots they went to.
      host_bounds: the host bounds to update; or None with ``num_slots`` for new ones
        (every slot empty: ``+inf / -inf``).
      num_slots: ``P_host`` when ``host_bounds`` is None.

    Returns:
      The host bounds with slot ``host_slots[i]`` holding page ``page_ids[i]``'s bounds.

    Raises:
      ValueError: on a ``bounds`` that is not a ``paged.PageKeyBounds``, both or neither of
        ``host_bounds`` / ``num_slots``, host bounds of other leading dims, ids that are not
        ``[n]`` ints in range or of different lengths.

    Example:
      >>> import paged
      >>> b = paged.PageKeyBounds(jnp.arange(4.0).reshape(1, 4, 1), jnp.ones((1, 4, 1)))
      >>> with_host_bounds(b, [3], [0], num_slots=2).k_min[0, :, 0].tolist()
      [3.0, inf]
    """
    fn = "with_host_bounds"
    if not isinstance(bounds, PageKeyBounds):
        raise ValueError(f"{fn}: bounds: expected a paged.PageKeyBounds, got {type(bounds).__name__}")  # fmt: skip
    if (host_bounds is None) == (num_slots is None):
        raise ValueError(f"{fn}: host_bounds: expected host_bounds or num_slots (one of them), got {'both' if num_slots is not None else 'neither'}")  # fmt: skip
    *lead, P, H = bounds.k_min.shape
    if host_bounds is None:
        S = check_int(fn, "num_slots", num_slots, low=1)
        host_bounds = PageKeyBounds(
            jnp.full((*lead, S, H), jnp.inf, jnp.float32),
            jnp.full((*lead, S, H), -jnp.inf, jnp.float32),
        )
    if not isinstance(host_bounds, PageKeyBounds) or (
        tuple(host_bounds.k_min.shape[:-2]) != tuple(lead) or host_bounds.k_min.shape[-1] != H
    ):
        raise ValueError(
            f"{fn}: host_bounds: expected PageKeyBounds [{', '.join(map(str, lead))}, P_host, "
            f"{H}] (the bounds' leading dims), got {getattr(host_bounds, 'k_min', host_bounds)!r}"
        )
    S = host_bounds.k_min.shape[-2]
    src = check_ids(fn, "page_ids", page_ids, P)
    dst = check_ids(fn, "host_slots", host_slots, S)
    if src.size != dst.size:
        raise ValueError(f"{fn}: host_slots: expected {src.size} slots (one per page id), got {dst.size}")  # fmt: skip
    return _copy_across(bounds, host_bounds, jnp.asarray(src), jnp.asarray(dst))


def check_host(fn: str, pool) -> None:
    """``pool`` is a :class:`~offload.HostPagePool`; its memory kind, format and residual are
    checked by the fetch itself (``offload.prefetch_layer``, before any copy)."""
    if not isinstance(pool, HostPagePool):
        raise ValueError(f"{fn}: host_pool: expected an offload.HostPagePool, got {type(pool).__name__}")  # fmt: skip


@jax.jit
def _copy_across(bounds, host_bounds, src, dst):
    def one(x, into):
        return into.at[..., dst, :].set(jnp.take(x, src, axis=-2))

    return PageKeyBounds(one(bounds.k_min, host_bounds.k_min), one(bounds.k_max, host_bounds.k_max))


class StagedPages(NamedTuple):
    """Host pages fetched for one layer's step (:func:`fetch_selected_pages`).

    Attributes:
      k_pages: ``[K, S, C, H]`` staging keys on the device (or ``paged.QuantizedPages``);
        staging id 0 is a dummy page the attention treats as the null page.
      v_pages: ``[K, S, C, H]`` staging values.
      table: ``[B, W]`` int32 staging id of each entry of the host table (0 = not staged).
      num_pages: distinct host pages asked for (``S - 1`` minus the padding).
      handle: the :class:`~offload.TransferHandle` of the copy (``nbytes``: all ``S`` pages
        moved, padding included).
    """

    k_pages: Shaped[Array, "K S C H"] | QuantizedPages
    v_pages: Shaped[Array, "K S C H"] | QuantizedPages
    table: Int[np.ndarray, "B W"]
    num_pages: int
    handle: TransferHandle


def fetch_selected_pages(
    host_pool: HostPagePool,
    host_table: Int[Array | np.ndarray, "B W"],
    *,
    layer: int,
    stats: OffloadStats | None = None,
    request_id: str | None = None,
) -> StagedPages:
    """Fetches exactly the host pages a table names, for one layer, into a staging pool.

    ``host_table`` holds host slots (``-1`` = none), e.g. the host part of a compacted
    retrieval table. The distinct slots (a page named twice is fetched once) go to staging
    ids ``1..n`` in increasing slot order; the pool has ``S = 1 + n`` pages rounded up to a
    power of two (the padding repeats slot ``0``; few distinct shapes compile). The copy is
    :func:`offload.prefetch_layer`'s: asynchronous, pinned host to device memory. Host-side
    (reads ``host_table``'s values: a synchronisation when it is a device array); not
    jittable.

    Args:
      host_pool: a :class:`~offload.HostPagePool` ``[L, K, P_host, C, H]``.
      host_table: ``[B, W]`` int host slots in ``[-1, P_host)``.
      layer: the layer to fetch.
      stats: an :class:`~offload.OffloadStats`: the copy is recorded as issued
        (``record_issue``); :func:`retrieval_decode_attention` records its completion.
      request_id: recorded on the handle.

    Returns:
      :class:`StagedPages`.

    Raises:
      ValueError: on a host pool that is not ``[L, K, P_host, C, H]`` in host memory, a
        ``host_table`` that is not ``[B, W]`` ints in ``[-1, P_host)``, or a bad ``layer``.

    Example:
      >>> from offload import make_host_page_pool
      >>> k = jnp.ones((2, 1, 6, 4, 8)); host = make_host_page_pool(k, k, 6)
      >>> staged = fetch_selected_pages(host, np.array([[4, -1, 2, 4]]), layer=1)
      >>> staged.table.tolist(), staged.num_pages, staged.k_pages.shape
      ([[2, 0, 1, 2]], 2, (1, 4, 4, 8))
    """
    fn = "fetch_selected_pages"
    check_host(fn, host_pool)
    if host_pool.k_pages.ndim != 5:
        raise ValueError(f"{fn}: host_pool: expected pools [L, K, P_host, C, H], got {host_pool.k_pages.shape}")  # fmt: skip
    table = np.asarray(host_table)
    if table.ndim != 2 or not np.issubdtype(table.dtype, np.integer):
        raise ValueError(f"{fn}: host_table: expected [B, W] ints, got shape {table.shape} dtype {table.dtype}")  # fmt: skip
    S_host = host_pool.num_slots
    if table.size and (table.min() < -1 or table.max() >= S_host):
        raise ValueError(f"{fn}: host_table: expected host slots in [-1, {S_host}), got values in [{table.min()}, {table.max()}]")  # fmt: skip
    ids = np.unique(table[table >= 0])
    n = int(ids.size)
    size = 1 << int(np.ceil(np.log2(n + 1))) if n else 1
    slots = np.zeros(size, np.int32)
    slots[1 : n + 1] = ids
    staging_ids = np.zeros(table.shape, np.int32)
    if n:
        staging_ids = np.where(table >= 0, np.searchsorted(ids, np.maximum(table, 0)) + 1, 0)
    handle = prefetch_layer(host_pool, slots, layer=layer, request_id=request_id)
    if stats is not None:
        stats.record_issue(handle.direction, handle.nbytes)
    stage_k, stage_v = handle.value
    return StagedPages(stage_k, stage_v, staging_ids.astype(np.int32), n, handle)


class RetrievalDecode(NamedTuple):
    """Result of :func:`retrieval_decode_attention`.

    Attributes:
      out: ``[B, T, N, H]`` attention output in ``q.dtype``.
      lse: ``[B, T, N]`` float32 log-sum-exp over the keys read.
      read_pages: ``[B]`` int32 pages each sequence read (device and fetched).
      fetched_pages: distinct host pages fetched for the step.
      fetched_bytes: bytes copied from host (the staging pool's, padding included).
    """

    out: Float[Array, "B T N H"]
    lse: Float[Array, "B T N"]
    read_pages: Int[Array, " B"]
    fetched_pages: int
    fetched_bytes: int


def checked_walk(fn, k_pages, bounds, host_bounds, num_slots, tables, options):
    """The checks both retrieval decodes share: one layer's ``bounds`` ``[K, P, H]`` and
    ``host_bounds`` ``[K, num_slots, H]`` against ``k_pages`` ``[K, P, C, H]``, ``tables =
    (device_table, host_table)`` of one shape, ``options = (budget, sink_pages, recent_pages)``
    (a kivi2 pool's residual window counted among the recent pages). Returns the static
    ``walk = (C, budget, sink, recent)`` of :func:`_select_tiers`."""
    if not isinstance(bounds, PageKeyBounds) or not isinstance(host_bounds, PageKeyBounds):
        raise ValueError(f"{fn}: bounds / host_bounds: expected one layer's paged.PageKeyBounds each")  # fmt: skip
    if bounds.k_min.ndim != 3 or host_bounds.k_min.ndim != 3:
        raise ValueError(
            f"{fn}: bounds / host_bounds: expected one layer's [K, P, H] and [K, P_host, H], got "
            f"{tuple(bounds.k_min.shape)} and {tuple(host_bounds.k_min.shape)}"
        )
    K, P, C, H = k_pages.shape
    if tuple(bounds.k_min.shape) != (K, P, H):
        raise ValueError(f"{fn}: bounds: expected [K, P, H] = {(K, P, H)} (the pool's), got {tuple(bounds.k_min.shape)}")  # fmt: skip
    if tuple(host_bounds.k_min.shape) != (K, num_slots, H):
        raise ValueError(f"{fn}: host_bounds: expected [K, P_host, H] = {(K, num_slots, H)}, got {tuple(host_bounds.k_min.shape)}")  # fmt: skip
    device_table, host_table = tables
    if tuple(host_table.shape) != tuple(device_table.shape):
        raise ValueError(f"{fn}: host_table: expected device_table's shape {tuple(device_table.shape)}, got {tuple(host_table.shape)}")  # fmt: skip
    budget, sink_pages, recent_pages = options
    budget = check_int(fn, "budget", budget, low=1)
    sink = check_int(fn, "sink_pages", sink_pages, low=0)
    recent = check_int(fn, "recent_pages", recent_pages, low=0)
    if getattr(k_pages, "residual", None) is not None:
        recent = max(recent, k_pages.format.residual_pages(C))
    if sink + recent > budget:
        raise ValueError(f"{fn}: budget: expected at least sink_pages + recent_pages = {sink + recent}, got {budget}")  # fmt: skip
    return C, budget, sink, recent


@functools.partial(jax.jit, static_argnums=(4,))
def _select_tiers(q, tier_bounds, tables, lengths, walk: tuple[int, int, int, int]):
    """Selects over both tiers' pages: ``tier_bounds = (bounds, host_bounds)``, ``tables =
    (device_table, host_table)``, ``walk = (C, budget, sink, recent)`` (static). Returns the
    compacted device ids, the host slots to fetch (``-1``: none), the compacted lengths and
    offsets and the pages selected per row."""
    (bounds, host_bounds), (device_table, host_table) = tier_bounds, tables
    C, budget, sink, recent = walk
    P = bounds.k_min.shape[-2]
    both = PageKeyBounds(
        jnp.concatenate([bounds.k_min, host_bounds.k_min], axis=-2),
        jnp.concatenate([bounds.k_max, host_bounds.k_max], axis=-2),
    )
    device_table = device_table.astype(jnp.int32)
    table = jnp.where(device_table > 0, device_table, jnp.where(host_table >= 0, P + host_table, 0))  # fmt: skip
    sel = select_pages_by_query(q, both, table, lengths, page_size=C, budget=budget,
                                sink_pages=sink, recent_pages=recent)  # fmt: skip
    rt = retrieval_table(sel, table, lengths, page_size=C)
    ids = rt.page_table
    on_device = jnp.where(ids < P, ids, 0)
    in_host = jnp.where(ids >= P, ids - P, -1)
    return on_device, in_host, rt.lengths, rt.offset, sel.count


@functools.partial(jax.jit, static_argnums=(5,))
def _attend_tiers(q, pools, compacted, staged, sinks, logits: tuple[float | None, float | None]):
    """Attention over the compacted device and staged tables, merged (one jitted program).

    ``pools = (k_pages, v_pages)``; ``compacted = (on_device, lengths, lengths_c, offset)``;
    ``staged = (table, k_pages, v_pages)`` of the staging pool; ``logits = (softcap, scale)``
    (static).
    """
    (k_pages, v_pages), (on_device, lengths, lengths_c, offset) = pools, compacted
    (stage_table, stage_k, stage_v), (softcap, scale) = staged, logits
    T = q.shape[1]
    q_positions = lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T, dtype=jnp.int32)
    return mixed_residency_attention(
        q, retrieval_pool(k_pages, offset), retrieval_pool(v_pages, offset), on_device,
        lengths_c, cold_table=stage_table, cold_k_pages=stage_k, cold_v_pages=stage_v,
        q_positions=q_positions - offset[:, None], softcap=softcap, scale=scale, sinks=sinks,
    )  # fmt: skip


def retrieval_decode_attention(
    q: Float[Array, "B T N H"],
    k_pages: Float[Array, "K P C H"] | QuantizedPages,
    v_pages: Float[Array, "K P C H"] | QuantizedPages,
    bounds: PageKeyBounds,
    device_table: Int[Array, "B M"],
    host_pool: HostPagePool,
    host_bounds: PageKeyBounds,
    host_table: Int[Array, "B M"],
    lengths: Int[Array, " B"],
    *,
    layer: int,
    budget: int,
    sink_pages: int = 1,
    recent_pages: int = 1,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: Float[Array, " N"] | None = None,
    stats: OffloadStats | None = None,
    request_id: str | None = None,
) -> RetrievalDecode:
    """One layer's decode attention over the ``budget`` pages its queries select, in either
    tier: device pages read in place, selected host pages fetched (see the module docs).

    Exact over the selected pages; with ``budget`` at least the live pages, equal to full
    attention over every page of both tiers. Host-side orchestration (one synchronisation on
    the selected host slots); the selection and the attention are jitted.

    Args:
      q: ``[B, T, N, H]`` queries at positions ``lengths - T ... lengths - 1``.
      k_pages: the layer's device key pool ``[K, P, C, H]`` (float or
        ``paged.QuantizedPages``; kivi2: its residual window must be on the device, and
        ``recent_pages`` cover it).
      v_pages: the layer's device value pool.
      bounds: the layer's device ``paged.PageKeyBounds`` ``[K, P, H]``.
      device_table: ``[B, M]`` int device page per slot (0 = not on the device).
      host_pool: the :class:`~offload.HostPagePool` ``[L, K, P_host, C, H]``.
      host_bounds: the layer's host bounds ``[K, P_host, H]`` (:func:`with_host_bounds`).
      host_table: ``[B, M]`` int host slot per slot (``-1`` = not in host); a slot on the
        device must be ``-1`` here.
      lengths: ``[B]`` int tokens per sequence (the queries' included).
      layer: the layer (of the host pool).
      budget: pages read per sequence (static).
      sink_pages: leading pages always read.
      recent_pages: trailing pages always read (cover the queries' pages).
      softcap: as in ``paged.paged_attention``.
      scale: as in ``paged.paged_attention``.
      sinks: ``[N]`` sink logits, joining the softmax once.
      stats: an :class:`~offload.OffloadStats` recording the fetch (host to device).
      request_id: recorded with the fetch.

    Returns:
      :class:`RetrievalDecode` ``(out, lse, read_pages, fetched_pages, fetched_bytes)``.

    Raises:
      ValueError: on shapes that disagree or a bad option.

    Example:
      >>> import paged
      >>> from offload import make_host_page_pool, page_out, wait
      >>> k = jnp.ones((1, 1, 4, 2, 8)); host = make_host_page_pool(k, k, 4)
      >>> host = wait(page_out(k, k, [2], host, [0]))
      >>> hb = with_host_bounds(paged.PageKeyBounds(jnp.ones((1, 1, 4, 8)), jnp.ones((1, 1, 4, 8))), [2], [0], num_slots=4)
      >>> res = retrieval_decode_attention(jnp.ones((1, 1, 1, 8)), k[0], k[0],
      ...     paged.PageKeyBounds(jnp.ones((1, 4, 8)), jnp.ones((1, 4, 8))), jnp.array([[1, 0]]),
      ...     host, hb.layer(0), jnp.array([[-1, 0]]), jnp.array([4]), layer=0, budget=2)
      >>> res.read_pages.tolist(), res.fetched_pages
      ([2], 1)
    """
    fn = "retrieval_decode_attention"
    check_host(fn, host_pool)
    K, _, C, H = k_pages.shape
    host_shape = host_pool.k_pages.shape
    if host_pool.k_pages.ndim != 5 or (host_shape[1], *host_shape[3:]) != (K, C, H):
        raise ValueError(f"{fn}: host_pool: expected [L, K={K}, P_host, C={C}, H={H}], got {tuple(host_shape)}")  # fmt: skip
    tables = (device_table, jnp.asarray(host_table, jnp.int32))
    walk = checked_walk(fn, k_pages, bounds, host_bounds, host_shape[2], tables,
                        (budget, sink_pages, recent_pages))  # fmt: skip
    layer = check_int(fn, "layer", layer, low=0, high=host_shape[0])
    on_device, in_host, lengths_c, offset, count = _select_tiers(q, (bounds, host_bounds), tables, lengths, walk)  # fmt: skip
    staged = fetch_selected_pages(host_pool, in_host, layer=layer, stats=stats, request_id=request_id)  # fmt: skip
    compacted = (on_device, lengths, lengths_c, offset)
    stage = (jnp.asarray(staged.table), staged.k_pages, staged.v_pages)
    res = _attend_tiers(q, (k_pages, v_pages), compacted, stage, sinks, (softcap, scale))
    if stats is not None:
        wait(staged.handle)
        seconds = time.perf_counter() - staged.handle.issued_at
        stats.record_transfer(staged.handle.direction, staged.handle.nbytes, seconds,
                              request_id=request_id, issued=True)  # fmt: skip
    return RetrievalDecode(res.out, res.lse, count, staged.num_pages, staged.handle.nbytes)
