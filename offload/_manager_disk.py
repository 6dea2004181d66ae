"""The disk tier of :class:`offload.OffloadManager`: spilling to and restoring from disk.

A request's host pages go to disk as one :class:`~offload.DiskStore` entry keyed by its
request id (``k``, ``v``; for a quantized host pool also the scales, kivi2's zero-points and
the format's tag as ASCII bytes; for a pool split along the page axis each page's device
block), and come back into free host slots after the entry is read and verified. A per-layer
host pool (``paged.LayerPools``) writes each array stacked over its layers, so an entry is the
same whichever layout wrote it and restores into either.
:class:`DiskTier` is a base class of :class:`offload.OffloadManager`, whose host slots, stats
and disk store its methods use.
"""

import time

import jax
import numpy as np

from offload._disk import CorruptCacheError, DiskStore
from offload._host_pool import HostPagePool, leaves, page_axis, rebuild, zeros_pools
from offload._page_copy import copy_pages
from offload._page_numpy import gather_pages, scatter_pages
from offload._pool_checks import first, page_shards, stat_shape
from offload._tiers import PINNED_HOST
from paged import KVFormat, LayerPools, QuantizedPages

# Disk entry arrays, in the leaf order of (k_pages, v_pages).
_FLOAT_NAMES = ("k", "v")
_QUANTIZED_NAMES = ("k", "k_scale", "v", "v_scale")
_KIVI2_NAMES = ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero")


def _entry_names(pool) -> tuple[str, ...]:
    if not isinstance(pool, QuantizedPages):
        return _FLOAT_NAMES
    return _KIVI2_NAMES if pool.zero is not None else _QUANTIZED_NAMES


