"""Staging pools: the compact device pools that hold the pages fetched back for a step.

Demoted pages come back from host (or disk) into a *staging pool* holding just them, not into
a second pool as large as the device pool: :func:`make_staging_pool` allocates it (page 0
null, staging ids ``1..n``) and :func:`staging_table` remaps a cold table of device page ids
to those staging ids, fetching each distinct page once.
"""

import numpy as np
from jaxtyping import Array, Int, Shaped

from offload._checks import check_int, check_table
from offload._host_pool import check_device, device_kind, zeros_pools
from offload._pool_checks import main_leaf
from paged import LayerPools, QuantizedPages

__all__ = ["make_staging_pool", "staging_table"]


def make_staging_pool(
    k_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
    v_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
    num_pages: int | np.integer,
    *,
    bucket: int | np.integer = 1,
) -> tuple:
    """A zero device pool shaped like ``k_pages, v_pages`` with room for ``num_pages`` pages.

    The pool has ``ceil((num_pages + 1) / bucket) * bucket`` pages: page 0 is the null page,
    staging ids ``1..num_pages`` receive the fetched pages (``OffloadManager.page_in(stage_k,
    stage_v, np.arange(1, n + 1), ...)``). ``num_pages = 0`` gives a pool of the null page
    alone (a valid, empty cold pool). ``bucket`` rounds the size up so that a jitted decode
    compiles for few sizes. A quantized pool gives a quantized staging pool of the same format
    and grouping (zero data and scales; kivi2: no residual, every staged page is read as
    stored). Not jittable (it allocates). Its bytes are ``pool_bytes(stage_k, stage_v)``.

    Args:
      k_pages: device keys ``[L, K, P, C, H]`` or ``[K, P, C, H]`` (float or
        ``paged.QuantizedPages``); only shape, dtype (format) and sharding are used.
      v_pages: device values, same shape.
      num_pages: ``n >= 0`` pages to be fetched.
      bucket: ``>= 1``, the page count is a multiple of it.

    Returns:
      ``(stage_k, stage_v)`` with ``[*L, K, Ps, C, H]``, ``Ps >= n + 1``, in the device pool's
      memory kind and sharding.

    Raises:
      ValueError: on a host or malformed pool, a negative ``num_pages`` or ``bucket < 1``.

    Example:
      >>> k = jnp.zeros((2, 4, 64, 16, 32))
      >>> make_staging_pool(k, k, 5, bucket=4)[0].shape
      (2, 4, 8, 16, 32)
    """
    fn = "make_staging_pool"
    check_device(fn, k_pages, v_pages)
    num_pages = check_int(fn, "num_pages", num_pages, low=0)
    bucket = check_int(fn, "bucket", bucket, low=1)
    size = -(-(num_pages + 1) // bucket) * bucket
    sharding = main_leaf(k_pages).sharding
    kind = sharding.memory_kind or device_kind(sharding)
    return zeros_pools(k_pages, v_pages, size, kind)


def staging_table(
    cold_table: Int[Array | np.ndarray, "B M"],
) -> tuple[Int[np.ndarray, " n"], Int[np.ndarray, "B M"]]:
    """The distinct pages of a cold table, and the table remapped to a staging pool's ids.

    Host-side (numpy, not jittable: ``n`` depends on the values). Fetch the returned page ids
    into a staging pool of ``n + 1`` pages (page 0 null, e.g. :func:`make_staging_pool`) at
    staging ids ``1..n``; then pass the remapped table as ``cold_table`` to
    :func:`mixed_residency_attention` with that staging pool. A page held by several slots
    (a shared prefix) is fetched once.

    Args:
      cold_table: ``[B, M]`` int device page ids of the cold slots (0 = not cold), e.g. the
        second table of :func:`split_residency`.

    Returns:
      ``(page_ids, table)``: ``page_ids [n]`` int32, the distinct non-zero ids in increasing
      order; ``table [B, M]`` int32 with ``page_ids[i]`` replaced by ``i + 1`` (0 stays 0).

    Raises:
      ValueError: on a ``cold_table`` that is not an int ``[B, M]`` array or holds a negative
        id.

    Example:
      >>> ids, table = staging_table(np.array([[0, 9, 4], [0, 9, 0]]))
      >>> ids.tolist(), table.tolist()
      ([4, 9], [[0, 2, 1], [0, 2, 0]])
    """
    fn = "staging_table"
    check_table(fn, "cold_table", cold_table)
    table = np.asarray(cold_table)
    if (table < 0).any():
        raise ValueError(
            f"{fn}: cold_table: expected page ids >= 0 (0 = not cold), got {int(table.min())}"
        )
    ids, inverse = np.unique(table, return_inverse=True)
    inverse = inverse.reshape(table.shape)
    if ids.size and ids[0] == 0:
        ids = ids[1:]
        remapped = inverse  # id 0 is group 0, page ids[i] is group i + 1
    else:
        remapped = inverse + 1
    remapped = np.where(table == 0, 0, remapped)
    return ids.astype(np.int32), remapped.astype(np.int32)
