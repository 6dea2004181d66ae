"""The prefetch kernels: one layer's pages from a pinned-host pool to device memory.

:func:`prefetch_fn` builds (and caches) the jitted copy of pages ``slots`` of one layer
``[K, n, C, H]`` out of a host pool ``[L, K, P, C, H]``, as one slice when the slots are
contiguous, one slice per page otherwise, optionally into a donated device buffer;
:func:`prefetch_per_shard` runs it device by device for pools split along the page axis, and
:func:`prefetch_pool_per_shard` leaf by leaf for quantized pools. The async markers and shard
helpers are :mod:`offload._page_copy`'s.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from offload._host_pool import as_named, device_kind, leaves, rebuild, replicated
from offload._page_copy import _async_marker, _named_shard
from offload._pool_checks import page_shards
from offload._tiers import PINNED_HOST
from paged import LayerPools

__all__ = ["prefetch_fn"]


def layer_sharding(sharding, ndim: int = 5):
    """The sharding of one layer ``[K, n, C, H]`` cut from a pool sharded as ``[L, K, P, C, H]``.

    ``ndim`` is the pool leaf's rank (4 for the scales ``[L, K, P, C]`` of a quantized pool).
    """
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        if spec[0] is not None:
            raise NotImplementedError(
                f"prefetch_layer: host_pool: pools sharded over the layer axis are not "
                f"supported, got {spec}"
            )
        return jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]), memory_kind=device_kind(sharding)
        )
    return sharding.with_memory_kind(device_kind(sharding))


@functools.lru_cache(maxsize=64)
def prefetch_fn(
    host_sharding, contiguous: bool, into: bool, ndim: int = 5, per_layer: bool = False
):
    """Copies pages ``slots`` of one layer to device, into a donated buffer when ``into``.

    ``ndim``: the leaf's rank, 5 for ``[L, K, P, C, H]`` values, 4 for ``[L, K, P, C]`` scales.
    ``per_layer``: the leaf is one layer's own buffer (``[K, P, C, H]``, a host pool of
    ``paged.LayerPools``; ``ndim`` its rank), read with ``layer`` 0.
    """
    if per_layer:
        target = host_sharding.with_memory_kind(device_kind(host_sharding))
    else:
        target = layer_sharding(host_sharding, ndim)
    host_index = replicated(host_sharding, PINNED_HOST)
    device_index = replicated(host_sharding, device_kind(host_sharding))

    def fn(pool, layer, slots, out=None):
        marker = _async_marker(slots)
        if per_layer:
            pool = pool[None]  # a free reshape: the stacked kernel below, layer 0
        layer, slots = jax.device_put(layer, host_index), jax.device_put(slots, host_index)
        K, rest = pool.shape[1], pool.shape[3:]  # rest: (C, H) or (C,) for scales
        zeros = (0,) * len(rest)
        n = slots.shape[0]
        if contiguous:  # slots[0] ... slots[0] + n - 1: one slice, one copy
            pages = lax.dynamic_slice(pool, (layer, 0, slots[0], *zeros), (1, K, n, *rest))
            pages = jax.device_put(pages[0], target)
            return (pages if out is None else out.at[:].set(pages)), marker
        # One slice per page straight from [L, K, P, C, H] (no layer copy first), written in
        # place into the device buffer: measured 2-3x faster on CPU than slicing the layer
        # out and concatenating the pages.
        if out is None:
            out = jax.device_put(jnp.zeros((K, n, *rest), pool.dtype), target)
        for i in range(n):
            page = lax.dynamic_slice(pool, (layer, 0, slots[i], *zeros), (1, K, 1, *rest))
            page = jax.device_put(page[0], target)  # [K, 1, C, H]
            out = lax.dynamic_update_slice_in_dim(out, page, i, axis=1)
        return out, marker

    return jax.jit(
        fn,
        donate_argnums=(3,) if into else (),
        in_shardings=(host_sharding, device_index, device_index) + ((target,) if into else ()),
        out_shardings=(target, device_index),
    )


def prefetch_pool_per_shard(pool, layer: int, slots: np.ndarray):
    """:func:`prefetch_per_shard` of a float or quantized pool (leaf by leaf, same slots); of
    per-layer pools (``paged.LayerPools``), layer ``layer``'s own buffers."""
    per_layer = isinstance(pool, LayerPools)
    if per_layer:
        pool = pool.layers[layer]
    out, markers = [], []
    for leaf in leaves(pool):
        pages, done = prefetch_per_shard(leaf, layer, slots, per_layer=per_layer)
        out.append(pages)
        markers += done
    return rebuild(pool, out), markers


def prefetch_per_shard(pool: jax.Array, layer: int, slots: np.ndarray, *, per_layer: bool = False):
    """One layer of a pool split along the page axis, fetched device by device.

    ``slots`` holds ``n / D`` slots of device block 0, then ``n / D`` of block 1, ...; each
    device copies its own slots and the result ``[K, n, C, H]`` is split along ``n`` like the
    pool is along its pages (the layout ``paged.sharded_paged_attention`` reads). With
    ``per_layer``, ``pool`` is that layer's own buffer ``[K, P, ...]`` (``layer`` unused).

    Returns:
      ``(pages, markers)``.
    """
    axis = 1 if per_layer else 2  # the page axis: [K, P, ...] or [L, K, P, ...]
    shards = page_shards(pool, axis)
    per_slot, per_out = pool.shape[axis] // shards, slots.size // shards
    if per_layer:
        target = pool.sharding.with_memory_kind(device_kind(pool.sharding))
    else:
        target = layer_sharding(pool.sharding, pool.ndim)
    arrays, markers = [], []
    for shard in pool.addressable_shards:
        lo = shard.index[axis].start or 0
        block = lo // per_slot
        local = (slots[block * per_out : (block + 1) * per_out] - lo).astype(np.int32)
        contiguous = bool(np.all(np.diff(local) == 1))
        fetch = prefetch_fn(as_named(shard.data.sharding), contiguous, False, pool.ndim, per_layer)
        pages, marker = fetch(_named_shard(shard), np.int32(0 if per_layer else layer), local)
        arrays.append(pages)
        markers.append(marker)
    rest = pool.shape[axis + 1 :]
    shape = (pool.shape[axis - 1], slots.size, *rest)
    return jax.make_array_from_single_device_arrays(shape, target, arrays), markers
