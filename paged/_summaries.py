"""Per-page key summaries: the elementwise minimum and maximum of each page's keys.

Quest (Tang et al., 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference") keeps, for every page and kv head, the elementwise minimum and maximum of the
page's keys; with them the largest logit any key of the page can give a query ``q`` is at most
``sum_h max(q_h * min_h, q_h * max_h)`` (:func:`paged.select_pages_by_query`). They are
``2 * H`` float32 numbers per page per kv head (``1 / C`` of a float32 key page), small
enough to stay on the device for every page wherever its data lives.

:class:`PageKeyBounds` ``(k_min, k_max)`` holds them as ``[L, K, P, H]`` (one layer:
``[K, P, H]``). A page's bounds cover the keys attention reads at its *valid* slots only:
slot ``c`` of page ``table[b, j]`` is valid when ``j * C + c < lengths[b]`` (for some row
``b`` holding the page); slots past every length, the null page 0 and pages no row holds
contribute nothing, so such a page has ``k_min = +inf, k_max = -inf`` (empty), and garbage
(NaN included) past the lengths never reaches a bound. Quantized pages are summarised from
the keys as decoded (what the attention reads). kivi2 pages are summarised from the union of
what the residual window holds (exact, float32) and, for a page already stored whole, its
decoded stored keys: the bounds then hold whichever copy a read takes, also after the window
slides past the page.

* :func:`page_key_bounds` computes them from scratch (a pass over the cache);
* :func:`refresh_key_bounds` recomputes only the pages a write touched (after
  ``paged.write_layer`` / ``paged.write`` / ``paged.append``): jittable, ``O(T / C + 1)``
  pages per row;
* :func:`copy_key_bounds` follows ``paged.copy_pages`` (copy-on-write, forks).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from paged import _kivi
from paged._cache import PagedKVCache
from paged._checks import check_array, concrete_values, describe, int_option, layer_index
from paged._layers import as_layer_pools, on_layer
from paged._quantized import take_decoded

__all__ = ["PageKeyBounds", "copy_key_bounds", "page_key_bounds", "refresh_key_bounds"]


class PageKeyBounds(NamedTuple):
    """Elementwise key minimum and maximum of every page and kv head (float32).

    Attributes:
      k_min: ``[L, K, P, H]`` (one layer: ``[K, P, H]``) float32 minimum over the page's
        valid keys; ``+inf`` for a page with none (the null page, unwritten pages).
      k_max: same shape, the maximum; ``-inf`` for a page with no valid key.
    """

    k_min: Float[Array, "*L K P H"]
    k_max: Float[Array, "*L K P H"]

    def layer(self, layer: int | Int[Array, ""]) -> "PageKeyBounds":
        """The ``[K, P, H]`` bounds of one layer (an int or a traced integer scalar)."""
        return PageKeyBounds(self.k_min[layer], self.k_max[layer])

    @property
    def nbytes(self) -> int:
        """Bytes of both arrays (``2 * 4 * L * K * P * H``)."""
        return int(self.k_min.nbytes) + int(self.k_max.nbytes)


def _check_cache(fn: str, cache) -> None:
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"{fn}: cache: expected a paged.PagedKVCache, got {type(cache).__name__}")


def _lengths(fn: str, cache, lengths):
    if lengths is None:
        return cache.lengths.astype(jnp.int32)
    check_array(fn, "lengths", lengths, 1, jnp.integer)
    if tuple(lengths.shape) != tuple(cache.lengths.shape):
        raise ValueError(
            f"{fn}: lengths: expected shape {tuple(cache.lengths.shape)} (one per row of "
            f"cache.page_table), got {describe(lengths)}"
        )
    return jnp.asarray(lengths, jnp.int32)


def _row_bounds(pool, ids, slots, lengths, filled, C: int):
    """``(lo, hi) [*L, K, B, n, H]`` over the valid slots of the pages ``ids [B, n]`` at
    table slots ``slots [B, n]`` of rows with ``lengths [B]`` tokens, of a pool ``[*L, K, P,
    C, H]``; ``filled [*L, B]`` is a kivi2 pool's written length per row (else None)."""
    lead = pool.ndim - 4  # 1 for stacked layers, 0 for one layer
    index = (slice(None),) * (lead + 1) + (ids,)
    stored = take_decoded(pool, index)  # [*L, K, B, n, C, H]
    pos = slots[..., None] * C + jnp.arange(C, dtype=jnp.int32)  # [B, n, C]
    valid = pos < lengths[:, None, None]

    def reduce(x, ok):
        ok = ok[..., None]
        lo = jnp.min(jnp.where(ok, x, jnp.inf), axis=-2)
        hi = jnp.max(jnp.where(ok, x, -jnp.inf), axis=-2)
        return lo, hi

    residual = getattr(pool, "residual", None)
    if residual is None:
        return reduce(stored, valid)
    # kivi2: what the window holds (exact) where it holds it, the stored page elsewhere; plus
    # the stored copy of every page already stored whole (read once the window moves on).
    W = residual.shape[-2] // C
    f = jnp.expand_dims(filled, lead)[..., None, None]  # [*L, 1, B, 1, 1]
    inside, idx = _kivi.window_slot(pos, f, C, W)  # [*L, 1, B, n, C]
    B, n = ids.shape
    idx = jnp.broadcast_to(idx, inside.shape)
    flat = idx.reshape(*idx.shape[:-2], n * C)  # [*L, 1, B, n * C]
    held = jnp.take_along_axis(residual, flat[..., None], axis=-2)  # [*L, K, B, n * C, H]
    held = held.reshape(*held.shape[:-2], n, C, held.shape[-1])
    read = jnp.where(inside[..., None], held, stored)
    lo, hi = reduce(read, valid)
    whole = (slots + 1) * C <= jnp.expand_dims(filled, lead)[..., None]  # [*L, 1, B, n]
    lo_s, hi_s = reduce(stored, valid & whole[..., None])
    return jnp.minimum(lo, lo_s), jnp.maximum(hi, hi_s)


