"""Page transfers between a device pool and a host pool: page-out, page-in, layer prefetch.

Every transfer takes its **source first, then its destination**, and returns one
:class:`~offload.TransferHandle` whose ``value`` is the destination written:

==================  =====================================================  ==================
call                source -> destination                                  ``handle.value``
==================  =====================================================  ==================
``to_host``         ``tree`` -> host memory                                the host pytree
``to_device``       ``tree`` -> device memory                              the device pytree
``page_out``        ``k_pages, v_pages, page_ids`` -> ``host_pool, slots``  new ``HostPagePool``
``page_in``         ``host_pool, slots`` -> ``k_pages, v_pages, page_ids``  ``(k_pages, v_pages)``
``prefetch_layer``  ``host_pool, slots`` (one ``layer``) -> ``into``/fresh   ``(k, v)``
==================  =====================================================  ==================

The destination is donated where it is given (the host pool of :func:`page_out`, the device
pool of :func:`page_in`, ``into`` of :func:`prefetch_layer`): its old arrays must not be used
again; use ``handle.value``. Every call returns at once; JAX orders later uses of the arrays
after the copy, and :func:`~offload.ready` / :func:`~offload.wait` tell when the data has
landed. None of them is jittable (they dispatch their own compiled copies and check ids on
the host); :func:`prefetch_layer` compiles once per distinct ``n`` and its layer index is
traced.

Index safety: page ids and host slots are checked eagerly (host-side bookkeeping: lists,
numpy or concrete arrays), so every slice inside the kernels is in range and nothing is
padded; no call can read or overwrite another sequence's page.

Layouts: per-layer ``[K, P, C, H]`` and stacked ``[L, K, P, C, H]`` pools, on one device,
replicated, split over kv heads, or split along the page axis over ``D`` devices (the
layout of ``paged.sharded_paged_attention``). A pool split along the page axis has
*per-device slots*: device ``d`` holds pages ``[d * P_d, (d + 1) * P_d)`` and host slots
``[d * S_d, (d + 1) * S_d)``, and each page moves only to a slot of its own device (a pair
that would cross devices is a ``ValueError``). :func:`prefetch_layer` of such a pool takes
``n / D`` slots of each device block in block order and returns ``[K, n, C, H]`` split along
``n`` the same way (each device fetches its own pages); ``into`` is not supported there.

Quantized pools (``paged.QuantizedPages``, int8, fp8, int4 or kivi2) move as they are stored,
in every layout above: each call copies the ``data`` and the ``scale`` pages (kivi2: and the
``zero`` pages) of the same ids together (every leaf in place), the host pool is quantized in
the same format (build it with :func:`~offload.make_host_page_pool` from the device pool), and
``nbytes`` counts data plus scales plus zero-points (``paged.KVFormat.bytes_per_token``:
``H + 4`` bytes per token per kv head for int8 / fp8, about half of bf16; ``H / 2 + 2 H / g``
for int4, about 0.28 of bf16; kivi2 keys ``H / 4 + 4 H / C``, values ``H / 4 + 4``). A kivi2
pool's residual window (each sequence's most recent pages, float32, per sequence row) stays
on the device: the host pool has none, :func:`page_in` keeps the device pool's residual as it
is, and a page out of any page id copies just its stored leaves. Float and quantized pools, or two
formats, never mix (``ValueError``).
"""

import jax
import numpy as np
from jaxtyping import Array, Shaped

from offload._checks import IdList, check_ids, check_int, check_unique
from offload._host_pool import (
    HostPagePool,
    as_named,
    check_device,
    check_host,
    check_match,
    describe_pool,
    leaves,
    rebuild,
)
from offload._page_copy import check_same_shards, copy_pages
from offload._pool_checks import first, page_shards
from offload._prefetch_kernels import prefetch_fn, prefetch_pool_per_shard
from offload._tiers import TransferHandle
from paged import LayerPools, QuantizedPages

__all__ = ["page_in", "page_out", "prefetch_layer"]


def _check_pairs(fn: str, src, dst, dst_name: str, source, target) -> None:
    if src.size != dst.size:
        raise ValueError(
            f"{fn}: {dst_name}: expected as many ids as the source ids ({src.size}), got {dst.size}"
        )
    check_unique(fn, dst_name, dst)
    check_same_shards(fn, dst_name, src, dst, source, target)


