"""The host-side manager that owns a host pool and a disk store and routes page moves.

:class:`OffloadManager` is the clear boundary between the pure page-moving functions
(:func:`~offload.page_out`, :func:`~offload.page_in`, :func:`~offload.prefetch_layer`) and the
bookkeeping they cannot hold under ``jit``: which host slots are free, which belong to which
request, what is on disk. It owns one :class:`~offload.HostPagePool`, an optional
:class:`~offload.DiskStore` and one :class:`~offload.OffloadStats`; the device pool stays with
the caller (``paged``), who passes it in and gets the new one back.
"""

import time

import jax
import numpy as np
from jaxtyping import Array, Shaped

from offload._checks import IdList, check_ids, check_int
from offload._disk import CorruptCacheError, DiskStore
from offload._host_pool import (
    HostPagePool,
    check_host,
    leaves,
    page_shards,
    rebuild,
    stat_shape,
    zeros_pools,
)
from offload._page_copy import copy_pages
from offload._page_numpy import gather_pages, scatter_pages
from offload._stats import OffloadStats, page_nbytes
from offload._tiers import PINNED_HOST, TransferHandle, ready, wait
from offload._transfers import page_in, page_out, prefetch_layer
from paged import KVFormat, QuantizedPages

__all__ = ["OffloadManager"]

# Disk entry arrays, in the leaf order of (k_pages, v_pages).
_FLOAT_NAMES = ("k", "v")
_QUANTIZED_NAMES = ("k", "k_scale", "v", "v_scale")
_KIVI2_NAMES = ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero")


def _entry_names(pool) -> tuple[str, ...]:
    if not isinstance(pool, QuantizedPages):
        return _FLOAT_NAMES
    return _KIVI2_NAMES if pool.zero is not None else _QUANTIZED_NAMES


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