def _filled(pool):
    """A kivi2 pool's written length per row ``[*L, B]`` (its first kv head's), else None."""
    if getattr(pool, "residual_len", None) is None:
        return None
    return pool.residual_len[..., 0, :]


def page_key_bounds(
    cache: PagedKVCache, lengths: Int[Array | np.ndarray, " B"] | None = None
) -> PageKeyBounds:
    """The key bounds of every page of a cache, from scratch.

    One pass over the cache (it decodes every page a row holds once, per row): use it after a
    prefill, a page-table hand-off or to check :func:`refresh_key_bounds`. Jittable as it is
    (``jax.jit(page_key_bounds)``).

    Args:
      cache: a :class:`paged.PagedKVCache` (float or quantized pools, kivi2 included).
      lengths: ``[B]`` int valid tokens per row; default ``cache.lengths``.

    Returns:
      :class:`PageKeyBounds` ``[L, K, P, H]``: for page ``p``, the min / max over the valid
      slots of every row holding it (a page held by several rows, a shared prefix, gets the
      union); ``+inf / -inf`` for pages without a valid slot.

    Raises:
      ValueError: if ``cache`` is not a ``PagedKVCache`` or ``lengths`` not ``[B]`` ints.

    Example:
      >>> import paged
      >>> cache = paged.init_paged_cache(1, 1, 4, 2, 2, batch=1, max_pages_per_seq=2)
      >>> cache = paged.with_page_table(cache, jnp.array([[3, 1]]))
      >>> k = jnp.array([[[[1.0, -2.0]], [[3.0, 0.0]], [[-1.0, 5.0]]]])  # [B, T, K, H]
      >>> cache = paged.write(cache, k[None], k[None], 0)
      >>> b = page_key_bounds(cache)
      >>> b.k_min[0, 0, 3].tolist(), b.k_max[0, 0, 3].tolist(), b.k_max[0, 0, 1].tolist()
      ([1.0, -2.0], [3.0, 0.0], [-1.0, 5.0])
    """
    fn = "page_key_bounds"
    _check_cache(fn, cache)
    return _bounds_impl(cache, _lengths(fn, cache, lengths))


@jax.jit
def _bounds_impl(cache, lengths):
    L, K, P, C, H = cache.k_pages.shape
    table = cache.page_table.astype(jnp.int32)
    B, M = table.shape
    page_ok = (table > 0) & (table < P)
    ids = jnp.where(page_ok, table, 0)
    slots = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B, M))
    rows = [
        _row_bounds(pool, ids, slots, lengths, _filled(pool), C)
        for pool in as_layer_pools(cache.k_pages)
    ]
    lo, hi = (jnp.stack(x) for x in zip(*rows, strict=True))  # [L, K, B, M, H]
    target = jnp.where(page_ok, ids, P)  # [B, M]; P: dropped
    k_min = jnp.full((L, K, P, H), jnp.inf, jnp.float32).at[:, :, target].min(lo, mode="drop")
    k_max = jnp.full((L, K, P, H), -jnp.inf, jnp.float32).at[:, :, target].max(hi, mode="drop")
    return PageKeyBounds(k_min, k_max)


