"""Writing a paged KV cache: :func:`write_layer`, :func:`advance`, :func:`append`, :func:`write`.

A model's step writes layer ``l``'s new KV with :func:`write_layer` and, after the last layer,
moves ``lengths`` on by ``T`` with :func:`advance`; :func:`append` (one decode token) and
:func:`write` (a prefill chunk) do both for all layers at once. Writes are scatters with
``mode="drop"`` (see :mod:`paged._cache` for what is dropped under ``jit`` and what an eager
call raises instead); quantized pools quantize each token on the way in, kivi2 pools go through
:mod:`paged._kivi`. Every function here is jittable as it is.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from paged import _kivi
from paged._cache import IntScalar, PagedKVCache, _check_cache_table
from paged._checks import (
    check_write_values,
    concrete_values,
    describe,
    is_int,
    layer_index,
)
from paged._layers import LayerPools, as_layer_pools, unit_stack
from paged._quantized import is_quantized, set_tokens

__all__ = ["advance", "append", "write", "write_layer"]


def _check_kv(fn: str, cache: PagedKVCache, k, v, *, per_layer: bool):
    """Returns ``k, v`` as ``[(L,) B, T, K, H]`` after checking them against the cache."""
    L, K, _, _, H = cache.k_pages.shape
    B = cache.page_table.shape[0]
    lead = () if per_layer else (L,)
    for name, x in (("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{fn}: {name}: expected an array, got {type(x).__name__}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{fn}: {name}: expected a floating point array, got {describe(x)}")
    if k.shape != v.shape:
        raise ValueError(f"{fn}: v: expected the shape of k {k.shape}, got {v.shape}")
    if k.ndim == len(lead) + 3:  # one token: [(L,) B, K, H]
        k, v = k[..., None, :, :], v[..., None, :, :]
    if k.ndim != len(lead) + 4 or k.shape[: len(lead) + 1] != (*lead, B) or k.shape[-2:] != (K, H):
        want = "[B, T, K, H] or [B, K, H]" if per_layer else "[L, B, T, K, H] or [L, B, K, H]"
        raise ValueError(
            f"{fn}: k: expected shape {want} with L={L}, B={B}, K={K}, H={H}, got {k.shape}"
        )
    if is_quantized(cache.k_pages[0]):  # quantized from float32 on the way in
        return k.astype(jnp.float32), v.astype(jnp.float32)
    return k.astype(cache.k_pages.dtype), v.astype(cache.v_pages.dtype)


def _start_positions(fn: str, start, B: int, name: str = "start"):
    if isinstance(start, (bool, np.bool_)) or not (is_int(start) or hasattr(start, "dtype")):
        raise ValueError(f"{fn}: {name}: expected an int or shape ({B},) ints, got {start!r}")
    start = jnp.asarray(start)
    if not jnp.issubdtype(start.dtype, jnp.integer) or start.shape not in ((), (B,)):
        raise ValueError(
            f"{fn}: {name}: expected an int or shape ({B},) ints, got {describe(start)}"
        )
    return jnp.broadcast_to(start.astype(jnp.int32), (B,))


def _target_pages(cache: PagedKVCache, start, T: int, count=None):
    """Page ids and in-page offsets ``[B, T]`` of positions ``start ... start + T - 1``.

    Unwritable tokens (negative position, slot past the table, null or out-of-range page,
    past ``count [B]``) get page id ``P``, which a ``mode="drop"`` scatter ignores (a
    negative id would wrap).
    """
    P, C = cache.k_pages.shape[2], cache.k_pages.shape[3]
    M = cache.page_table.shape[1]
    pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)  # [B, T]
    slot = pos // C
    in_table = (pos >= 0) & (slot < M)
    ids = jnp.take_along_axis(cache.page_table, jnp.clip(slot, 0, M - 1), axis=1)
    ok = in_table & (ids > 0) & (ids < P)
    if count is not None:
        ok &= jnp.arange(T)[None, :] < count[:, None]
    return jnp.where(ok, ids, P), pos % C


def write_layer(
    cache: PagedKVCache,
    layer: Int[Array, ""] | IntScalar,
    k: Float[Array, "B T K H"] | Float[Array, "B K H"],
    v: Float[Array, "B T K H"] | Float[Array, "B K H"],
    start: Int[Array, " B"] | Int[Array, ""] | IntScalar,
    *,
    count: Int[Array, " B"] | Int[Array, ""] | IntScalar | None = None,
) -> PagedKVCache:
    """Writes one layer's KV for positions ``start ... start + T - 1``; lengths unchanged.

    Jittable as it is (``jax.jit(write_layer)``; ``layer`` may then be traced) and vmappable.
    A static ``layer`` writes that layer's buffer alone (in place when the cache is donated);
    a traced one scatters into every layer with the other layers' tokens dropped (``L``
    scatters of ``B * T`` tokens: the cost of the tokens, never of the pools).

    Args:
      cache: the cache.
      layer: layer index: an int in ``[0, L)`` or an integer 0-d array (traced: out of range
        drops the write). A float is a ``ValueError``, never truncated.
      k: ``[B, T, K, H]`` keys (or ``[B, K, H]`` for one token).
      v: ``[B, T, K, H]`` values (or ``[B, K, H]``).
      start: ``[B]`` or scalar int position of the first token, e.g. ``cache.lengths``.
      count: ``[B]`` or scalar int: write only the first ``count`` tokens of each row (the
        rest of a padded chunk is dropped); None writes all ``T``. A kivi2 cache needs it for
        padded chunks: its pages are stored once full, and padding would fill them.

    Returns:
      The updated cache. Under ``jit``, tokens without a real page are dropped (see module
      docs).

    Raises:
      ValueError: on shapes that do not match the cache, or a bad ``layer`` or ``count``;
        on an eager call, a token written without a real page (negative position, past the
        capacity ``M * C``, a null or out-of-range page id).

    Example:
      >>> cache = init_paged_cache(1, 1, 4, 2, 8, batch=1, max_pages_per_seq=2)
      >>> cache = with_page_table(cache, jnp.array([[3, 1]]))
      >>> cache = write_layer(cache, 0, jnp.ones((1, 3, 1, 8)), jnp.ones((1, 3, 1, 8)), 0)
      >>> float(cache.k_pages[0][0, 1, 0, 0]), float(cache.k_pages[0][0, 1, 1, 0])
      (1.0, 0.0)
    """
    fn = "write_layer"
    layer = layer_index(fn, layer, cache.k_pages.shape[0], traced_ok=True)
    k, v = _check_kv(fn, cache, k, v, per_layer=True)
    B, T = k.shape[:2]
    start = _start_positions(fn, start, B)
    count = _count(fn, count, B, T)
    _check_targets(fn, cache, start, count)
    if is_int(layer):
        return _write_static_layer(cache, int(layer), k, v, start, count)
    return _write_layer_impl(cache, jnp.asarray(layer, jnp.int32), k, v, start, count)


def _check_targets(fn: str, cache: PagedKVCache, start, count, start_name: str = "start"):
    """Eager calls: every token written has a real page (see :func:`check_write_values`)."""
    check_write_values(
        fn,
        cache.page_table,
        start,
        count,
        num_pages=cache.k_pages.shape[2],
        page_size=cache.k_pages.shape[3],
        start_name=start_name,
        table_name="cache.page_table",
    )


def _count(fn: str, count, B: int, T: int):
    if count is None:
        return jnp.full((B,), T, jnp.int32)
    return jnp.clip(_start_positions(fn, count, B, "count"), 0, T)


def _write_pool(cache, pool, select, x, start, count):
    """One layer's pool with ``x [B, T, K, H]`` written at ``start`` (``select``: an int32
    scalar, 0 writes and anything else drops every token)."""
    unit = unit_stack(pool)  # [1, K, P, C, H]: the stacked kernels, on a free reshape
    if is_quantized(pool) and pool.format.kind == "kivi2":
        layers = jnp.reshape(select, (1,))
        return _kivi_write(cache, unit, x[None], start, count, layers)[0]
    ids, offset = _target_pages(cache, start, x.shape[1], count)
    select = jnp.where(select == 0, 0, 1)  # 1 is past the unit stack: dropped
    # Index [select, :, ids, offset]: the advanced indices broadcast to [B, T] and lead.
    return set_tokens(unit, (select, slice(None), ids, offset), x)[0]


@functools.partial(jax.jit, static_argnums=1)
def _write_static_layer(cache, layer, k, v, start, count):
    zero = jnp.zeros((), jnp.int32)

    def one(pools, x):
        layers = list(as_layer_pools(pools))
        layers[layer] = _write_pool(cache, layers[layer], zero, x, start, count)
        return LayerPools(layers)

    return cache._replace(k_pages=one(cache.k_pages, k), v_pages=one(cache.v_pages, v))


@jax.jit
def _write_layer_impl(cache, layer, k, v, start, count):
    # A traced layer: every layer's buffer gets the scatter, all but ``layer``'s tokens
    # dropped (out of range: all dropped).
    def one(pools, x):
        return LayerPools(
            _write_pool(cache, pool, layer - i, x, start, count)
            for i, pool in enumerate(as_layer_pools(pools))
        )

    return cache._replace(k_pages=one(cache.k_pages, k), v_pages=one(cache.v_pages, v))


def advance(cache: PagedKVCache, n: Int[Array, " B"] | Int[Array, ""] | IntScalar) -> PagedKVCache:
    """Adds ``n`` (scalar or ``[B]``) to ``lengths``.

    Jittable as it is (``jax.jit(advance)``); under ``jit`` the result is clipped to
    ``[0, capacity]``.

    Raises:
      ValueError: if ``n`` is not an int scalar or ``[B]`` ints; on an eager call, if a new
        length is outside ``[0, capacity]`` or covers a slot without a real page.

    Example:
      >>> advance(init_paged_cache(1, 1, 4, 2, 8, batch=2, max_pages_per_seq=2), 3).lengths
      Array([3, 3], dtype=int32)
    """
    n = _start_positions("advance", n, cache.lengths.shape[0], "n")
    values = concrete_values(cache.lengths, n)
    if values is not None:  # eager: the new lengths, unclipped, must be readable
        _check_cache_table("advance", cache, values[0] + values[1], "lengths + n")
    return cache._replace(lengths=jnp.clip(cache.lengths + n, 0, cache.capacity))


def append(
    cache: PagedKVCache,
    k: Float[Array, "L B K H"] | Float[Array, "L B 1 K H"],
    v: Float[Array, "L B K H"] | Float[Array, "L B 1 K H"],
) -> PagedKVCache:
    """Writes one decode token per sequence for every layer at ``lengths``, then advances by 1.

    Jittable as it is (``jax.jit(append)``) and vmappable.

    Args:
      cache: the cache.
      k: ``[L, B, K, H]`` (or ``[L, B, 1, K, H]``) keys of the new token.
      v: ``[L, B, K, H]`` (or ``[L, B, 1, K, H]``) values.

    Returns:
      The updated cache. Under ``jit``, a sequence whose next slot has no page drops its
      token but its length still grows (pair with :func:`paged.ensure_next_page` and
      :func:`write_layer` with ``count=ok`` + ``advance(cache, ok)`` to stop such sequences
      instead); :func:`paged.validate` reports such a cache.

    Raises:
      ValueError: on shapes that do not match the cache; on an eager call, a sequence whose
        next position has no real page or is at capacity (reserve a page first).

    Example:
      >>> cache = init_paged_cache(2, 1, 4, 2, 8, batch=1, max_pages_per_seq=2)
      >>> cache = append(with_page_table(cache, jnp.array([[2, 0]])),
      ...                jnp.ones((2, 1, 1, 8)), jnp.ones((2, 1, 1, 8)))
      >>> cache.lengths
      Array([1], dtype=int32)
    """
    k, v = _check_kv("append", cache, k, v, per_layer=False)
    if k.shape[2] != 1:
        raise ValueError(
            f"append: k: expected one token per sequence [L, B, K, H], got T={k.shape[2]}"
        )
    B = k.shape[1]
    _check_targets("append", cache, cache.lengths, jnp.ones((B,), jnp.int32), "cache.lengths")
    return write(cache, k, v, cache.lengths)


def write(
    cache: PagedKVCache,
    k: Float[Array, "L B T K H"] | Float[Array, "L B K H"],
    v: Float[Array, "L B T K H"] | Float[Array, "L B K H"],
    start: Int[Array, " B"] | Int[Array, ""] | IntScalar,
    *,
    count: Int[Array, " B"] | Int[Array, ""] | IntScalar | None = None,
) -> PagedKVCache:
    """Writes a chunk for every layer at ``start ... start + T - 1`` (prefill).

    Jittable as it is (``jax.jit(write)``).

    ``lengths`` becomes ``max(lengths, start + T)`` (with ``count``: ``start + count``, rows
    with ``count == 0`` keeping theirs), clipped to capacity.

    Args:
      cache: the cache.
      k: ``[L, B, T, K, H]`` keys (or ``[L, B, K, H]`` for one token).
      v: ``[L, B, T, K, H]`` values.
      start: ``[B]`` or scalar int first position.
      count: ``[B]`` or scalar int tokens of each row to write (the rest is dropped); None
        writes all ``T`` (see :func:`write_layer`).

    Returns:
      The updated cache (under ``jit``, unwritable tokens dropped, see module docs).

    Raises:
      ValueError: on shapes that do not match the cache; on an eager call, a token written
        without a real page (see :func:`write_layer`).

    Example:
      >>> cache = init_paged_cache(1, 1, 4, 2, 8, batch=1, max_pages_per_seq=2)
      >>> cache = with_page_table(cache, jnp.array([[2, 3]]))
      >>> write(cache, jnp.ones((1, 1, 3, 1, 8)), jnp.ones((1, 1, 3, 1, 8)), 0).lengths
      Array([3], dtype=int32)
    """
    fn = "write"
    k, v = _check_kv(fn, cache, k, v, per_layer=False)
    start = _start_positions(fn, start, k.shape[1])
    given = count is not None
    count = _count(fn, count, k.shape[1], k.shape[2])
    _check_targets(fn, cache, start, count)
    return _write_impl(cache, k, v, start, count, given)


@functools.partial(jax.jit, static_argnums=5)
def _write_impl(cache, k, v, start, count, given: bool):
    L, _, T = k.shape[:3]
    end = jnp.where(count > 0, start + count, cache.lengths) if given else start + T
    lengths = jnp.clip(jnp.maximum(cache.lengths, end), 0, cache.capacity)
    zero = jnp.zeros((), jnp.int32)

    def one(pools, x):
        return LayerPools(
            _write_pool(cache, pool, zero, x[i], start, count)
            for i, pool in enumerate(as_layer_pools(pools))
        )

    return PagedKVCache(one(cache.k_pages, k), one(cache.v_pages, v), cache.page_table, lengths)


def _kivi_write(cache, pool, x, start, count, layers):
    return _kivi.write_tokens(pool, cache.page_table, x, start, count, layers, cache.capacity)