def page_out(
    k_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
    v_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
    page_ids: IdList,
    host_pool: HostPagePool,
    host_slots: IdList,
    *,
    request_id: str | None = None,
) -> TransferHandle:
    """Copies device pages ``page_ids`` into host slots ``host_slots`` (asynchronous).

    Source (the device pool and its page ids) first, then destination (the host pool and its
    slots). ``host_pool`` is donated: its buffers are written in place and must not be used
    again; use ``handle.value``. The device pool is only read. Not jittable: call it eagerly
    (it is host-side orchestration of compiled, in-place copies); every call dispatches
    asynchronously, even of one page.

    Args:
      k_pages: device keys ``[L, K, P, C, H]`` (or ``[K, P, C, H]``), float or a
        ``paged.QuantizedPages`` (data and scales are copied together).
      v_pages: device values, same shape, dtype (format) and sharding.
      page_ids: ``[n]`` device page ids in ``[0, P)`` (a list, numpy or concrete array).
      host_pool: the :class:`~offload.HostPagePool` to write, ``[L, K, P_host, C, H]``.
      host_slots: ``[n]`` distinct host slots in ``[0, P_host)``; for pools split along the
        page axis, each on the device of its page.
      request_id: recorded on the handle for accounting.

    Returns:
      A :class:`~offload.TransferHandle`: ``value`` is the new :class:`~offload.HostPagePool`,
      ``direction`` ``"device_to_host"``, ``nbytes`` the bytes copied (keys and values, all
      layers).

    Raises:
      ValueError: on mismatched pools, pools in the wrong memory kind, ids that are not 1-D
        integers of equal length, out of range, repeated host slots, or (pools split along
        the page axis) a page and a slot on different devices; on a float pool with a
        quantized host pool or the reverse, or two quantized formats.

    Example:
      >>> k = jnp.ones((2, 4, 8, 16, 32)); host = make_host_page_pool(k, k, 64)
      >>> host = wait(page_out(k, k, [3, 5], host, [0, 1]))
    """
    fn = "page_out"
    check_device(fn, k_pages, v_pages)
    check_host(fn, host_pool)
    check_match(fn, host_pool, k_pages, v_pages)
    src = check_ids(fn, "page_ids", page_ids, k_pages.shape[-3])
    dst = check_ids(fn, "host_slots", host_slots, host_pool.num_slots)
    _check_pairs(fn, src, dst, "host_slots", k_pages, host_pool.k_pages)
    new_k, new_v, done = copy_pages(
        (k_pages, v_pages), (host_pool.k_pages, host_pool.v_pages), src, dst
    )
    new_pool = HostPagePool(new_k, new_v)
    nbytes = src.size * new_pool.page_nbytes
    return TransferHandle(new_pool, "device_to_host", nbytes, request_id=request_id, done=done)


def page_in(
    host_pool: HostPagePool,
    host_slots: IdList,
    k_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
    v_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
    page_ids: IdList,
    *,
    request_id: str | None = None,
) -> TransferHandle:
    """Copies host slots ``host_slots`` into device pages ``page_ids`` (asynchronous).

    Source (the host pool and its slots) first, then destination (the device pool and its
    page ids). ``k_pages`` and ``v_pages`` are donated and written in place; use
    ``handle.value``. The host pool is only read (free its slots in your allocator when you
    no longer need them). Not jittable: call it eagerly.

    Args:
      host_pool: the :class:`~offload.HostPagePool` to read, ``[L, K, P_host, C, H]``.
      host_slots: ``[n]`` host slots in ``[0, P_host)``.
      k_pages: device keys ``[L, K, P, C, H]`` (or ``[K, P, C, H]``), donated.
      v_pages: device values, same shape, dtype and sharding, donated.
      page_ids: ``[n]`` distinct device page ids in ``[0, P)``; for pools split along the
        page axis, each on the device of its slot.
      request_id: recorded on the handle for accounting.

    Returns:
      A :class:`~offload.TransferHandle`: ``value`` is ``(new_k_pages, new_v_pages)``,
      ``direction`` ``"host_to_device"``.

    Raises:
      ValueError: on mismatched pools, pools in the wrong memory kind, ids that are not 1-D
        integers of equal length, out of range, repeated device page ids, or (pools split
        along the page axis) a slot and a page on different devices; on a float pool with a
        quantized host pool or the reverse, or two quantized formats.

    Example:
      >>> k = jnp.ones((2, 4, 8, 16, 32)); host = make_host_page_pool(k, k, 64)
      >>> k2, v2 = wait(page_in(host, [0, 1], jnp.zeros_like(k), jnp.zeros_like(k), [1, 2]))
    """
    fn = "page_in"
    check_host(fn, host_pool)
    check_device(fn, k_pages, v_pages)
    check_match(fn, host_pool, k_pages, v_pages)
    src = check_ids(fn, "host_slots", host_slots, host_pool.num_slots)
    dst = check_ids(fn, "page_ids", page_ids, k_pages.shape[-3])
    _check_pairs(fn, src, dst, "page_ids", host_pool.k_pages, k_pages)
    new_k, new_v, done = copy_pages(
        (host_pool.k_pages, host_pool.v_pages), (k_pages, v_pages), src, dst
    )
    nbytes = src.size * host_pool.page_nbytes
    return TransferHandle(
        (new_k, new_v), "host_to_device", nbytes, request_id=request_id, done=done
    )