def _check_bounds(fn: str, bounds, cache) -> None:
    if not isinstance(bounds, PageKeyBounds):
        raise ValueError(f"{fn}: bounds: expected a paged.PageKeyBounds, got {bounds!r}")
    L, K, P, _, H = cache.k_pages.shape
    for name in ("k_min", "k_max"):
        x = getattr(bounds, name)
        if getattr(x, "shape", None) != (L, K, P, H) or x.dtype != jnp.float32:
            raise ValueError(
                f"{fn}: bounds.{name}: expected float32 [L, K, P, H] = {(L, K, P, H)} (the "
                f"cache's, from paged.page_key_bounds), got {describe(x)}"
            )


def refresh_key_bounds(
    bounds: PageKeyBounds,
    cache: PagedKVCache,
    start: Int[Array, " B"] | Int[Array, ""] | int,
    num_tokens: int,
    *,
    layer: int | Int[Array, ""],
    lengths: Int[Array | np.ndarray, " B"],
) -> PageKeyBounds:
    """Recomputes the bounds of the pages a write of one layer touched, after the write.

    Call it after ``paged.write_layer(cache, layer, k, v, start)`` of ``T = num_tokens``
    tokens (or once per layer after ``paged.write`` / ``paged.append``), with the lengths the
    attention will read (``start + T`` for a chunk at the end). The pages holding positions
    ``start ... start + T - 1`` of each row (``ceil``-many, at most ``(T + C - 2) // C + 1``)
    are summarised again from the written cache over the row's valid slots and replace their
    old bounds; no other page is read. For kivi2, the bounds of a page stay valid when the
    residual window slides past it (they already cover its stored copy, see the module
    docs). Jittable as it is (``num_tokens`` static: ``jax.jit(refresh_key_bounds,
    static_argnums=3)``, ``layer`` may be traced).

    Args:
      bounds: the cache's :class:`PageKeyBounds` ``[L, K, P, H]`` before the write.
      cache: the cache after the write.
      start: ``[B]`` or scalar int, the write's first position per row.
      num_tokens: ``T >= 1`` (static), tokens the write covered per row.
      layer: the layer written: an int in ``[0, L)`` or an integer scalar array (traced: out
        of range leaves the bounds unchanged).
      lengths: ``[B]`` int valid tokens per row after the write.

    Returns:
      The updated :class:`PageKeyBounds`. A touched page shared by several rows is
      summarised from the row that wrote it (pages are written by one row: copy-on-write).

    Raises:
      ValueError: on a bad ``bounds`` (not the cache's shape), ``start``, ``num_tokens``,
        ``layer`` or ``lengths``.

    Example:
      >>> import paged
      >>> cache = paged.init_paged_cache(1, 1, 4, 2, 2, batch=1, max_pages_per_seq=2)
      >>> cache = paged.with_page_table(cache, jnp.array([[3, 1]]))
      >>> b = page_key_bounds(cache)
      >>> cache = paged.write_layer(cache, 0, jnp.ones((1, 3, 1, 2)), jnp.ones((1, 3, 1, 2)), 0)
      >>> b = refresh_key_bounds(b, cache, 0, 3, layer=0, lengths=jnp.array([3]))
      >>> b.k_max[0, 0, 1].tolist(), b.k_min[0, 0, 2].tolist()
      ([1.0, 1.0], [inf, inf])
    """
    fn = "refresh_key_bounds"
    _check_cache(fn, cache)
    _check_bounds(fn, bounds, cache)
    T = int_option(fn, "num_tokens", num_tokens, minimum=1)
    layer = layer_index(fn, layer, cache.k_pages.shape[0], traced_ok=True)
    B = cache.page_table.shape[0]
    if isinstance(start, (bool, np.bool_)) or not hasattr(jnp.asarray(start), "dtype"):
        raise ValueError(f"{fn}: start: expected an int or [B] ints, got {start!r}")
    start = jnp.asarray(start)
    if not jnp.issubdtype(start.dtype, jnp.integer) or start.shape not in ((), (B,)):
        raise ValueError(
            f"{fn}: start: expected an int or shape ({B},) ints, got {describe(start)}"
        )
    lengths = _lengths(fn, cache, lengths)
    if concrete_values(start) is not None and int(np.min(np.asarray(start))) < 0:
        raise ValueError(f"{fn}: start: expected positions >= 0, got {np.asarray(start)}")
    start = jnp.broadcast_to(start.astype(jnp.int32), (B,))
    return _refresh_impl(bounds, cache, start, jnp.asarray(layer, jnp.int32), lengths, T)


