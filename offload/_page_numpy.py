"""Pages to and from numpy, shard by shard: the synchronous path of the disk tier.

:func:`gather_pages` reads pages ``slots`` of a pool into one numpy array (each device's shard
contributes the pages it holds, so a pool split along the page axis is never gathered whole);
:func:`scatter_pages` writes numpy pages into slots of a donated pool pair, each device
receiving only its own pages and copying them in place with :mod:`offload._page_copy`'s kernel.
"""

import jax
import numpy as np

from offload._host_pool import (
    as_named,
    page_axis,
)
from offload._page_copy import _copy_pages_fn, _flat, _named_shard, _padded, _unflat, bucket


def _page_index(index: tuple, axis: int, positions: np.ndarray) -> tuple:
    """A shard's index tuple with its page-axis slice replaced by ``positions``."""
    return (*index[:axis], positions, *index[axis + 1 :])


def gather_pages(pool: jax.Array, slots: np.ndarray, axis: int | None = None) -> np.ndarray:
    """A numpy copy ``[..., n, C, H]`` of pages ``slots`` of a pool, read shard by shard.

    Works for any sharding (each device's shard contributes the pages it holds), so a pool
    split along the page axis is never gathered whole. ``axis`` overrides the page axis
    (``ndim - 3``), for the scale leaf of a quantized pool.
    """
    axis = pool.ndim - 3 if axis is None else axis
    out = np.empty((*pool.shape[:axis], slots.size, *pool.shape[axis + 1 :]), pool.dtype)
    for shard in pool.addressable_shards:
        lo = shard.index[axis].start or 0
        mine = np.flatnonzero((slots >= lo) & (slots < lo + shard.data.shape[axis]))
        if mine.size:
            local = np.asarray(shard.data)
            out[_page_index(shard.index, axis, mine)] = np.take(local, slots[mine] - lo, axis)
    return out


def scatter_pages(target, pages, dst: np.ndarray):
    """Writes numpy pages ``pages`` into slots ``dst`` of ``target``.

    ``target`` (a ``(k, v)`` pair of pools, float or quantized) is donated; ``pages`` holds one
    numpy array ``[..., n, ...]`` per leaf of ``target`` (``k``, ``v`` for float pools; ``k``
    data, ``k`` scales, ``v`` data, ``v`` scales for quantized ones). Each device receives only
    the pages of its own shard, staged in its memory kind and copied in place by the page
    kernel.

    Returns:
      ``(target_k, target_v)``, complete (this is the synchronous disk path).
    """
    axis = page_axis(target[0])
    targets = _flat(target)
    new = tuple([] for _ in targets)
    for part in range(len(targets)):
        for shard in targets[part].addressable_shards:
            lo = shard.index[axis].start or 0
            mine = np.flatnonzero((dst >= lo) & (dst < lo + shard.data.shape[axis]))
            if not mine.size:
                new[part].append(shard.data)
                continue
            kind = shard.data.sharding.memory_kind
            staging = jax.sharding.SingleDeviceSharding(shard.device, memory_kind=kind)
            source = jax.device_put(pages[part][_page_index(shard.index, axis, mine)], staging)
            source = jax.make_array_from_single_device_arrays(
                source.shape, as_named(staging), [source]
            )
            fn = _copy_pages_fn(as_named(staging), as_named(shard.data.sharding), axis)
            length = bucket(mine.size)
            written, _ = fn(
                source,
                _named_shard(shard),
                _padded(np.arange(mine.size), length),
                _padded(dst[mine] - lo, length),
                np.int32(mine.size),
            )
            new[part].append(written)
    arrays = [
        jax.make_array_from_single_device_arrays(t.shape, t.sharding, parts)
        for t, parts in zip(targets, new, strict=True)
    ]
    return jax.block_until_ready(_unflat(target, arrays))
