"""A preallocated host page pool mirroring a device pool: its type, checks and allocation.

The host pool mirrors a device pool ``k_pages, v_pages [L, K, P, C, H]`` (or ``[K, P, C, H]``)
with ``P_host`` slots, in pinned host memory and with the device pool's sharding: kv heads
split over a mesh axis stay split, and a pool split along its page axis (the layout of
``paged.sharded_paged_attention``, ``[K, D * P_d, C, H]``) gives a host pool split the same
way, ``D * S_d`` slots with ``S_d`` slots per device (*per-device slots*: a page moves only
between a device's own device pages and its own host slots, never across devices).

A quantized device pool (``paged.QuantizedPages``) gets a quantized host pool: its ``data``
and ``scale`` leaves (and a kivi2 pool's ``zero`` leaf) all live in pinned host memory, each
with the sharding of the device leaf it mirrors, and every transfer moves the leaves of the
same pages together, as stored (no dequantization). A cache's per-layer pools
(``paged.LayerPools``, one buffer per layer) get a host pool of per-layer buffers too, and
every copy runs layer by layer, each layer's buffer written in place. Every leaf has its page axis at index
``pool.ndim - 3`` (``ndim`` being the float pool's rank), so the copy kernels treat each leaf
as a pool of its own. A kivi2 pool's residual pages (``residual``, ``residual_len``: one open
page per sequence row, not per page) never move: a host pool has none, and a transfer into a
device pool keeps that pool's residual as it is.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Shaped

from offload._checks import check_int
from offload._pool_checks import (
    check_leaf_pair,
    check_quantized_pair,
    first,
    main_leaf,
    page_shards,
)
from offload._tiers import HOST_MEMORY_KINDS, PINNED_HOST, host_memory_kind
from paged import LayerPools, QuantizedPages

__all__ = ["HostPagePool", "make_host_page_pool"]


class HostPagePool(NamedTuple):
    """K and V pages in pinned host memory, with the sharding of the device pool they mirror.

    Attributes:
      k_pages: ``[L, K, P_host, C, H]`` (or ``[K, P_host, C, H]``) keys, ``pinned_host``; a
        ``paged.QuantizedPages`` (data and scales, kivi2 zero-points too, all pinned host; no
        kivi2 residual) mirroring a quantized device pool.
      v_pages: same shape, dtype, format and sharding as ``k_pages`` (kivi2: per-token
        scales and zero-points ``[L, K, P_host, C]`` where the keys have ``[L, K, P_host, H]``).
    """

    k_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools
    v_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools

    @property
    def num_slots(self) -> int:
        """``P_host``: the number of page slots."""
        return self.k_pages.shape[-3]

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page slot, keys and values over all layers (data, scales and kivi2
        zero-points if quantized; a kivi2 pool's keys and values differ in scale shape)."""
        return (self.k_pages.nbytes + self.v_pages.nbytes) // self.num_slots

    @property
    def page_shards(self) -> int:
        """``D``: devices the slot axis is split over (1 unless sharded along the page axis)."""
        return page_shards(self.k_pages)


def page_axis(pool) -> int:
    """The page axis of each leaf of ``pool`` (``ndim - 3`` of a layer for per-layer pools)."""
    return first(pool).ndim - 3


def leaves(pool) -> list:
    """The stored page arrays of a pool: ``[data, scale]`` for ``paged.QuantizedPages``
    (``[data, scale, zero]`` for kivi2; never the residual), else ``[pool]``; per-layer pools
    (``paged.LayerPools``) give their layers' leaves one layer after the other."""
    if isinstance(pool, LayerPools):
        return [leaf for layer in pool.layers for leaf in leaves(layer)]
    if isinstance(pool, QuantizedPages):
        return [pool.data, pool.scale] + ([] if pool.zero is None else [pool.zero])
    return [pool]


