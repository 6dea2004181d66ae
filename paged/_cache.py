"""A paged KV cache for all layers of a model, as a pytree of fixed structure.

``PagedKVCache`` holds the pools of every layer, ``k_pages, v_pages``: each a
:class:`paged.LayerPools` of ``L`` pools ``[K, P, C, H]``, one buffer per layer, standing for
the stacked ``[L, K, P, C, H]`` (its ``shape``); one page table ``page_table [B, M]`` shared by
the layers (a page id names the same slot in every layer's pool) and ``lengths [B]``. The page
size ``C`` is the static ``k_pages.shape[3]``. One buffer per layer is what lets a jitted step
with the cache donated write and read a layer in place: its cost is the tokens it touches, not
the pool (a stacked buffer made XLA copy a layer per layer read).

A model's step writes layer ``l``'s new KV with :func:`write_layer` and attends with
:func:`paged.paged_attention` over ``lengths + T`` tokens; after the last layer,
:func:`advance` moves ``lengths`` on by ``T``. :func:`append` and :func:`write` do both for
all layers at once (one decode token; a prefill chunk).
The writes live in :mod:`paged._cache_write`; this module holds the cache type,
:func:`init_paged_cache`, :func:`gather_kv` and :func:`with_page_table`.

The host allocator's page table and lengths enter the cache through :func:`with_page_table`
(never ``cache._replace``); its copy plans through :func:`paged.copy_pages`.

Writes are scatters with ``mode="drop"``: under ``jit`` a token whose slot is past the table,
at a negative position, or whose page is the null page 0 or an out-of-range id is dropped,
never written into page 0 or another page (and :func:`append` still counts it in
``lengths``: :func:`paged.validate` then says so). An eager call (concrete arguments, see
``paged._checks.concrete_values``) raises ``ValueError`` on such a token instead, naming the
sequence and slot, and so does every function here on lengths past capacity or on a slot
inside a length without a real page. Which pages a sequence owns is the host allocator's
business (:mod:`paged`'s ``PageAllocator``) or the on-device free stack's
(:func:`paged.ensure_next_page`); this module only moves data.

With a :class:`paged.KVFormat` (``init_paged_cache(..., kv_format=KVFormat("int8"))``) the
pools are :class:`paged.QuantizedPages` (``data [L, K, P, C, H]`` int8 / float8_e4m3fn plus
``scale [L, K, P, C]`` float32; int4: ``data [L, K, P, C, H // 2]`` uint8 plus ``scale
[L, K, P, C, H // group_size]`` bfloat16): every write quantizes each token's ``[H]`` vector
per kv head on the way in, :func:`gather_kv` decodes to float32, and ``cache.k_pages[layer]`` is the
layer's quantized pool, which the paged attention functions take as they take a float pool.
(The shapes above are ``LayerPools.shape``; each layer holds ``[K, P, C, H]`` data.)

Every function here is jittable as it is (``jax.jit(write)``); ``gather_kv`` takes its layer
as a static argument (``jax.jit(gather_kv, static_argnums=1)``).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from paged import _kivi
from paged._checks import (
    check_array,
    check_table_values,
    describe,
    int_option,
    layer_index,
)
from paged._layers import LayerPools, as_layer_pools, unit_stack
from paged._quantized import KVFormat, QuantizedPages, is_quantized, take_decoded

__all__ = ["PagedKVCache", "gather_kv", "init_paged_cache", "with_page_table"]

IntScalar = int | np.integer


class PagedKVCache(NamedTuple):
    """KV pools of all layers plus the page table and lengths of each sequence.

    Attributes:
      k_pages: keys, a :class:`paged.LayerPools` of ``L`` per-layer pools ``[K, P, C, H]``
        (``shape`` ``[L, K, P, C, H]``); ``k_pages[l][h, page_table[b, i // C], i % C]`` is
        token ``i`` of sequence ``b``. Page 0 is the null page. Each layer is a float array,
        or a :class:`paged.QuantizedPages` (scales ``[K, P, C]``, int4
        ``[K, P, C, H // group_size]``) for a cache built with a ``kv_format``.
      v_pages: values, of the same kind as ``k_pages``.
      page_table: ``[B, M]`` int32 page ids (0 = no page).
      lengths: ``[B]`` int32 valid tokens per sequence.
    """

    k_pages: LayerPools
    v_pages: LayerPools
    page_table: Int[Array, "B M"]
    lengths: Int[Array, " B"]

    @property
    def page_size(self) -> int:
        """Tokens per page ``C`` (static)."""
        return self.k_pages.shape[3]

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold, ``M * C`` (static)."""
        return self.page_table.shape[1] * self.k_pages.shape[3]

    @property
    def kv_format(self) -> KVFormat | None:
        """The pools' :class:`paged.KVFormat`, or None for float pools (static)."""
        return self.k_pages[0].format if is_quantized(self.k_pages[0]) else None


def init_paged_cache(
    num_layers: IntScalar,
    num_kv_heads: IntScalar,
    num_pages: IntScalar,
    page_size: IntScalar,
    head_dim: IntScalar,
    batch: IntScalar,
    max_pages_per_seq: IntScalar,
    dtype=jnp.float32,
    *,
    kv_format: KVFormat | None = None,
) -> PagedKVCache:
    """An empty cache: zero pools, every table slot on the null page, lengths 0.

    Sizes are Python/numpy ints; to build it under ``jit``, make them static:
    ``jax.jit(init_paged_cache, static_argnums=range(7), static_argnames=("dtype",))``.

    Args:
      num_layers: ``L``.
      num_kv_heads: ``K``.
      num_pages: ``P`` pages per pool, page 0 included (so ``>= 2``).
      page_size: ``C`` tokens per page (any positive int; powers of two are tested).
      head_dim: ``H``.
      batch: ``B`` sequences.
      max_pages_per_seq: ``M`` page-table slots per sequence.
      dtype: pool dtype (a float dtype). Still checked, but unused with a ``kv_format``.
      kv_format: None (float pools of ``dtype``, as always) or a :class:`paged.KVFormat`:
        each layer's pool is then a :class:`paged.QuantizedPages` (data ``[K, P, C, H]`` in
        ``kv_format.storage_dtype``, zero; scales ``[K, P, C]`` float32, zero; int4: data
        ``[K, P, C, H // 2]`` uint8 and scales ``[K, P, C, H // group_size]`` bfloat16),
        read back as float32.

    Returns:
      A :class:`PagedKVCache` whose ``k_pages`` and ``v_pages`` are :class:`paged.LayerPools`
      of ``L`` separate buffers.

    Raises:
      ValueError: on a non-positive size, ``num_pages < 2``, a non-float dtype or a
        ``kv_format`` that is not a :class:`paged.KVFormat`, or (int4) a ``head_dim`` that
        is not a multiple of its ``group_size``.

    Example:
      >>> cache = init_paged_cache(2, 1, 8, 4, 16, batch=2, max_pages_per_seq=3)
      >>> cache.k_pages.shape, cache.capacity
      ((2, 1, 8, 4, 16), 12)
    """
    fn = "init_paged_cache"
    L = int_option(fn, "num_layers", num_layers, minimum=1)
    K = int_option(fn, "num_kv_heads", num_kv_heads, minimum=1)
    P = int_option(fn, "num_pages", num_pages, minimum=2)
    C = int_option(fn, "page_size", page_size, minimum=1)
    H = int_option(fn, "head_dim", head_dim, minimum=1)
    B = int_option(fn, "batch", batch, minimum=1)
    M = int_option(fn, "max_pages_per_seq", max_pages_per_seq, minimum=1)
    try:
        floating = jnp.issubdtype(dtype, jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(f"{fn}: dtype: expected a float dtype, got {dtype!r}")
    # ``pool(grouping)``: one layer's zero pool; ``grouping`` matters to kivi2 alone (keys per
    # channel, values per token).
    if kv_format is None:

        def pool(grouping):
            return jnp.zeros((K, P, C, H), dtype)

    elif isinstance(kv_format, KVFormat) and kv_format.kind == "kivi2":
        if H % 4:
            raise ValueError(f"{fn}: head_dim: kivi2 packs 4 codes a byte: H % 4 == 0, got {H}")

        def pool(grouping):
            stats = kv_format.scale_shape((K, P, C, H), grouping)
            return QuantizedPages(
                jnp.zeros((K, P, C, H // 4), jnp.uint8),
                jnp.zeros(stats, jnp.bfloat16),
                kv_format,
                zero=jnp.zeros(stats, jnp.bfloat16),
                residual=jnp.zeros((K, B, kv_format.residual_pages(C) * C, H), jnp.float32),
                residual_len=jnp.zeros((K, B), jnp.int32),
                grouping=grouping,
            )

    elif isinstance(kv_format, KVFormat):
        kv_format.check_head_dim(fn, "head_dim", H)
        shape = (K, P, C, H)

        def pool(grouping):
            return QuantizedPages(
                jnp.zeros(kv_format.data_shape(shape), kv_format.storage_dtype),
                jnp.zeros(kv_format.scale_shape(shape), kv_format.scale_dtype),
                kv_format,
            )

    else:
        raise ValueError(f"{fn}: kv_format: expected None or a paged.KVFormat, got {kv_format!r}")
    # One buffer per layer (never one array sliced L ways), keys and values apart.
    return PagedKVCache(
        k_pages=LayerPools(pool("channel") for _ in range(L)),
        v_pages=LayerPools(pool("token") for _ in range(L)),
        page_table=jnp.zeros((B, M), jnp.int32),
        lengths=jnp.zeros((B,), jnp.int32),
    )


def _check_cache_table(fn: str, cache: PagedKVCache, lengths=None, lengths_name="lengths"):
    """Eager calls: lengths within capacity and on real pages (see
    :func:`check_table_values`)."""
    check_table_values(
        fn,
        cache.page_table,
        cache.lengths if lengths is None else lengths,
        num_pages=cache.k_pages.shape[2],
        page_size=cache.k_pages.shape[3],
        table_name="cache.page_table",
        lengths_name=lengths_name,
    )


def _is_kivi(cache) -> bool:
    first = cache.k_pages[0]
    return is_quantized(first) and first.format.kind == "kivi2"


def gather_kv(
    cache: PagedKVCache, layer: IntScalar
) -> tuple[Float[Array, "B S K H"], Float[Array, "B S K H"]]:
    """Contiguous ``k, v [B, M * C, K, H]`` of one layer (for tests and debugging).

    Tokens at positions ``>= lengths`` or on a null / out-of-range page are zeros. A quantized
    cache returns its decoded values, float32 (``data * scale``).

    Jit with the layer static: ``jax.jit(gather_kv, static_argnums=1)``.

    Raises:
      ValueError: if ``layer`` is not an int in ``[0, L)`` (a float is never truncated); if
        a length is past capacity or covers a slot without a real page (eager: always).

    Example:
      >>> k, v = gather_kv(init_paged_cache(1, 2, 4, 2, 8, batch=3, max_pages_per_seq=2), 0)
      >>> k.shape
      (3, 4, 2, 8)
    """
    layer = layer_index("gather_kv", layer, cache.k_pages.shape[0], traced_ok=False)
    _check_cache_table("gather_kv", cache, lengths_name="cache.lengths")
    return _gather_kv_impl(cache, layer)


@functools.partial(jax.jit, static_argnums=1)
def _gather_kv_impl(cache, layer):
    _, K, P, C, H = cache.k_pages.shape
    B, M = cache.page_table.shape
    ids = cache.page_table
    page_ok = (ids > 0) & (ids < P)
    ids = jnp.where(page_ok, ids, 0)
    pos = jnp.arange(M * C)
    ok = jnp.repeat(page_ok, C, axis=1) & (pos[None] < cache.lengths[:, None])  # [B, S]

    def one(pools):
        pool = pools[layer]  # the layer's own buffer, read in place
        x = take_decoded(pool, (slice(None), ids))  # [K, B, M, C, H]
        x = x.transpose(1, 2, 3, 0, 4).reshape(B, M * C, K, H)
        residual = getattr(pool, "residual", None)
        if residual is not None:  # kivi2: each sequence's recent pages from its window
            res = residual.transpose(1, 2, 0, 3)  # [B, W * C, K, H]
            filled = pool.residual_len[0]  # [B] tokens written to the layer
            inside, idx = _kivi.window_slot(pos[None], filled[:, None], C, res.shape[1] // C)
            tail = jnp.take_along_axis(res, idx[:, :, None, None], axis=1)
            x = jnp.where(inside[:, :, None, None], tail, x)
        return jnp.where(ok[:, :, None, None], x, jnp.zeros((), x.dtype))

    return one(cache.k_pages), one(cache.v_pages)


def with_page_table(
    cache: PagedKVCache,
    page_table: Int[Array | np.ndarray, "B M"],
    lengths: Int[Array | np.ndarray, " B"] | None = None,
) -> PagedKVCache:
    """The cache with a new page table (and lengths): the hand-off from the host allocator.

    ``paged.PageAllocator.page_table(seqs)`` and ``.lengths(seqs)`` (numpy int32) go in as
    they are; the pools are untouched. Jittable as it is (``jax.jit(with_page_table)``).
    An eager call also checks the values: lengths in ``[0, M * C]`` and a real page in every
    slot holding a token (:func:`paged.validate` checks more: distinct pages, all ids).

    A kivi2 cache given ``lengths`` also re-seats each row's residual window (its most recent
    pages in full precision, see :mod:`paged._kivi`): a window page that the row still holds
    at the same index on the same page id keeps its exact tokens, cut at the new length; any
    other window page (a new sequence, a prefix hit, a truncation into older pages) is taken
    from the decoded page stored there (lossy: the window is refilled as tokens arrive). A
    page-aligned length with ``residual=0`` (the allocator's prefix hits) needs nothing stored.

    Args:
      cache: the cache.
      page_table: ``[B, M]`` int page ids, the cache's shape (numpy or jax).
      lengths: ``[B]`` int lengths; ``None`` keeps ``cache.lengths`` (e.g. after the device
        advanced them and the host only added pages).

    Returns:
      The cache with ``page_table`` and ``lengths`` replaced, as int32.

    Raises:
      ValueError: if ``page_table`` is not ``[B, M]`` ints of the cache's shape, or
        ``lengths`` not ``[B]`` ints; on an eager call, a length past capacity or a slot
        inside a length holding an id outside ``[0, P)``. The null page is accepted there:
        it marks a page absent on purpose (``PageAllocator.release_pages``, a dropped or
        demoted page), which attention masks; ``paged.validate`` and the eager attention
        calls report it.

    Example:
      >>> from paged import PageAllocator
      >>> alloc = PageAllocator(8, 2, max_pages_per_seq=3)
      >>> _ = alloc.allocate("a", 3)
      >>> cache = init_paged_cache(1, 1, 8, 2, 4, batch=1, max_pages_per_seq=3)
      >>> cache = with_page_table(cache, alloc.page_table(["a"]), alloc.lengths(["a"]))
      >>> cache.page_table.tolist(), cache.lengths.tolist()
      ([[1, 2, 0]], [3])
    """
    fn = "with_page_table"
    check_array(fn, "page_table", page_table, 2, jnp.integer)
    if tuple(page_table.shape) != tuple(cache.page_table.shape):
        raise ValueError(
            f"{fn}: page_table: expected the cache's shape [B, M] = "
            f"{tuple(cache.page_table.shape)}, got {describe(page_table)}"
        )
    given = lengths is not None
    if lengths is None:
        lengths = cache.lengths
    check_array(fn, "lengths", lengths, 1, jnp.integer)
    if tuple(lengths.shape) != tuple(cache.lengths.shape):
        raise ValueError(
            f"{fn}: lengths: expected shape {tuple(cache.lengths.shape)}, got {describe(lengths)}"
        )
    check_table_values(
        fn,
        page_table,
        lengths,
        num_pages=cache.k_pages.shape[2],
        page_size=cache.k_pages.shape[3],
        lengths_name="lengths" if given else "cache.lengths",
        allow_null=True,  # the allocator's hand-off: released / absent slots are null
    )
    old_table = cache.page_table
    cache = cache._replace(
        page_table=jnp.asarray(page_table, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32)
    )
    if given and _is_kivi(cache):
        cache = _reseat(cache, old_table)
    return cache


@jax.jit
def _reseat(cache, old_table):
    table, lengths = cache.page_table, cache.lengths

    def one(pools):
        return LayerPools(
            _kivi.reseat(unit_stack(pool), old_table, table, lengths)[0]
            for pool in as_layer_pools(pools)
        )

    return cache._replace(k_pages=one(cache.k_pages), v_pages=one(cache.v_pages))
