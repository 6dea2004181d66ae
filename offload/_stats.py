"""Accounting of the offload tiers, and the host-side manager that owns pools and routes moves.

:class:`OffloadStats` is the I/O monitor a server reads to see saturation before latency
collapses: bytes resident per tier (overall and per request), and per direction
(``device_to_host``, ``host_to_device``, ``host_to_disk``, ``disk_to_host``) the number of
transfers, bytes, seconds and transfers still in flight. Seconds of an asynchronous transfer
run from issue to the moment its completion is observed (:meth:`OffloadManager.wait` or
:meth:`OffloadManager.poll`), an upper bound on its true duration.

:class:`OffloadManager` is the clear boundary between the pure page-moving functions
(:func:`~offload.page_out`, :func:`~offload.page_in`, :func:`~offload.prefetch_layer`) and the
bookkeeping they cannot hold under ``jit``: which host slots are free, which belong to which
request, what is on disk. It owns one :class:`~offload.HostPagePool`, an optional
:class:`~offload.DiskStore` and one :class:`OffloadStats`; the device pool stays with the
caller (``paged``), who passes it in and gets the new one back.
"""

import dataclasses
import time

import jax
import numpy as np
from jaxtyping import Array, Int, Shaped

from offload._disk import DiskStore
from offload._host_pool import (
    HostPagePool,
    _check_host,
    _check_ids,
    _copy_pages,
    _zeros_fn,
    page_in,
    page_out,
    prefetch_layer,
)
from offload._tiers import PINNED_HOST, TransferHandle, ready, wait

__all__ = ["DIRECTIONS", "TIERS", "OffloadManager", "OffloadStats", "TransferTotals"]

DIRECTIONS = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host")
TIERS = ("device", "host", "disk")


@dataclasses.dataclass(frozen=True)
class TransferTotals:
    """Totals of one transfer direction.

    Attributes:
      count: completed transfers.
      nbytes: bytes of completed transfers.
      seconds: summed issue-to-completion time of completed transfers.
      in_flight: transfers issued and not yet observed complete.
      in_flight_bytes: their bytes.
    """

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    in_flight: int = 0
    in_flight_bytes: int = 0

    @property
    def gib_per_second(self) -> float:
        """Average throughput, ``nbytes / seconds`` in GiB/s (0 before any transfer)."""
        return self.nbytes / self.seconds / 2**30 if self.seconds > 0 else 0.0