def rebuild(like, arrays):
    """A pool of ``like``'s kind (float or quantized, same format and grouping) from its leaf
    arrays; a kivi2 ``like`` keeps its residual pages (``residual``, ``residual_len``)."""
    if isinstance(like, LayerPools):
        n = len(leaves(like.layers[0]))
        return LayerPools(
            rebuild(layer, arrays[i * n : (i + 1) * n]) for i, layer in enumerate(like.layers)
        )
    if isinstance(like, QuantizedPages):
        data, scale, *rest = arrays
        zero = rest[0] if rest else None
        return dataclasses.replace(like, data=data, scale=scale, zero=zero)
    (array,) = arrays
    return array


def without_residual(pool):
    """``pool`` without a kivi2 residual (a host pool, or a selection of pages, has none)."""
    if isinstance(pool, LayerPools):
        return LayerPools(without_residual(layer) for layer in pool.layers)
    if isinstance(pool, QuantizedPages) and pool.residual is not None:
        return dataclasses.replace(pool, residual=None, residual_len=None)
    return pool


def describe_pool(x) -> str:
    """``"float pool float32 (2, 4, 8, 16)"`` or ``"quantized int8 pool (...)"`` for messages."""
    if isinstance(x, LayerPools) and x.layers:
        return f"per-layer {describe_pool(x.layers[0])} x {len(x)} layers"
    if isinstance(x, QuantizedPages):
        return f"quantized {x.format.kind} pool {tuple(x.shape)}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"float pool {x.dtype} {tuple(x.shape)}"
    return type(x).__name__


def check_pool(fn: str, name: str, k, v) -> None:
    """``k`` and ``v`` are pools ``[K, P, C, H]`` or ``[L, K, P, C, H]`` of one shape/sharding.

    Both float arrays, or both ``paged.QuantizedPages`` of one format (data and scales
    checked alike); or both ``paged.LayerPools`` of one ``L``, checked layer by layer.
    """
    per_layer = (isinstance(k, LayerPools), isinstance(v, LayerPools))
    if any(per_layer):
        if not all(per_layer) or len(k) != len(v) or not len(k):
            raise ValueError(
                f"{fn}: {name}: expected k and v both per-layer pools (paged.LayerPools, a "
                f"cache's k_pages / v_pages) of one L >= 1, or both pools, got "
                f"{describe_pool(k)} and {describe_pool(v)}"
            )
        for i, (lk, lv) in enumerate(zip(k.layers, v.layers, strict=True)):
            if getattr(lk, "ndim", None) != 4:
                raise ValueError(
                    f"{fn}: {name}: expected each layer a pool [K, P, C, H], got layer {i}: "
                    f"{describe_pool(lk)}"
                )
            check_pool(fn, name, lk, lv)
            if i and (describe_pool(lk) != describe_pool(k.layers[0])):
                raise ValueError(
                    f"{fn}: {name}: expected every layer like layer 0 "
                    f"({describe_pool(k.layers[0])}), got layer {i}: {describe_pool(lk)}"
                )
        return
    quantized = (isinstance(k, QuantizedPages), isinstance(v, QuantizedPages))
    if quantized[0] != quantized[1]:
        raise ValueError(
            f"{fn}: {name}: expected k and v both float or both quantized (paged.QuantizedPages), "
            f"got {describe_pool(k)} and {describe_pool(v)}"
        )
    if quantized[0]:
        check_quantized_pair(fn, name, k, v)
        if 0 in k.data.shape:
            raise ValueError(f"{fn}: {name}: expected no zero-sized axis, got shape {k.shape}")
        return
    check_leaf_pair(fn, name, k, v, (4, 5), "")
    if 0 in k.shape:
        raise ValueError(f"{fn}: {name}: expected no zero-sized axis, got shape {k.shape}")


def check_host(fn: str, pool) -> None:
    """``pool`` is a pinned-host :class:`HostPagePool`."""
    if not isinstance(pool, HostPagePool):
        raise ValueError(f"{fn}: host_pool: expected a HostPagePool, got {type(pool).__name__}")
    check_pool(fn, "host_pool", pool.k_pages, pool.v_pages)
    if getattr(pool.k_pages, "residual", None) is not None or (
        getattr(pool.v_pages, "residual", None) is not None
    ):
        raise ValueError(
            f"{fn}: host_pool: expected a host pool without residual pages (a kivi2 "
            "residual stays on the device; build it with make_host_page_pool), got one"
        )
    kinds = {leaf.sharding.memory_kind for leaf in leaves(pool.k_pages)}
    kind = kinds.pop() if len(kinds) == 1 else sorted(kinds)
    if kind != PINNED_HOST:
        raise ValueError(
            f"{fn}: host_pool: expected arrays in {PINNED_HOST!r} memory, got {kind!r} "
            "(build it with make_host_page_pool)"
        )


