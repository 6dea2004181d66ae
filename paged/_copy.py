"""Copy plans: the page copies copy-on-write asks for, and the device function that does them.

:meth:`paged.PageAllocator.extend` and :meth:`paged.PageAllocator.fork` return a
:class:`CopyPlan` (most often empty); :func:`copy_pages` takes it as it is, empty plans
included, eagerly or under ``jit``. Plans are padded to a power-of-two length with
``(0, 0)`` pairs (a null ``dst`` is dropped), so a loop whose plans have 0, 1, 2, 3... pairs
compiles once per power of two, not once per length.
"""

import dataclasses
from collections.abc import Iterable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from paged._cache import PagedKVCache
from paged._checks import describe
from paged._layers import LayerPools, as_layer_pools

__all__ = ["CopyPlan", "copy_pages"]


class CopyPlan(NamedTuple):
    """Pages to copy on the device, ``src[i] -> dst[i]``, before writing (copy-on-write).

    A pytree of two arrays, so it passes through ``jit`` and ``vmap`` as it is.

    Attributes:
      src: ``[n]`` int32 source page ids (``n`` may be 0).
      dst: ``[n]`` int32 destination page ids.

    Example:
      >>> plan = CopyPlan.empty()
      >>> plan.src.shape, len(CopyPlan.concatenate([plan, CopyPlan([2], [5])]).src)
      ((0,), 1)
    """

    src: Int[Array | np.ndarray, " n"]
    dst: Int[Array | np.ndarray, " n"]

    @staticmethod
    def empty() -> "CopyPlan":
        """The plan with no copies."""
        return CopyPlan(np.zeros((0,), np.int32), np.zeros((0,), np.int32))

    @staticmethod
    def from_pairs(pairs: Iterable[tuple[int, int]]) -> "CopyPlan":
        """A plan from ``(src, dst)`` pairs (the allocator's old list-of-pairs form)."""
        pairs = [(int(s), int(d)) for s, d in pairs]
        if not pairs:
            return CopyPlan.empty()
        src, dst = zip(*pairs, strict=True)
        return CopyPlan(np.asarray(src, np.int32), np.asarray(dst, np.int32))

    @staticmethod
    def concatenate(plans: Iterable["CopyPlan"]) -> "CopyPlan":
        """One plan doing every copy of ``plans`` in order (e.g. one per extended sequence)."""
        plans = list(plans)
        if not plans:
            return CopyPlan.empty()
        return CopyPlan(
            np.concatenate([np.asarray(p.src, np.int32).reshape(-1) for p in plans]),
            np.concatenate([np.asarray(p.dst, np.int32).reshape(-1) for p in plans]),
        )

    def pairs(self) -> list[tuple[int, int]]:
        """The copies as ``(src, dst)`` int pairs (host side; for tests and logging)."""
        return [
            (int(s), int(d))
            for s, d in zip(np.asarray(self.src), np.asarray(self.dst), strict=True)
        ]


def _bucket(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def copy_pages(cache: PagedKVCache, plan: CopyPlan) -> PagedKVCache:
    """Copies pages ``plan.src[i] -> plan.dst[i]`` in every layer's pools (copy-on-write).

    Pairs whose ``dst`` is the null page or out of range are dropped; an invalid ``src``
    copies zeros. The page table is not changed. Quantized pools copy their stored values and
    scales as they are (exact). An empty plan returns the cache unchanged
    (same values). Jittable as it is (``jax.jit(copy_pages)``); plans are padded to a power
    of two, so plan lengths 2 and 3 share one compiled program.

    Args:
      cache: the cache.
      plan: a :class:`CopyPlan` of ``[n]`` int arrays (numpy or jax, ``n >= 0``), as returned
        by :meth:`paged.PageAllocator.extend` / :meth:`~paged.PageAllocator.fork`.

    Returns:
      The cache with the copies done.

    Raises:
      ValueError: if ``plan`` is not a :class:`CopyPlan` of two 1-D int arrays of one length.

    Example:
      >>> from paged._cache import init_paged_cache
      >>> cache = init_paged_cache(1, 1, 4, 2, 8, batch=1, max_pages_per_seq=2)
      >>> layer0 = cache.k_pages[0].at[:, 1].set(5.0)
      >>> cache = cache._replace(k_pages=LayerPools([layer0]))
      >>> float(copy_pages(cache, CopyPlan([1], [3])).k_pages[0][0, 3, 0, 0])
      5.0
    """
    fn = "copy_pages"
    if not isinstance(plan, CopyPlan):
        raise ValueError(
            f"{fn}: plan: expected a paged.CopyPlan(src, dst) (what PageAllocator.extend and "
            f"fork return), got {type(plan).__name__}"
        )
    src, dst = jnp.asarray(plan.src), jnp.asarray(plan.dst)
    if (
        src.ndim != 1
        or src.shape != dst.shape
        or not jnp.issubdtype(src.dtype, jnp.integer)
        or not jnp.issubdtype(dst.dtype, jnp.integer)
    ):
        raise ValueError(
            f"{fn}: plan: expected src and dst 1-D int arrays of one length, got src "
            f"{describe(src)} and dst {describe(dst)}"
        )
    n = src.shape[0]
    pad = _bucket(n) - n
    src = jnp.pad(src.astype(jnp.int32), (0, pad))
    dst = jnp.pad(dst.astype(jnp.int32), (0, pad))  # dst 0 (null page): dropped
    return _copy_pages_impl(cache, src, dst)


@jax.jit
def _copy_pages_impl(cache, src, dst):
    P = cache.k_pages.shape[2]
    src_ok = (src > 0) & (src < P)
    dst = jnp.where((dst > 0) & (dst < P), dst, P)

    def one(pool):  # one layer's float pool [K, P, C, H], or a quantized pool's data or scales
        data = jnp.take(pool, jnp.where(src_ok, src, 0), axis=1)  # [K, n, C, ...]
        ok = src_ok.reshape(1, -1, *(1,) * (pool.ndim - 2))
        data = jnp.where(ok, data, jnp.zeros((), pool.dtype))
        return pool.at[:, dst].set(data, mode="drop")

    # A quantized pool copies its stored values and scales as they are (no re-quantization);
    # a kivi2 pool's residual belongs to sequence rows, not pages, and stays as it is.
    def layer_copy(pool):
        residual = getattr(pool, "residual", None)
        if residual is None:
            return jax.tree.map(one, pool)
        copied = jax.tree.map(one, dataclasses.replace(pool, residual=None))
        return dataclasses.replace(copied, residual=residual)

    def pool_copy(pools):  # layer by layer, each buffer written in place
        return LayerPools(layer_copy(pool) for pool in as_layer_pools(pools))

    return cache._replace(k_pages=pool_copy(cache.k_pages), v_pages=pool_copy(cache.v_pages))