class OffloadManager:
    """Owns a host pool, an optional disk store and the stats; routes page moves.

    Each request's host pages are kept as an ordered list of host slots (its logical page
    order), so a later :meth:`page_in` or :meth:`prefetch` returns them in the order they
    were paged out. Every transfer method returns a :class:`~offload.TransferHandle`, like
    the functions it wraps. For a pool split along the page axis each page gets a free slot
    of its own device (per-device slots), also when :meth:`restore` brings it back from disk
    (the entry records each page's device block); :meth:`prefetch` of such a pool needs the
    request's pages ``n / D`` per device block in block order (as
    :func:`~offload.prefetch_layer`). On disk a request is one :class:`~offload.DiskStore`
    entry keyed by its request id (``k``, ``v``; for a quantized host pool ``k``,
    ``k_scale``, ``v``, ``v_scale`` and ``format``, the format's tag as ASCII bytes; kivi2
    adds ``k_zero`` and ``v_zero``). Quantized pools move as stored, data and scales (and
    kivi2 zero-points) together, and every byte count (stats, handles) includes them; a kivi2
    pool's residual pages stay on the device. Device pages belong to the caller's page
    allocator: after a demotion gives them back (``paged.PageAllocator.release_pages``),
    :meth:`record_device_pages` sets the device tier to the pages still held, in bytes measured
    from the device pool's arrays.

    Args:
      host_pool: the :class:`~offload.HostPagePool` to manage (owned from now on; read the
        current one from :attr:`host_pool`).
      disk: an optional :class:`~offload.DiskStore` for :meth:`spill` / :meth:`restore`.
      stats: an :class:`OffloadStats` to update (a new one by default).

    Raises:
      ValueError: if ``host_pool`` is not a pinned-host :class:`~offload.HostPagePool` or
        ``disk`` is not a :class:`~offload.DiskStore`.

    Example:
      >>> k = jnp.ones((2, 4, 8, 16, 32)); manager = OffloadManager(make_host_page_pool(k, k, 64))
      >>> handle = manager.page_out(k, k, [3, 5], request_id="r1")
      >>> _ = manager.wait(handle); manager.stats.tier_bytes("host", request_id="r1") > 0
      True
    """

    def __init__(
        self,
        host_pool: HostPagePool,
        *,
        disk: DiskStore | None = None,
        stats: OffloadStats | None = None,
    ):
        check_host("OffloadManager", host_pool)
        if disk is not None and not isinstance(disk, DiskStore):
            raise ValueError(
                f"OffloadManager: disk: expected a DiskStore, got {type(disk).__name__}"
            )
        self._host_pool = host_pool
        self.disk = disk
        self.stats = stats if stats is not None else OffloadStats()
        self._free = list(range(host_pool.num_slots))
        self._slots: dict[str, list[int]] = {}
        self._pending: list[TransferHandle] = []

    @property
    def host_pool(self) -> HostPagePool:
        """The current host pool (replaced by every page-out)."""
        return self._host_pool

    @property
    def free_slots(self) -> int:
        """Host slots not owned by any request."""
        return len(self._free)

    def record_device_pages(
        self,
        k_pages: Shaped[Array, "*L K P C H"] | QuantizedPages,
        v_pages: Shaped[Array, "*L K P C H"] | QuantizedPages,
        num_pages: int | np.integer,
    ) -> int:
        """Sets the device tier of ``stats`` to ``num_pages`` pages of this device pool.

        The bytes are measured from the pool's arrays (:func:`~offload.page_nbytes`), never
        entered by hand; pass the pages the allocator holds, e.g.
        ``paged.PageAllocator.stats().pages_used`` after ``release_pages``.

        Args:
          k_pages: the device keys ``[L, K, P, C, H]`` (float or ``paged.QuantizedPages``).
          v_pages: the device values.
          num_pages: pages resident on the device, ``0 <= num_pages <= P``.

        Returns:
          The device bytes now recorded.

        Raises:
          ValueError: on a malformed pool or ``num_pages`` out of range.
        """
        fn = "OffloadManager.record_device_pages"
        num_pages = check_int(fn, "num_pages", num_pages, low=0, high=k_pages.shape[-3])
        nbytes = num_pages * page_nbytes(k_pages, v_pages)
        self.stats.add_tier_bytes("device", nbytes - self.stats.tier_bytes("device"))
        return nbytes

    def host_slots(self, request_id: str) -> np.ndarray:
        """``[n]`` host slots of ``request_id`` in logical page order (empty if none)."""
        return np.asarray(self._slots.get(request_id, []), np.int32)

    def _take_slots(
        self, fn: str, ids: np.ndarray, num_pages: int, arg: str = "page_ids"
    ) -> list[int]:
        """The first free slots for ``ids``, each on its page's device (not yet taken)."""
        shards = page_shards(self._host_pool.k_pages)
        if shards == 1 or num_pages % shards:
            if ids.size > len(self._free):
                raise ValueError(
                    f"{fn}: {arg}: expected at most {len(self._free)} pages (free host "
                    f"slots), got {ids.size}"
                )
            return self._free[: ids.size]
        per_page, per_slot = num_pages // shards, self._host_pool.num_slots // shards
        free = {d: [s for s in self._free if s // per_slot == d] for d in range(shards)}
        blocks, counts = np.unique(ids // per_page, return_counts=True)
        for block, count in zip(blocks.tolist(), counts.tolist(), strict=True):
            if count > len(free[block]):
                raise ValueError(
                    f"{fn}: {arg}: expected at most {len(free[block])} pages of device block "
                    f"{block} (its free host slots: per-device slots), got {count}"
                )
        slots = []
        for page in ids.tolist():
            mine = free[page // per_page]
            slots.append(mine.pop(0))
        return slots

    # -- completion ----------------------------------------------------------------------------
    def _issued(self, handle: TransferHandle) -> TransferHandle:
        self.stats.record_issue(handle.direction, handle.nbytes)
        self._pending.append(handle)
        return handle

    def _complete(self, handle: TransferHandle) -> None:
        if any(h is handle for h in self._pending):
            self._pending = [h for h in self._pending if h is not handle]
            self.stats.record_transfer(
                handle.direction,
                handle.nbytes,
                time.perf_counter() - handle.issued_at,
                request_id=handle.request_id,
                issued=True,
            )

    def wait(self, handle: TransferHandle):
        """Blocks until ``handle`` has landed, records it, and returns its arrays.

        Raises:
          ValueError: if ``handle`` is not a :class:`~offload.TransferHandle`.
        """
        if not isinstance(handle, TransferHandle):
            raise ValueError(
                f"OffloadManager.wait: handle: expected a TransferHandle, got "
                f"{type(handle).__name__}"
            )
        value = wait(handle)
        self._complete(handle)
        return value

    def poll(self) -> int:
        """Records every pending transfer that has landed; returns how many are still pending."""
        for handle in list(self._pending):
            if ready(handle):
                self._complete(handle)
        return len(self._pending)

    # -- device <-> host -----------------------------------------------------------------------
    def page_out(
        self,
        k_pages: Shaped[Array, "*L K P C H"] | QuantizedPages,
        v_pages: Shaped[Array, "*L K P C H"] | QuantizedPages,
        page_ids: IdList,
        *,
        request_id: str,
    ) -> TransferHandle:
        """Copies device pages to newly allocated host slots of ``request_id`` (asynchronous).

        The pages are appended to the request's host pages, in order. The caller frees the
        device pages in its own allocator afterwards.

        Args:
          k_pages: device keys ``[L, K, P, C, H]`` (a ``paged.QuantizedPages`` with a
            quantized host pool: data and scales move together).
          v_pages: device values, same shape.
          page_ids: ``[n]`` device page ids.
          request_id: the owning request.

        Returns:
          The transfer's handle.

        Raises:
          ValueError: if fewer than ``n`` host slots are free, or on anything
            :func:`~offload.page_out` rejects.
        """
        fn = "OffloadManager.page_out"
        ids = check_ids(fn, "page_ids", page_ids, k_pages.shape[-3])
        slots = self._take_slots(fn, ids, k_pages.shape[-3])
        handle = page_out(k_pages, v_pages, ids, self._host_pool, slots, request_id=request_id)
        self._host_pool = handle.value
        taken = set(slots)
        self._free = [s for s in self._free if s not in taken]
        self._slots.setdefault(request_id, []).extend(slots)
        self.stats.add_tier_bytes("host", handle.nbytes, request_id=request_id)
        return self._issued(handle)

    def page_in(
        self,
        k_pages: Shaped[Array, "*L K P C H"] | QuantizedPages,
        v_pages: Shaped[Array, "*L K P C H"] | QuantizedPages,
        page_ids: IdList,
        *,
        request_id: str,
    ) -> TransferHandle:
        """Copies all host pages of ``request_id`` into device pages ``page_ids`` and frees them.

        Args:
          k_pages: device keys ``[L, K, P, C, H]``, donated.
          v_pages: device values, donated.
          page_ids: ``[n]`` device pages to fill, ``n`` = the request's host page count.
          request_id: the owning request.

        Returns:
          The transfer's handle; ``handle.value`` is ``(new_k_pages, new_v_pages)``.

        Raises:
          ValueError: if the request has no host pages or ``n`` does not match, or on anything
            :func:`~offload.page_in` rejects.
        """
        fn = "OffloadManager.page_in"
        slots = self._slots.get(request_id)
        if not slots:
            raise ValueError(
                f"{fn}: request_id: expected a request with host pages, got {request_id!r}"
            )
        handle = page_in(self._host_pool, slots, k_pages, v_pages, page_ids, request_id=request_id)
        self._release(request_id)
        return self._issued(handle)

    def prefetch(self, *, layer: int | np.integer, request_id: str) -> TransferHandle:
        """Starts copying one layer of ``request_id``'s host pages to device (asynchronous).

        Args:
          layer: the layer index in ``[0, L)``.
          request_id: the owning request.

        Returns:
          A handle whose value is ``(k, v)``, each ``[K, n, C, H]`` on device
          (``paged.QuantizedPages``, data and scales, for a quantized host pool).

        Raises:
          ValueError: if the request has no host pages, or on anything
            :func:`~offload.prefetch_layer` rejects.
          NotImplementedError: on pools split along the layer axis.
        """
        slots = self._slots.get(request_id)
        if not slots:
            raise ValueError(
                "OffloadManager.prefetch: request_id: expected a request with host pages, "
                f"got {request_id!r}"
            )
        handle = prefetch_layer(self._host_pool, slots, layer=layer, request_id=request_id)
        return self._issued(handle)

    def _release(self, request_id: str) -> int:
        slots = self._slots.pop(request_id)
        self._free.extend(slots)
        nbytes = len(slots) * self._host_pool.page_nbytes
        self.stats.add_tier_bytes("host", -nbytes, request_id=request_id)
        return nbytes

    def drop(self, request_id: str) -> None:
        """Frees the host slots of ``request_id`` (a finished request).

        Raises:
          ValueError: if the request has no host pages.
        """
        if request_id not in self._slots:
            raise ValueError(
                "OffloadManager.drop: request_id: expected a request with host pages, "
                f"got {request_id!r}"
            )
        self._release(request_id)

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
        names = _entry_names(pool.k_pages)
        axis = pool.k_pages.ndim - 3
        ids = np.asarray(slots, np.int32)
        entry = {}
        if isinstance(pool.k_pages, QuantizedPages):
            entry["format"] = _format_array(pool.k_pages.format)
        shards = page_shards(pool.k_pages)
        if shards > 1:  # read shard by shard; remember each page's device block
            flat = leaves(pool.k_pages) + leaves(pool.v_pages)
            arrays = [gather_pages(leaf, ids, axis) for leaf in flat]
            entry["block"] = (ids // (pool.num_slots // shards)).astype(np.int32)
        else:
            k, v, _ = copy_pages(
                (pool.k_pages, pool.v_pages),
                zeros_pools(pool.k_pages, pool.v_pages, len(slots), PINNED_HOST),
                ids,
                np.arange(len(slots), dtype=np.int32),
            )
            arrays = [np.asarray(a) for a in leaves(k) + leaves(v)]
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
        arrays = store.get(request_id)  # verified; raises before anything changes
        pool = self._host_pool
        parts = self._check_entry(fn, request_id, arrays, pool.k_pages, pool.v_pages)
        k = parts[0]
        n = k.shape[-3]
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
                (pool.k_pages, pool.v_pages), parts, np.asarray(slots, np.int32)
            )
        else:
            if n > len(self._free):
                raise ValueError(
                    f"{fn}: request_id: expected at most {len(self._free)} pages (free host "
                    f"slots), got {n}"
                )
            flat = leaves(pool.k_pages) + leaves(pool.v_pages)
            shardings = [leaf.sharding.with_memory_kind(PINNED_HOST) for leaf in flat]
            staged = jax.device_put(parts, shardings)
            half = len(staged) // 2
            slots = self._free[:n]
            new_k, new_v, _ = copy_pages(
                (rebuild(pool.k_pages, staged[:half]), rebuild(pool.v_pages, staged[half:])),
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
        want = (*data.shape[:-3], data.shape[-2:])
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
                or x.ndim != data.ndim
                or (*x.shape[:-3], x.shape[-2:]) != want
                or x.dtype != data.dtype
                or (parts and x.shape != parts[0].shape)
            ):
                raise ValueError(
                    f"{fn}: request_id: expected disk entry {request_id!r} array {name!r} shaped "
                    f"like the host pool {data.shape} {data.dtype}, got "
                    f"{None if x is None else (x.shape, x.dtype)}"
                )
            else:
                stored_data = x
            parts.append(x)
        return parts