def prefetch_layer(
    host_pool: HostPagePool,
    host_slots: IdList,
    *,
    layer: int | np.integer,
    into: tuple[Shaped[Array, "K n C H"], Shaped[Array, "K n C H"]]
    | tuple[QuantizedPages, QuantizedPages]
    | None = None,
    request_id: str | None = None,
) -> TransferHandle:
    """Starts copying one layer's host pages to device arrays (asynchronous).

    Source (the host pool and its slots, of one ``layer``) first; the destination is ``into``
    when given (donated), else fresh device arrays. Issue it for layer ``l + 1`` before
    computing layer ``l``: the copy then overlaps the compute, and ``wait(handle)`` at layer
    ``l + 1`` finds the data there. ``layer`` is traced inside the kernel, so one compile
    serves every layer (one per distinct ``n``). Consecutive slots (``s, s + 1, ...``, what
    :class:`~offload.OffloadManager` hands out to a request paged out at once) are copied as
    one block instead of page by page. Not jittable: call it eagerly.

    Args:
      host_pool: a :class:`~offload.HostPagePool` with arrays ``[L, K, P_host, C, H]``.
      host_slots: ``[n]`` host slots in ``[0, P_host)``, in the order wanted on device; for a
        pool split along the page axis over ``D`` devices, ``n / D`` slots of device block 0,
        then of block 1, ... (the result is split along ``n`` the same way).
      layer: the layer index in ``[0, L)``: an int or numpy integer (a float is rejected,
        never truncated).
      into: optional staging buffers ``(k, v)``, each ``[K, n, C, H]`` on device (a
        ``paged.QuantizedPages`` of the host pool's format for a quantized pool), donated and
        written in place. Without them each call allocates fresh device arrays, which costs
        page faults on CPU; a decode loop can rotate two pairs (layer ``l + 2`` reuses layer
        ``l``'s pair once layer ``l`` is computed).
      request_id: recorded on the handle for accounting.

    Returns:
      A :class:`~offload.TransferHandle` whose ``value`` is ``(k, v)``, each ``[K, n, C, H]``
      in device memory with the pool's sharding of the ``K`` axis (``QuantizedPages`` with
      scales ``[K, n, C]`` for a quantized pool); ``direction`` ``"host_to_device"``.

    Raises:
      ValueError: if the pool is not rank 5, ``layer`` is not an int in range,
        ``host_slots`` is not a non-empty 1-D integer sequence in range, or ``into`` is not a
        pair of ``[K, n, C, H]`` arrays of the pool's dtype.
      NotImplementedError: if the pool is sharded over its layer axis, or ``into`` is given
        for a pool split along the page axis.

    Example:
      >>> k = jnp.ones((2, 4, 8, 16, 32)); host = make_host_page_pool(k, k, 64)
      >>> pk, pv = wait(prefetch_layer(host, [0, 5], layer=1))
      >>> pk.shape
      (4, 2, 16, 32)
    """
    fn = "prefetch_layer"
    check_host(fn, host_pool)
    if host_pool.k_pages.ndim != 5:
        raise ValueError(
            f"{fn}: host_pool: expected pools [L, K, P_host, C, H], got {host_pool.k_pages.shape}"
        )
    num_layers = host_pool.k_pages.shape[0]
    layer = check_int(fn, "layer", layer, low=0, high=num_layers)
    slots = check_ids(fn, "host_slots", host_slots, host_pool.num_slots)
    if slots.size == 0:
        raise ValueError(f"{fn}: host_slots: expected at least one slot, got none")
    per_layer = isinstance(host_pool.k_pages, LayerPools)  # the layers' own host buffers
    shards = page_shards(host_pool.k_pages)
    if shards > 1:
        if into is not None:
            raise NotImplementedError(
                f"{fn}: into: staging buffers for a pool split along the page axis are not "
                "supported, got a pair (leave into=None)"
            )
        per_slot = host_pool.num_slots // shards
        blocks = slots // per_slot
        per_out = slots.size // shards
        expected = np.arange(slots.size) // max(per_out, 1)
        if slots.size % shards or np.any(blocks != expected):
            raise ValueError(
                f"{fn}: host_slots: expected n / {shards} slots of each device block in block "
                f"order (the pool is split along its pages over {shards} devices and so is the "
                f"result), got slots {slots.tolist()} in blocks {blocks.tolist()}"
            )
        k, mk = prefetch_pool_per_shard(host_pool.k_pages, layer, slots)
        v, mv = prefetch_pool_per_shard(host_pool.v_pages, layer, slots)
        nbytes = slots.size * host_pool.page_nbytes // num_layers
        return TransferHandle(
            (k, v), "host_to_device", nbytes, request_id=request_id, done=tuple(mk + mv)
        )
    pool = host_pool.k_pages
    lead = 0 if per_layer else 1  # where K sits in a host leaf: [K, P, ...] or [L, K, P, ...]
    if into is not None:
        want = (pool.shape[1], slots.size, *pool.shape[-2:])
        quantized = isinstance(first(pool), QuantizedPages)

        def fits(x, source):
            if not quantized:
                return isinstance(x, jax.Array) and x.shape == want and x.dtype == pool.dtype
            # Each leaf: the host leaf's layer [K, P_host, ...] with n pages.
            return (
                isinstance(x, QuantizedPages)
                and x.format == source.format
                and x.grouping == source.grouping
                and len(leaves(x)) == len(leaves(source))
                and all(
                    isinstance(a, jax.Array)
                    and a.shape == (h.shape[lead], slots.size, *h.shape[lead + 2 :])
                    and a.dtype == h.dtype
                    for a, h in zip(leaves(x), leaves(source), strict=True)
                )
            )

        pair = (host_pool.k_pages, host_pool.v_pages)
        if per_layer:
            pair = tuple(x.layers[layer] for x in pair)
        if (
            not isinstance(into, tuple)
            or len(into) != 2
            or not all(fits(x, h) for x, h in zip(into, pair, strict=True))
        ):
            got = [describe_pool(x) for x in into] if isinstance(into, tuple) else repr(into)
            kind = f"quantized {first(pool).format.kind} pools" if quantized else "arrays"
            raise ValueError(
                f"{fn}: into: expected a pair of device {kind} {want} {pool.dtype}, got {got}"
            )
    contiguous = bool(np.all(np.diff(slots) == 1))
    out, markers = [], []
    at = 0 if per_layer else layer  # the index into each host leaf's layer axis
    for part, source in enumerate((host_pool.k_pages, host_pool.v_pages)):
        if per_layer:
            source = source.layers[layer]
        targets = leaves(into[part]) if into is not None else [None] * len(leaves(source))
        arrays = []
        for leaf, target in zip(leaves(source), targets, strict=True):
            fetch = prefetch_fn(
                as_named(leaf.sharding), contiguous, into is not None, leaf.ndim, per_layer
            )
            extra = () if target is None else (target,)
            array, marker = fetch(leaf, np.int32(at), slots, *extra)
            arrays.append(array)
            markers.append(marker)
        out.append(rebuild(source if into is None else into[part], arrays))
    nbytes = slots.size * host_pool.page_nbytes // num_layers
    return TransferHandle(
        tuple(out), "host_to_device", nbytes, request_id=request_id, done=tuple(markers)
    )