def check_device(fn: str, k, v) -> None:
    """``k`` and ``v`` are a device (not host) pool."""
    check_pool(fn, "k_pages/v_pages", k, v)
    kind = main_leaf(k).sharding.memory_kind
    if kind in HOST_MEMORY_KINDS:
        raise ValueError(f"{fn}: k_pages: expected arrays in device memory, got {kind!r}")


def check_match(fn: str, host: HostPagePool, k, v=None) -> None:
    """The host pool mirrors device pool ``k`` (and ``v``: a kivi2 grouping each) (any page
    count; per-device slots if split)."""
    hk = host.k_pages
    if isinstance(hk, LayerPools) != isinstance(k, LayerPools):
        raise ValueError(
            f"{fn}: host_pool: expected a host pool of k_pages' layout ({describe_pool(k)}: "
            f"a cache's per-layer pools need a host pool made from them, a stacked pool a "
            f"stacked one; build it with make_host_page_pool from the device pool), got "
            f"{describe_pool(hk)}"
        )
    if isinstance(hk, LayerPools):
        if len(hk) != len(k):
            raise ValueError(f"{fn}: host_pool: expected {len(k)} layers (k_pages'), got {len(hk)}")
        hk, k = hk.layers[0], k.layers[0]
        host = HostPagePool(hk, host.v_pages.layers[0])
        v = None if v is None else v.layers[0]
    if isinstance(hk, QuantizedPages) != isinstance(k, QuantizedPages):
        raise ValueError(
            f"{fn}: host_pool: expected a host pool of k_pages' kind ({describe_pool(k)}; float "
            f"and quantized pools do not mix: build the host pool with make_host_page_pool from "
            f"the device pool), got {describe_pool(hk)}"
        )
    if isinstance(hk, QuantizedPages) and hk.format != k.format:
        raise ValueError(
            f"{fn}: host_pool: expected format {k.format.kind!r} (k_pages'), got {hk.format.kind!r}"
        )
    if isinstance(hk, QuantizedPages):
        pairs = [("k", hk, k)] + ([] if v is None else [("v", host.v_pages, v)])
        for part, h, d in pairs:
            if h.grouping != d.grouping:
                raise ValueError(
                    f"{fn}: host_pool: expected {part} pages grouped {d.grouping!r} like the "
                    f"device's, got {h.grouping!r}"
                )
    same_rest = hk.shape[:-3] == k.shape[:-3] and hk.shape[-2:] == k.shape[-2:]
    if hk.ndim != k.ndim or not same_rest or hk.dtype != k.dtype:
        raise ValueError(
            f"{fn}: host_pool: expected pages shaped like k_pages {k.shape} {k.dtype} "
            f"(any page count), got {hk.shape} {hk.dtype}"
        )
    if page_shards(hk) > 1 or page_shards(k) > 1:
        hs, ks = main_leaf(hk).sharding, main_leaf(k).sharding
        mirrored = hs.with_memory_kind(ks.memory_kind)
        if page_shards(hk) != page_shards(k) or not mirrored.is_equivalent_to(ks, k.ndim):
            raise ValueError(
                f"{fn}: host_pool: expected the sharding of k_pages {ks} (a pool split "
                f"along its page axis needs a host pool split the same way: build it with "
                f"make_host_page_pool), got {hs}"
            )


def as_named(sharding):
    """A ``NamedSharding`` equivalent to ``sharding`` (a one-device mesh for a single device).

    ``jit`` tracks an argument's memory space in its type only for named shardings, and a
    gather needs its operands in one memory space.
    """
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        mesh = jax.sharding.Mesh(np.asarray([device]), ("device",))
        return jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(), memory_kind=sharding.memory_kind
        )
    return sharding


