"""A paged KV cache for all layers of a model, as a pytree of fixed structure.

``PagedKVCache`` holds the pools of every layer, ``k_pages, v_pages [L, K, P, C, H]``, one page
table ``page_table [B, M]`` shared by the layers (a page id names the same slot in every layer's
pool) and ``lengths [B]``. The page size ``C`` is the static ``k_pages.shape[3]``.

A model's step writes layer ``l``'s new KV with :func:`write_layer` and attends with
:func:`paged.paged_attention` over ``lengths + T`` tokens; after the last layer,
:func:`advance` moves ``lengths`` on by ``T``. :func:`append` and :func:`write` do both for
all layers at once (one decode token; a prefill chunk).

Writes are scatters with ``mode="drop"``: a token whose slot is past the table, at a negative
position, or whose page is the null page 0 or an out-of-range id is silently dropped, never
written into page 0 or another page. Which pages a sequence owns is the host allocator's
business (:mod:`paged`'s ``PageAllocator``) or the on-device free stack's
(:func:`paged.ensure_next_page`); this module only moves data. :func:`validate` checks a cache
eagerly and loudly.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = [
    "PagedKVCache",
    "advance",
    "append",
    "copy_pages",
    "gather_kv",
    "init_paged_cache",
    "validate",
    "validate_page_table",
    "write",
    "write_layer",
]


class PagedKVCache(NamedTuple):
    """KV pools of all layers plus the page table and lengths of each sequence.

    Attributes:
      k_pages: ``[L, K, P, C, H]`` keys; ``k_pages[l, h, page_table[b, i // C], i % C]`` is
        token ``i`` of sequence ``b``. Page 0 is the null page.
      v_pages: ``[L, K, P, C, H]`` values.
      page_table: ``[B, M]`` int32 page ids (0 = no page).
      lengths: ``[B]`` int32 valid tokens per sequence.
    """

    k_pages: Float[Array, "L K P C H"]
    v_pages: Float[Array, "L K P C H"]
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


def _positive_int(fn: str, name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{fn}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def init_paged_cache(
    num_layers: int,
    num_kv_heads: int,
    num_pages: int,
    page_size: int,
    head_dim: int,
    batch: int,
    max_pages_per_seq: int,
    dtype=jnp.float32,
) -> PagedKVCache:
    """An empty cache: zero pools, every table slot on the null page, lengths 0.

    Args:
      num_layers: ``L``.
      num_kv_heads: ``K``.
      num_pages: ``P`` pages per pool, page 0 included (so ``>= 2``).
      page_size: ``C`` tokens per page (any positive int; powers of two are tested).
      head_dim: ``H``.
      batch: ``B`` sequences.
      max_pages_per_seq: ``M`` page-table slots per sequence.
      dtype: pool dtype (a float dtype).

    Returns:
      A :class:`PagedKVCache`.

    Raises:
      ValueError: on a non-positive size, ``num_pages < 2`` or a non-float dtype.

    Example:
      >>> cache = init_paged_cache(2, 1, 8, 4, 16, batch=2, max_pages_per_seq=3)
      >>> cache.k_pages.shape, cache.capacity
      ((2, 1, 8, 4, 16), 12)
    """
    fn = "init_paged_cache"
    L = _positive_int(fn, "num_layers", num_layers)
    K = _positive_int(fn, "num_kv_heads", num_kv_heads)
    P = _positive_int(fn, "num_pages", num_pages, 2)
    C = _positive_int(fn, "page_size", page_size)
    H = _positive_int(fn, "head_dim", head_dim)
    B = _positive_int(fn, "batch", batch)
    M = _positive_int(fn, "max_pages_per_seq", max_pages_per_seq)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{fn}: dtype must be a float dtype, got {dtype}")
    pool = jnp.zeros((L, K, P, C, H), dtype)
    return PagedKVCache(
        k_pages=pool,
        v_pages=jnp.zeros_like(pool),
        page_table=jnp.zeros((B, M), jnp.int32),
        lengths=jnp.zeros((B,), jnp.int32),
    )


def _check_kv(fn: str, cache: PagedKVCache, k, v, *, per_layer: bool):
    """Returns ``k, v`` as ``[(L,) B, T, K, H]`` after checking them against the cache."""
    L, K, _, _, H = cache.k_pages.shape
    B = cache.page_table.shape[0]
    lead = () if per_layer else (L,)
    for name, x in (("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{fn}: {name} must be an array, got {type(x).__name__}")
    if k.shape != v.shape:
        raise ValueError(f"{fn}: k and v must have the same shape, got {k.shape} and {v.shape}")
    if k.ndim == len(lead) + 3:  # one token: [(L,) B, K, H]
        k, v = k[..., None, :, :], v[..., None, :, :]
    if k.ndim != len(lead) + 4 or k.shape[: len(lead) + 1] != (*lead, B) or k.shape[-2:] != (K, H):
        want = "[B, T, K, H] or [B, K, H]" if per_layer else "[L, B, T, K, H] or [L, B, K, H]"
        raise ValueError(
            f"{fn}: k/v must have shape {want} with L={L}, B={B}, K={K}, H={H}; got {k.shape}"
        )
    return k.astype(cache.k_pages.dtype), v.astype(cache.v_pages.dtype)


def _start_positions(fn: str, start, B: int):
    start = jnp.asarray(start)
    if not jnp.issubdtype(start.dtype, jnp.integer) or start.shape not in ((), (B,)):
        raise ValueError(
            f"{fn}: start must be an int scalar or shape ({B},) ints, got shape "
            f"{tuple(start.shape)} dtype {start.dtype}"
        )
    return jnp.broadcast_to(start.astype(jnp.int32), (B,))


def _target_pages(cache: PagedKVCache, start, T: int):
    """Page ids and in-page offsets ``[B, T]`` of positions ``start ... start + T - 1``.

    Unwritable tokens (negative position, slot past the table, null or out-of-range page) get
    page id ``P``, which a ``mode="drop"`` scatter ignores (a negative id would wrap).
    """
    P, C = cache.k_pages.shape[2], cache.k_pages.shape[3]
    M = cache.page_table.shape[1]
    pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    slot = pos // C
    in_table = (pos >= 0) & (slot < M)
    ids = jnp.take_along_axis(cache.page_table, jnp.clip(slot, 0, M - 1), axis=1)
    ok = in_table & (ids > 0) & (ids < P)
    return jnp.where(ok, ids, P), pos % C


def write_layer(
    cache: PagedKVCache,
    layer: Int[Array, ""] | int,
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    start: Int[Array, " B"] | int,
) -> PagedKVCache:
    """Writes one layer's KV for positions ``start ... start + T - 1``; lengths unchanged.

    Args:
      cache: the cache.
      layer: layer index (int or traced scalar; out of range drops the write).
      k: ``[B, T, K, H]`` keys (or ``[B, K, H]`` for one token).
      v: ``[B, T, K, H]`` values (or ``[B, K, H]``).
      start: ``[B]`` or scalar int position of the first token, e.g. ``cache.lengths``.

    Returns:
      The updated cache. Tokens without a real page are dropped (see module docs).

    Raises:
      ValueError: on shapes that do not match the cache.

    Example:
      >>> cache = init_paged_cache(1, 1, 4, 2, 8, batch=1, max_pages_per_seq=2)
      >>> cache = cache._replace(page_table=jnp.array([[3, 1]]))
      >>> cache = write_layer(cache, 0, jnp.ones((1, 3, 1, 8)), jnp.ones((1, 3, 1, 8)), 0)
      >>> float(cache.k_pages[0, 0, 1, 0, 0]), float(cache.k_pages[0, 0, 1, 1, 0])
      (1.0, 0.0)
    """
    fn = "write_layer"
    k, v = _check_kv(fn, cache, k, v, per_layer=True)
    B, T = k.shape[:2]
    start = _start_positions(fn, start, B)
    return _write_layer_impl(cache, jnp.asarray(layer, jnp.int32), k, v, start)


@jax.jit
def _write_layer_impl(cache, layer, k, v, start):
    ids, offset = _target_pages(cache, start, k.shape[1])
    L = cache.k_pages.shape[0]
    layer = jnp.where((layer >= 0) & (layer < L), layer, L)  # out of range: dropped
    # Index [layer, :, ids, offset]: the advanced indices broadcast to [B, T] and lead.
    k_pages = cache.k_pages.at[layer, :, ids, offset].set(k, mode="drop")
    v_pages = cache.v_pages.at[layer, :, ids, offset].set(v, mode="drop")
    return cache._replace(k_pages=k_pages, v_pages=v_pages)


def advance(cache: PagedKVCache, n: Int[Array, " B"] | int) -> PagedKVCache:
    """Adds ``n`` (scalar or ``[B]``) to ``lengths``, clipped to ``[0, capacity]``.

    Raises:
      ValueError: if ``n`` is not an int scalar or ``[B]`` ints.

    Example:
      >>> advance(init_paged_cache(1, 1, 4, 2, 8, batch=2, max_pages_per_seq=2), 3).lengths
      Array([3, 3], dtype=int32)
    """
    n = _start_positions("advance", n, cache.lengths.shape[0])
    return cache._replace(lengths=jnp.clip(cache.lengths + n, 0, cache.capacity))


def append(
    cache: PagedKVCache, k: Float[Array, "L B K H"], v: Float[Array, "L B K H"]
) -> PagedKVCache:
    """Writes one decode token per sequence for every layer at ``lengths``, then advances by 1.

    Args:
      cache: the cache.
      k: ``[L, B, K, H]`` (or ``[L, B, 1, K, H]``) keys of the new token.
      v: ``[L, B, K, H]`` (or ``[L, B, 1, K, H]``) values.

    Returns:
      The updated cache. A sequence whose next slot has no page drops its token but its
      length still grows (pair with :func:`paged.ensure_next_page` and :func:`write_layer` +
      ``advance(cache, ok)`` to stop such sequences instead).

    Raises:
      ValueError: on shapes that do not match the cache.

    Example:
      >>> cache = init_paged_cache(2, 1, 4, 2, 8, batch=1, max_pages_per_seq=2)
      >>> cache = append(cache._replace(page_table=jnp.array([[2, 0]])),
      ...                jnp.ones((2, 1, 1, 8)), jnp.ones((2, 1, 1, 8)))
      >>> cache.lengths
      Array([1], dtype=int32)
    """
    k, v = _check_kv("append", cache, k, v, per_layer=False)
    if k.shape[2] != 1:
        raise ValueError(f"append: k/v must hold one token per sequence, got T={k.shape[2]}")
    return write(cache, k, v, cache.lengths)


def write(
    cache: PagedKVCache,
    k: Float[Array, "L B T K H"],
    v: Float[Array, "L B T K H"],
    start: Int[Array, " B"] | int,
) -> PagedKVCache:
    """Writes a chunk for every layer at ``start ... start + T - 1`` (prefill).

    ``lengths`` becomes ``max(lengths, start + T)`` (clipped to capacity).

    Args:
      cache: the cache.
      k: ``[L, B, T, K, H]`` keys (or ``[L, B, K, H]`` for one token).
      v: ``[L, B, T, K, H]`` values.
      start: ``[B]`` or scalar int first position.

    Returns:
      The updated cache (unwritable tokens dropped, see module docs).

    Raises:
      ValueError: on shapes that do not match the cache.

    Example:
      >>> cache = init_paged_cache(1, 1, 4, 2, 8, batch=1, max_pages_per_seq=2)
      >>> cache = cache._replace(page_table=jnp.array([[2, 3]]))
      >>> write(cache, jnp.ones((1, 1, 3, 1, 8)), jnp.ones((1, 1, 3, 1, 8)), 0).lengths
      Array([3], dtype=int32)
    """
    fn = "write"
    k, v = _check_kv(fn, cache, k, v, per_layer=False)
    start = _start_positions(fn, start, k.shape[1])
    return _write_impl(cache, k, v, start)


@jax.jit
def _write_impl(cache, k, v, start):
    L, _, T = k.shape[:3]
    ids, offset = _target_pages(cache, start, T)
    # [L, :, ids, offset] -> indexed shape [L, B, T, K, H] (advanced dims after the slice).
    layers = jnp.arange(L)[:, None, None]
    k_pages = cache.k_pages.at[layers, :, ids[None], offset[None]].set(k, mode="drop")
    v_pages = cache.v_pages.at[layers, :, ids[None], offset[None]].set(v, mode="drop")
    lengths = jnp.clip(jnp.maximum(cache.lengths, start + T), 0, cache.capacity)
    return PagedKVCache(k_pages, v_pages, cache.page_table, lengths)


def gather_kv(
    cache: PagedKVCache, layer: int
) -> tuple[Float[Array, "B S K H"], Float[Array, "B S K H"]]:
    """Contiguous ``k, v [B, M * C, K, H]`` of one layer (for tests and debugging).

    Tokens at positions ``>= lengths`` or on a null / out-of-range page are zeros.

    Raises:
      ValueError: if ``layer`` is not a valid int layer index.

    Example:
      >>> k, v = gather_kv(init_paged_cache(1, 2, 4, 2, 8, batch=3, max_pages_per_seq=2), 0)
      >>> k.shape
      (3, 4, 2, 8)
    """
    L, K, P, C, H = cache.k_pages.shape
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < L:
        raise ValueError(f"gather_kv: layer must be an int in [0, {L}), got {layer!r}")
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

    def one(pool):
        x = pool[layer][:, ids]  # [K, B, M, C, H]
        x = x.transpose(1, 2, 3, 0, 4).reshape(B, M * C, K, H)
        return jnp.where(ok[:, :, None, None], x, jnp.zeros((), x.dtype))

    return one(cache.k_pages), one(cache.v_pages)


def copy_pages(cache: PagedKVCache, src: Int[Array, " n"], dst: Int[Array, " n"]) -> PagedKVCache:
    """Copies pages ``src[i] -> dst[i]`` in every layer's pools (copy-on-write forks).

    Pairs whose ``dst`` is the null page or out of range are dropped; an invalid ``src``
    copies zeros. The page table is not changed.

    Raises:
      ValueError: if ``src`` and ``dst`` are not 1-D int arrays of one length.

    Example:
      >>> cache = init_paged_cache(1, 1, 4, 2, 8, batch=1, max_pages_per_seq=2)
      >>> cache = cache._replace(k_pages=cache.k_pages.at[:, :, 1].set(5.0))
      >>> float(copy_pages(cache, jnp.array([1]), jnp.array([3])).k_pages[0, 0, 3, 0, 0])
      5.0
    """
    src, dst = jnp.asarray(src), jnp.asarray(dst)
    if (
        src.ndim != 1
        or src.shape != dst.shape
        or not jnp.issubdtype(src.dtype, jnp.integer)
        or not jnp.issubdtype(dst.dtype, jnp.integer)
    ):
        raise ValueError(
            f"copy_pages: src and dst must be 1-D int arrays of one length, got src "
            f"{tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype}"
        )
    return _copy_pages_impl(cache, src, dst)


@jax.jit
def _copy_pages_impl(cache, src, dst):
    P = cache.k_pages.shape[2]
    src_ok = (src > 0) & (src < P)
    dst = jnp.where((dst > 0) & (dst < P), dst, P)

    def one(pool):
        data = jnp.take(pool, jnp.where(src_ok, src, 0), axis=2)  # [L, K, n, C, H]
        data = jnp.where(src_ok[None, None, :, None, None], data, jnp.zeros((), pool.dtype))
        return pool.at[:, :, dst].set(data, mode="drop")

    return cache._replace(k_pages=one(cache.k_pages), v_pages=one(cache.v_pages))


def validate_page_table(
    page_table: Int[Array, "B M"], lengths: Int[Array, " B"], *, num_pages: int, page_size: int
) -> None:
    """Eagerly checks a page table against a pool; raises on anything unsafe or inconsistent.

    Checks: ids in ``[0, num_pages)``; ``0 <= lengths <= M * page_size``; every slot holding
    a valid token (``j < ceil(lengths / C)``) names a real page (not the null page 0); no page
    appears twice among one sequence's used slots. (Sharing a page across sequences is legal:
    prefix caching and forks do it.)

    Args:
      page_table: ``[B, M]`` int page ids (concrete, not traced).
      lengths: ``[B]`` int lengths.
      num_pages: ``P``, pool size including the null page.
      page_size: ``C``.

    Raises:
      ValueError: naming the first offending sequence and slot.

    Example:
      >>> validate_page_table(jnp.array([[1, 0]]), jnp.array([2]), num_pages=4, page_size=2)
    """
    fn = "validate_page_table"
    table = np.asarray(page_table)
    lens = np.asarray(lengths)
    if table.ndim != 2 or lens.shape != (table.shape[0],):
        raise ValueError(
            f"{fn}: expected page_table [B, M] and lengths [B], got {table.shape} and {lens.shape}"
        )
    B, M = table.shape
    bad = np.argwhere((table < 0) | (table >= num_pages))
    if bad.size:
        b, j = bad[0]
        raise ValueError(
            f"{fn}: page_table[{b}, {j}] = {table[b, j]} is out of range [0, {num_pages})"
        )
    for b in range(B):
        if not 0 <= lens[b] <= M * page_size:
            raise ValueError(
                f"{fn}: lengths[{b}] = {lens[b]} is outside [0, {M * page_size}] (capacity)"
            )
        used = table[b, : -(-int(lens[b]) // page_size)]
        null = np.flatnonzero(used == 0)
        if null.size:
            raise ValueError(
                f"{fn}: sequence {b} has {lens[b]} tokens but slot {null[0]} is the null page 0"
            )
        ids, counts = np.unique(used, return_counts=True)
        if np.any(counts > 1):
            raise ValueError(f"{fn}: sequence {b} uses page {ids[counts > 1][0]} twice")


def validate(cache: PagedKVCache) -> None:
    """Eagerly checks a cache's shapes and page table (see :func:`validate_page_table`).

    Raises:
      ValueError: on inconsistent shapes, out-of-range ids, lengths over capacity, a null page
        inside a sequence, or a page used twice by one sequence.

    Example:
      >>> validate(init_paged_cache(1, 1, 4, 2, 8, batch=2, max_pages_per_seq=2))
    """
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"validate: expected a PagedKVCache, got {type(cache).__name__}")
    if cache.k_pages.ndim != 5 or cache.k_pages.shape != cache.v_pages.shape:
        raise ValueError(
            f"validate: k_pages and v_pages must both be [L, K, P, C, H], got "
            f"{cache.k_pages.shape} and {cache.v_pages.shape}"
        )
    if cache.page_table.ndim != 2 or cache.lengths.shape != (cache.page_table.shape[0],):
        raise ValueError(
            f"validate: expected page_table [B, M] and lengths [B], got "
            f"{cache.page_table.shape} and {cache.lengths.shape}"
        )
    validate_page_table(
        cache.page_table,
        cache.lengths,
        num_pages=cache.k_pages.shape[2],
        page_size=cache.k_pages.shape[3],
    )
