"""The host-side manager that owns a host pool and a disk store and routes page moves.

:class:`OffloadManager` is the clear boundary between the pure page-moving functions
(:func:`~offload.page_out`, :func:`~offload.page_in`, :func:`~offload.prefetch_layer`) and the
bookkeeping they cannot hold under ``jit``: which host slots are free, which belong to which
request, what is on disk. It owns one :class:`~offload.HostPagePool`, an optional
:class:`~offload.DiskStore` and one :class:`~offload.OffloadStats`; the device pool stays with
the caller (``paged``), who passes it in and gets the new one back.
"""

import time

import numpy as np
from jaxtyping import Array, Shaped

from offload._checks import IdList, check_ids, check_int
from offload._disk import DiskStore
from offload._host_pool import HostPagePool, check_host
from offload._manager_disk import DiskTier
from offload._pool_checks import page_shards
from offload._stats import OffloadStats, page_nbytes
from offload._tiers import TransferHandle, ready, wait
from offload._transfers import page_in, page_out, prefetch_layer
from paged import LayerPools, QuantizedPages

__all__ = ["OffloadManager"]


class OffloadManager(DiskTier):
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
        k_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
        v_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
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
        k_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
        v_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
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
        k_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
        v_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
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