@functools.partial(jax.jit, static_argnums=5)
def _refresh_impl(bounds, cache, start, layer, lengths, T: int):
    L, K, P, C, H = cache.k_pages.shape
    table = cache.page_table.astype(jnp.int32)
    B, M = table.shape
    n = (T + C - 2) // C + 1  # pages a run of T tokens starting anywhere in a page spans
    slots = jnp.maximum(start, 0)[:, None] // C + jnp.arange(n, dtype=jnp.int32)  # [B, n]
    in_table = slots < M
    ids = jnp.take_along_axis(table, jnp.clip(slots, 0, M - 1), axis=1)
    page_ok = in_table & (ids > 0) & (ids < P)
    ids = jnp.where(page_ok, ids, 0)
    at = jnp.clip(layer, 0, L - 1)

    def rows(pool):  # [K, P, C, H] (kivi2: with its window rows), read in place
        return _row_bounds(pool, ids, slots, lengths, _filled(pool), C)  # [K, B, n, H]

    pools = as_layer_pools(cache.k_pages)
    lo, hi = on_layer(len(pools), at, lambda i: rows(pools[i]))
    target = jnp.where(page_ok & (layer >= 0) & (layer < L), ids, P)  # P: dropped
    k_min = bounds.k_min.at[at, :, target].set(lo.transpose(1, 2, 0, 3), mode="drop")
    k_max = bounds.k_max.at[at, :, target].set(hi.transpose(1, 2, 0, 3), mode="drop")
    return PageKeyBounds(k_min, k_max)


def copy_key_bounds(
    bounds: PageKeyBounds,
    src_pages: Int[Array | np.ndarray, " n"],
    dst_pages: Int[Array | np.ndarray, " n"],
) -> PageKeyBounds:
    """The bounds after ``paged.copy_pages`` copied pages ``src -> dst`` (in every layer).

    Pass a ``paged.CopyPlan``'s ``src`` and ``dst``. Jittable as it is; ids outside
    ``[0, P)`` are dropped under ``jit`` (as ``copy_pages`` drops them).

    Args:
      bounds: :class:`PageKeyBounds` ``[L, K, P, H]`` or ``[K, P, H]``.
      src_pages: ``[n]`` int source page ids.
      dst_pages: ``[n]`` int destination page ids.

    Returns:
      The bounds with page ``dst[i]``'s bounds replaced by page ``src[i]``'s.

    Raises:
      ValueError: if ``bounds`` is not a ``PageKeyBounds`` or the ids are not ``[n]`` ints
        of one length; on an eager call, an id outside ``[0, P)``.

    Example:
      >>> b = PageKeyBounds(jnp.arange(3.0).reshape(1, 3, 1), jnp.arange(3.0).reshape(1, 3, 1))
      >>> copy_key_bounds(b, jnp.array([2]), jnp.array([1])).k_min[0, :, 0].tolist()
      [0.0, 2.0, 2.0]
    """
    fn = "copy_key_bounds"
    if not isinstance(bounds, PageKeyBounds):
        raise ValueError(f"{fn}: bounds: expected a paged.PageKeyBounds, got {bounds!r}")
    src, dst = jnp.asarray(src_pages), jnp.asarray(dst_pages)
    for name, x in (("src_pages", src), ("dst_pages", dst)):
        if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{fn}: {name}: expected [n] ints, got {describe(x)}")
    if src.shape != dst.shape:
        raise ValueError(
            f"{fn}: dst_pages: expected src_pages' length {src.shape[0]}, got {dst.shape[0]}"
        )
    P = bounds.k_min.shape[-2]
    values = concrete_values(src, dst)
    if values is not None and any(((v < 0) | (v >= P)).any() for v in values):
        raise ValueError(
            f"{fn}: src_pages / dst_pages: expected page ids in [0, {P}), got {values}"
        )
    return _copy_impl(bounds, src.astype(jnp.int32), dst.astype(jnp.int32))


@jax.jit
def _copy_impl(bounds, src, dst):
    P = bounds.k_min.shape[-2]
    src_ok = (src >= 0) & (src < P)
    dst = jnp.where(src_ok & (dst >= 0), dst, P)  # P: dropped

    def one(x):
        moved = jnp.take(x, jnp.clip(src, 0, P - 1), axis=-2)
        return x.at[..., dst, :].set(moved, mode="drop")

    return PageKeyBounds(one(bounds.k_min), one(bounds.k_max))