def _check_choice(fn: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{fn}: {name}: expected one of {list(choices)}, got {value!r}")


class OffloadStats:
    """Bytes per tier and transfer totals per direction (host-side, mutable counters).

    Example:
      >>> stats = OffloadStats()
      >>> stats.record_transfer("device_to_host", 1 << 20, 0.001, request_id="r1")
      >>> stats.transfers("device_to_host").count
      1
    """

    def __init__(self):
        self._totals = {d: TransferTotals() for d in DIRECTIONS}
        self._tiers: dict[tuple[str, str | None], int] = {}
        self._request_bytes: dict[tuple[str, str], int] = {}

    def record_issue(self, direction: str, nbytes: int) -> None:
        """Counts a transfer as in flight until :meth:`record_transfer` with ``issued=True``.

        Raises:
          ValueError: on an unknown direction or negative ``nbytes``.
        """
        _check_choice("OffloadStats.record_issue", "direction", direction, DIRECTIONS)
        if nbytes < 0:
            raise ValueError(f"OffloadStats.record_issue: nbytes: expected >= 0, got {nbytes}")
        t = self._totals[direction]
        self._totals[direction] = dataclasses.replace(
            t, in_flight=t.in_flight + 1, in_flight_bytes=t.in_flight_bytes + nbytes
        )

    def record_transfer(
        self,
        direction: str,
        nbytes: int,
        seconds: float,
        *,
        request_id: str | None = None,
        issued: bool = False,
    ) -> None:
        """Records a completed transfer.

        Args:
          direction: one of :data:`DIRECTIONS`.
          nbytes: bytes moved, >= 0.
          seconds: issue-to-completion time, >= 0.
          request_id: the request the bytes belong to (kept per request too).
          issued: whether :meth:`record_issue` counted it as in flight.

        Raises:
          ValueError: on an unknown direction or negative ``nbytes`` / ``seconds``.
        """
        fn = "OffloadStats.record_transfer"
        _check_choice(fn, "direction", direction, DIRECTIONS)
        if nbytes < 0 or seconds < 0:
            raise ValueError(
                f"{fn}: nbytes and seconds: expected >= 0, got nbytes={nbytes} seconds={seconds}"
            )
        t = self._totals[direction]
        self._totals[direction] = TransferTotals(
            count=t.count + 1,
            nbytes=t.nbytes + nbytes,
            seconds=t.seconds + seconds,
            in_flight=t.in_flight - int(issued),
            in_flight_bytes=t.in_flight_bytes - (nbytes if issued else 0),
        )
        if request_id is not None:
            key = (direction, request_id)
            self._request_bytes[key] = self._request_bytes.get(key, 0) + nbytes

    def add_tier_bytes(self, tier: str, delta: int, *, request_id: str | None = None) -> None:
        """Adds ``delta`` (may be negative) to the bytes resident in ``tier``.

        With a ``request_id`` both the request's figure and the total change.

        Raises:
          ValueError: on an unknown tier, or a total or request figure that would go negative.
        """
        fn = "OffloadStats.add_tier_bytes"
        _check_choice(fn, "tier", tier, TIERS)
        keys = [(tier, None)] + ([(tier, request_id)] if request_id is not None else [])
        for key in keys:
            if self._tiers.get(key, 0) + delta < 0:
                raise ValueError(
                    f"{fn}: delta: expected the {tier} bytes of {key[1] or 'all requests'} to "
                    f"stay >= 0, got {self._tiers.get(key, 0)} + {delta}"
                )
        for key in keys:
            self._tiers[key] = self._tiers.get(key, 0) + delta

    def tier_bytes(self, tier: str, *, request_id: str | None = None) -> int:
        """Bytes resident in ``tier`` (of one request when ``request_id`` is given).

        Raises:
          ValueError: on an unknown tier.
        """
        _check_choice("OffloadStats.tier_bytes", "tier", tier, TIERS)
        return self._tiers.get((tier, request_id), 0)

    def transfers(self, direction: str) -> TransferTotals:
        """Totals for one direction.

        Raises:
          ValueError: on an unknown direction.
        """
        _check_choice("OffloadStats.transfers", "direction", direction, DIRECTIONS)
        return self._totals[direction]

    def request_transfer_bytes(self, direction: str, request_id: str) -> int:
        """Bytes moved in ``direction`` for one request."""
        _check_choice("OffloadStats.request_transfer_bytes", "direction", direction, DIRECTIONS)
        return self._request_bytes.get((direction, request_id), 0)

    def requests(self) -> list[str]:
        """Request ids with any tier bytes recorded."""
        return sorted({r for (_, r) in self._tiers if r is not None})

    def as_dict(self) -> dict:
        """A JSON-friendly snapshot: ``{"tiers": {...}, "transfers": {...}, "requests": {...}}``."""
        return {
            "tiers": {t: self.tier_bytes(t) for t in TIERS},
            "transfers": {
                d: {**dataclasses.asdict(self._totals[d]), "gib_per_second": v.gib_per_second}
                for d, v in self._totals.items()
            },
            "requests": {
                r: {t: self.tier_bytes(t, request_id=r) for t in TIERS} for r in self.requests()
            },
        }

    def to_markdown(self) -> str:
        """The snapshot as two Markdown tables (tiers, transfers)."""
        lines = ["| tier | bytes |", "|---|---:|"]
        lines += [f"| {t} | {self.tier_bytes(t)} |" for t in TIERS]
        lines += [
            "",
            "| direction | count | bytes | seconds | GiB/s | in flight |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for d, v in self._totals.items():
            lines.append(
                f"| {d} | {v.count} | {v.nbytes} | {v.seconds:.4f} | {v.gib_per_second:.2f} "
                f"| {v.in_flight} |"
            )
        return "\n".join(lines)


class OffloadManager:
    """Owns a host pool, an optional disk store and the stats; routes page moves.

    Each request's host pages are kept as an ordered list of host slots (its logical page
    order), so a later :meth:`page_in` or :meth:`prefetch` returns them in the order they
    were paged out. On disk a request is one :class:`~offload.DiskStore` entry keyed by its
    request id. Device bytes belong to the caller's page allocator: register them with
    ``manager.stats.add_tier_bytes("device", ...)`` when it allocates or frees pages.

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
        _check_host("OffloadManager", host_pool)
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

    def host_slots(self, request_id: str) -> np.ndarray:
        """``[n]`` host slots of ``request_id`` in logical page order (empty if none)."""
        return np.asarray(self._slots.get(request_id, []), np.int32)

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
        k_pages: Shaped[Array, "*L K P C H"],
        v_pages: Shaped[Array, "*L K P C H"],
        page_ids: Int[Array, " n"],
        *,
        request_id: str,
    ) -> TransferHandle:
        """Copies device pages to newly allocated host slots of ``request_id`` (asynchronous).

        The pages are appended to the request's host pages, in order. The caller frees the
        device pages in its own allocator afterwards.

        Args:
          k_pages: device keys ``[L, K, P, C, H]``.
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
        ids = _check_ids(fn, "page_ids", page_ids, k_pages.shape[-3])
        if ids.size > len(self._free):
            raise ValueError(
                f"{fn}: page_ids: expected at most {len(self._free)} pages (free host slots), "
                f"got {ids.size}"
            )
        slots = self._free[: ids.size]
        self._host_pool, handle = page_out(
            self._host_pool, k_pages, v_pages, ids, slots, request_id=request_id
        )
        del self._free[: ids.size]
        self._slots.setdefault(request_id, []).extend(slots)
        self.stats.add_tier_bytes("host", handle.nbytes, request_id=request_id)
        return self._issued(handle)

    def page_in(
        self,
        k_pages: Shaped[Array, "*L K P C H"],
        v_pages: Shaped[Array, "*L K P C H"],
        page_ids: Int[Array, " n"],
        *,
        request_id: str,
    ) -> tuple[Shaped[Array, "*L K P C H"], Shaped[Array, "*L K P C H"], TransferHandle]:
        """Copies all host pages of ``request_id`` into device pages ``page_ids`` and frees them.

        Args:
          k_pages: device keys ``[L, K, P, C, H]``, donated.
          v_pages: device values, donated.
          page_ids: ``[n]`` device pages to fill, ``n`` = the request's host page count.
          request_id: the owning request.

        Returns:
          ``(new_k_pages, new_v_pages, handle)``.

        Raises:
          ValueError: if the request has no host pages or ``n`` does not match, or on anything
            :func:`~offload.page_in` rejects.
        """
        fn = "OffloadManager.page_in"
        slots = self._slots.get(request_id)
        if not slots:
            raise ValueError(f"{fn}: request_id: no host pages for {request_id!r}")
        k_pages, v_pages, handle = page_in(
            self._host_pool, slots, k_pages, v_pages, page_ids, request_id=request_id
        )
        self._release(request_id)
        return k_pages, v_pages, self._issued(handle)

    def prefetch(self, layer: int, *, request_id: str) -> TransferHandle:
        """Starts copying one layer of ``request_id``'s host pages to device (asynchronous).

        Returns:
          A handle whose value is ``(k, v)``, each ``[K, n, C, H]`` on device.

        Raises:
          ValueError: if the request has no host pages, or on anything
            :func:`~offload.prefetch_layer` rejects.
        """
        slots = self._slots.get(request_id)
        if not slots:
            raise ValueError(
                f"OffloadManager.prefetch: request_id: no host pages for {request_id!r}"
            )
        handle = prefetch_layer(self._host_pool, layer, slots, request_id=request_id)
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
            raise ValueError(f"OffloadManager.drop: request_id: no host pages for {request_id!r}")
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
            raise ValueError(f"{fn}: request_id: no host pages for {request_id!r}")
        start = time.perf_counter()
        pool = self._host_pool
        shape = (*pool.k_pages.shape[:-3], len(slots), *pool.k_pages.shape[-2:])
        zeros = _zeros_fn(shape, pool.k_pages.dtype, pool.k_pages.sharding)
        k, v, _ = _copy_pages(
            (pool.k_pages, pool.v_pages),
            zeros(),
            np.asarray(slots, np.int32),
            np.arange(len(slots), dtype=np.int32),
        )
        nbytes = store.put(request_id, {"k": np.asarray(k), "v": np.asarray(v)})
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
          CorruptCacheError: if a file is missing, truncated or corrupted (names the path).
        """
        fn = "OffloadManager.restore"
        store = self._require_disk(fn)
        start = time.perf_counter()
        arrays = store.get(request_id)  # verified; raises before anything changes
        pool = self._host_pool
        k, v = arrays.get("k"), arrays.get("v")
        want = (*pool.k_pages.shape[:-3], pool.k_pages.shape[-2:])
        for name, x in (("k", k), ("v", v)):
            if (
                x is None
                or x.ndim != pool.k_pages.ndim
                or (*x.shape[:-3], x.shape[-2:]) != want
                or x.dtype != pool.k_pages.dtype
            ):
                raise ValueError(
                    f"{fn}: request_id: disk entry {request_id!r} array {name!r} does not match "
                    f"the host pool {pool.k_pages.shape} {pool.k_pages.dtype}, got "
                    f"{None if x is None else (x.shape, x.dtype)}"
                )
        n = k.shape[-3]
        if n > len(self._free):
            raise ValueError(
                f"{fn}: request_id: expected at most {len(self._free)} pages (free host slots), "
                f"got {n}"
            )
        sharding = pool.k_pages.sharding.with_memory_kind(PINNED_HOST)
        staged = jax.device_put((k, v), (sharding, sharding))
        slots = self._free[:n]
        new_k, new_v, _ = _copy_pages(
            staged, (pool.k_pages, pool.v_pages), np.arange(n, dtype=np.int32), np.asarray(slots)
        )
        self._host_pool = HostPagePool(new_k, new_v)
        jax.block_until_ready(self._host_pool)
        del self._free[:n]
        self._slots.setdefault(request_id, []).extend(slots)
        nbytes = k.nbytes + v.nbytes
        self.stats.record_transfer(
            "disk_to_host", nbytes, time.perf_counter() - start, request_id=request_id
        )
        self.stats.add_tier_bytes("host", n * pool.page_nbytes, request_id=request_id)
        store.delete(request_id)
        self._sync_disk_bytes()
        return nbytes