def device_kind(sharding) -> str:
    """The default memory kind of the devices of ``sharding``."""
    return next(iter(sharding.device_set)).default_memory().kind


def replicated(sharding, memory_kind: str):
    """A replicated sharding over the devices of ``sharding`` in ``memory_kind``."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(), memory_kind=memory_kind
        )
    return sharding.with_memory_kind(memory_kind)


@functools.lru_cache(maxsize=64)
def zeros_fn(shape, dtype, sharding):
    """A jitted zero array created directly in ``sharding`` (no device staging)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def zeros_pools(like_k, like_v, num_slots: int, memory_kind: str):
    """A zero ``(k, v)`` pair shaped like pools ``like_k``, ``like_v`` with ``num_slots`` pages,
    each leaf with its own sharding in ``memory_kind`` (created there directly; no kivi2
    residual)."""
    out = []
    for like in (like_k, like_v):
        axis = page_axis(like)
        arrays = []
        for leaf in leaves(like):
            shape = (*leaf.shape[:axis], num_slots, *leaf.shape[axis + 1 :])
            sharding = as_named(leaf.sharding).with_memory_kind(memory_kind)
            arrays.append(zeros_fn(shape, jnp.dtype(leaf.dtype), sharding)())
        out.append(rebuild(without_residual(like), arrays))
    return tuple(out)


def make_host_page_pool(
    k_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
    v_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
    num_slots: int | np.integer,
) -> HostPagePool:
    """Allocates a zeroed host pool with ``num_slots`` page slots mirroring a device pool.

    The host arrays are created directly in pinned host memory (no device staging) with the
    device pool's sharding: kv heads split over a mesh axis stay split; a pool split along
    its page axis over ``D`` devices gives ``num_slots / D`` slots per device (per-device
    slots, see :func:`~offload.page_out`). Not jittable (it allocates host memory).

    Args:
      k_pages: device keys ``[L, K, P, C, H]`` or ``[K, P, C, H]``, float or a
        ``paged.QuantizedPages``; only its shape (apart from ``P``), dtype (format) and
        sharding are used.
      v_pages: device values, same shape, dtype and sharding as ``k_pages``.
      num_slots: ``P_host >= 1`` (an int or numpy integer), the page capacity of the host
        pool; a multiple of ``D`` for a pool split along its page axis.

    Returns:
      A :class:`HostPagePool` with arrays ``[L, K, P_host, C, H]`` in pinned host memory; for
      a quantized pool, ``QuantizedPages`` of the same format (and kivi2 grouping) whose data
      ``[L, K, P_host, C, H]`` and scales ``[L, K, P_host, C]`` (kivi2: and zero-points;
      keys' ``[L, K, P_host, H]``) are all pinned host (``page_nbytes`` counts them all); a
      kivi2 device pool's residual pages are not mirrored (they stay on the device).

    Raises:
      ValueError: on mismatched or non-device pools, a zero-sized axis, a ``num_slots`` that
        is not a positive int (or not a multiple of ``D``), or devices without pinned host
        memory; on k and v of different kinds (float and quantized) or formats.

    Example:
      >>> k = jnp.zeros((2, 4, 8, 16, 32))
      >>> host = make_host_page_pool(k, k, 64)
      >>> host.k_pages.shape, host.k_pages.sharding.memory_kind
      ((2, 4, 64, 16, 32), 'pinned_host')
    """
    fn = "make_host_page_pool"
    check_device(fn, k_pages, v_pages)
    num_slots = check_int(fn, "num_slots", num_slots, low=1)
    shards = page_shards(k_pages)
    if num_slots % shards:
        raise ValueError(
            f"{fn}: num_slots: expected a multiple of {shards} (k_pages' page axis is split over "
            f"{shards} devices, each gets its own slots), got {num_slots}"
        )
    kind = host_memory_kind(main_leaf(k_pages).sharding.device_set)
    if kind != PINNED_HOST:
        raise ValueError(
            f"{fn}: k_pages: expected devices with {PINNED_HOST!r} memory for an "
            f"in-place host pool, got only {kind!r}"
        )
    return HostPagePool(*zeros_pools(k_pages, v_pages, num_slots, PINNED_HOST))