def _stack_layers(like, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Numpy leaves of one side (keys or values) in ``like``'s leaf order as the disk entry's
    arrays (``_entry_names`` order): per-layer pools (``paged.LayerPools``, leaves layer by
    layer) stack their layers' leaves along a new axis 0, so an entry is the same whichever
    layout wrote it, and restores into either."""
    if not isinstance(like, LayerPools):
        return list(arrays)
    n = len(arrays) // len(like)
    return [np.stack(arrays[i::n]) for i in range(n)]


def _layer_leaves(like, parts: list[np.ndarray]) -> list[np.ndarray]:
    """Entry arrays of one side (stacked over layers for per-layer ``like``) as ``like``'s
    leaves (:func:`offload._host_pool.leaves` order: layer by layer)."""
    if not isinstance(like, LayerPools):
        return list(parts)
    return [part[layer] for layer in range(len(like)) for part in parts]


def _format_array(kv_format: KVFormat) -> np.ndarray:
    """The format's tag (its kind; int4 adds its group, ``"int4-g32"``) as uint8 ASCII bytes
    (a disk entry holds arrays only)."""
    return np.frombuffer(kv_format.tag.encode("ascii"), np.uint8).copy()


def _format_kind(array) -> str | None:
    if array is None:
        return None
    if array.dtype != np.uint8 or array.ndim != 1:
        return repr((array.shape, array.dtype))
    return array.tobytes().decode("ascii", errors="replace")


class DiskTier:
    """The host <-> disk moves of :class:`offload.OffloadManager` (a base class of it).

    The methods use the manager's ``disk``, ``stats``, ``_host_pool``, ``_slots`` and
    ``_free``, and its ``_take_slots`` and ``_release``.
    """

    # -- host <-> disk -------------------------------------------------------------------------
    def _require_disk(self, fn: str) -> DiskStore:
        if self.disk is None:
            raise ValueError(f"{fn}: disk: expected the manager to have a DiskStore, got None")
        return self.disk

    def _sync_disk_bytes(self) -> None:
        """Re-reads per-request disk bytes from the store (LRU eviction may drop entries)."""
        store = self.disk
        for request in self.stats.requests():
            have = self.stats.tier_bytes("disk", request_id=request)
            want = store.entry_nbytes(request) if request in store else 0
            if have != want:
                self.stats.add_tier_bytes("disk", want - have, request_id=request)
        for request in store.keys():
            have = self.stats.tier_bytes("disk", request_id=request)
            if have != store.entry_nbytes(request):
                self.stats.add_tier_bytes(
                    "disk", store.entry_nbytes(request) - have, request_id=request
                )

    def spill(self, request_id: str) -> int:
        """Moves all host pages of ``request_id`` to disk (synchronous) and frees its slots.

        Returns:
          Bytes written.

        Raises:
          ValueError: without a disk store, if the request has no host pages, or if its pages
            exceed the disk budget.
        """
        fn = "OffloadManager.spill"
        store = self._require_disk(fn)
        slots = self._slots.get(request_id)
        if not slots:
            raise ValueError(
                f"{fn}: request_id: expected a request with host pages, got {request_id!r}"
            )
        start = time.perf_counter()
        pool = self._host_pool
        names = _entry_names(first(pool.k_pages))
        axis = page_axis(pool.k_pages)
        ids = np.asarray(slots, np.int32)
        entry = {}
        if isinstance(first(pool.k_pages), QuantizedPages):
            entry["format"] = _format_array(first(pool.k_pages).format)
        shards = page_shards(pool.k_pages)
        if shards > 1:  # read shard by shard; remember each page's device block
            arrays = [
                array
                for side in (pool.k_pages, pool.v_pages)
                for array in _stack_layers(side, [gather_pages(x, ids, axis) for x in leaves(side)])
            ]
            entry["block"] = (ids // (pool.num_slots // shards)).astype(np.int32)
        else:
            k, v, _ = copy_pages(
                (pool.k_pages, pool.v_pages),
                zeros_pools(pool.k_pages, pool.v_pages, len(slots), PINNED_HOST),
                ids,
                np.arange(len(slots), dtype=np.int32),
            )
            arrays = [
                array
                for side in (k, v)
                for array in _stack_layers(side, [np.asarray(x) for x in leaves(side)])
            ]
        nbytes = store.put(request_id, {**dict(zip(names, arrays, strict=True)), **entry})
        self.stats.record_transfer(
            "host_to_disk", nbytes, time.perf_counter() - start, request_id=request_id
        )
        self._release(request_id)
        self._sync_disk_bytes()
        return nbytes

    def restore(self, request_id: str) -> int:
        """Moves ``request_id``'s pages from disk into newly allocated host slots.

        The entry is read and verified before anything is allocated or written, so a corrupt
        entry leaves the host pool, the slots and the device untouched. The disk entry is
        removed once the pages are on host.

        Returns:
          Bytes read.

        Raises:
          ValueError: without a disk store, if the entry is missing, shaped unlike the host
            pool, or needs more host slots than are free.
          CorruptCacheError: if a file is missing, truncated or corrupted (names the path), or
            the entry's kind does not match the host pool: float pages into a quantized pool
            or the reverse, another format, or scales shaped unlike the data.
        """
        fn = "OffloadManager.restore"
        store = self._require_disk(fn)
        start = time.perf_counter()
        pool = self._host_pool
        arrays = store.get(request_id)  # verified; raises before anything changes
        parts = self._check_entry(fn, request_id, arrays, pool.k_pages, pool.v_pages)
        n = parts[0].shape[-3]
        half = len(parts) // 2  # the pool's leaves (layer by layer if per-layer), keys first
        split = _layer_leaves(pool.k_pages, parts[:half]) + _layer_leaves(pool.v_pages, parts[half:])  # fmt: skip
        shards = page_shards(pool.k_pages)
        if shards > 1:
            block = arrays.get("block")
            if block is None or block.shape != (n,) or not np.issubdtype(block.dtype, np.integer):
                raise ValueError(
                    f"{fn}: request_id: expected disk entry {request_id!r} of a pool split along "
                    f"the page axis to hold a 'block' [{n}] int array, got "
                    f"{None if block is None else (block.shape, block.dtype)}"
                )
            per_slot = pool.num_slots // shards
            # Page j returns to a free slot of its own device block (the caller pages it in to
            # a device page of that block).
            slots = self._take_slots(
                fn, block.astype(np.int64) * per_slot, pool.num_slots, "request_id"
            )
            new_k, new_v = scatter_pages(
                (pool.k_pages, pool.v_pages), split, np.asarray(slots, np.int32)
            )
        else:
            if n > len(self._free):
                raise ValueError(
                    f"{fn}: request_id: expected at most {len(self._free)} pages (free host "
                    f"slots), got {n}"
                )
            flat = leaves(pool.k_pages) + leaves(pool.v_pages)
            shardings = [leaf.sharding.with_memory_kind(PINNED_HOST) for leaf in flat]
            staged = jax.device_put(split, shardings)
            keys = len(flat) // 2
            slots = self._free[:n]
            new_k, new_v, _ = copy_pages(
                (rebuild(pool.k_pages, staged[:keys]), rebuild(pool.v_pages, staged[keys:])),
                (pool.k_pages, pool.v_pages),
                np.arange(n, dtype=np.int32),
                np.asarray(slots),
            )
        self._host_pool = HostPagePool(new_k, new_v)
        jax.block_until_ready(self._host_pool)
        taken = set(slots)
        self._free = [s for s in self._free if s not in taken]
        self._slots.setdefault(request_id, []).extend(slots)
        nbytes = sum(x.nbytes for x in parts)
        self.stats.record_transfer(
            "disk_to_host", nbytes, time.perf_counter() - start, request_id=request_id
        )
        self.stats.add_tier_bytes("host", n * pool.page_nbytes, request_id=request_id)
        store.delete(request_id)
        self._sync_disk_bytes()
        return nbytes

    @staticmethod
    def _check_entry(fn: str, request_id: str, arrays: dict, like, like_v) -> list[np.ndarray]:
        """The entry's page arrays in leaf order, checked against host pools ``like`` (keys)
        and ``like_v`` (values)."""
        layers = (len(like),) if isinstance(like, LayerPools) else ()
        like, like_v = first(like), first(like_v)  # per-layer: layer 0 stands for every layer
        stored = _format_kind(arrays.get("format"))
        want_kind = like.format.tag if isinstance(like, QuantizedPages) else None
        if stored != want_kind or (want_kind is None and "k_scale" in arrays):

            def kind(x):
                return "float pages" if x is None else f"quantized {x!r} pages"

            raise CorruptCacheError(
                f"{fn}: request_id: expected disk entry {request_id!r} to hold {kind(want_kind)} "
                f"like the host pool, got {kind(stored)}"
            )
        data = like.data if isinstance(like, QuantizedPages) else like
        data_shape = (*layers, *data.shape)  # the entry's: stacked over layers if per-layer
        want = (*data_shape[:-3], data_shape[-2:])
        parts = []
        stored_data = None  # the data array of the part (k or v) being read
        for name in _entry_names(like):
            x = arrays.get(name)
            if name.endswith(("_scale", "_zero")):
                fmt = like.format
                grouping = (like if name.startswith("k") else like_v).grouping
                shape = stat_shape(fmt, grouping, stored_data.shape)
                what = "scales" if name.endswith("_scale") else "zero-points"
                if x is None or x.shape != shape or x.dtype != fmt.scale_dtype:
                    raise CorruptCacheError(
                        f"{fn}: request_id: expected disk entry {request_id!r} array {name!r} "
                        f"{fmt.scale_dtype} {shape} (the {what} of its data), got "
                        f"{None if x is None else (x.shape, x.dtype)}"
                    )
            elif (
                x is None
                or x.ndim != len(data_shape)
                or (*x.shape[:-3], x.shape[-2:]) != want
                or x.dtype != data.dtype
                or (parts and x.shape != parts[0].shape)
            ):
                raise ValueError(
                    f"{fn}: request_id: expected disk entry {request_id!r} array {name!r} shaped "
                    f"like the host pool {data_shape} {data.dtype}, got "
                    f"{None if x is None else (x.shape, x.dtype)}"
                )
            else:
                stored_data = x
            parts.append(x)
        return parts
