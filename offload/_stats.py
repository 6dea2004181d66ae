"""Accounting of the offload tiers: bytes per tier and transfer totals per direction.

:class:`OffloadStats` is the I/O monitor a server reads to see saturation before latency
collapses: bytes resident per tier (overall and per request), and per direction
(``device_to_host``, ``host_to_device``, ``host_to_disk``, ``disk_to_host``) the number of
transfers, bytes, seconds and transfers still in flight. Seconds of an asynchronous transfer
run from issue to the moment its completion is observed (:meth:`OffloadManager.wait` or
:meth:`OffloadManager.poll`), an upper bound on its true duration.

The counters are host-side state that several threads may update (a prefetch thread, a
scheduler): every method holds one lock, so concurrent ``record_*`` calls lose no update, and
:meth:`OffloadStats.snapshot` returns one consistent, immutable :class:`OffloadSnapshot`
(rates over a window come from two snapshots and the wall time between them, see
:func:`offload.monitoring.compute_metrics`).
"""

import dataclasses
import threading
import types
from collections.abc import Mapping

import jax
import numpy as np
from jaxtyping import Array, Shaped

from offload._checks import check_choice, check_float, check_int
from offload._host_pool import check_pool, leaves
from paged import LayerPools, QuantizedPages

__all__ = [
    "OffloadSnapshot",
    "OffloadStats",
    "TransferTotals",
    "measure_bytes",
    "page_nbytes",
]

DIRECTIONS = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host")
TIERS = ("device", "host", "disk")


def measure_bytes(tree) -> dict[str, int]:
    """Bytes of every array in ``tree``, by memory kind, measured from the arrays' ``nbytes``.

    What a tier holds is read off the arrays that hold it, never entered by hand: a page pool,
    a ``paged.QuantizedPages`` (data, scales, zero-points and a kivi2 residual: every leaf), a
    :class:`~offload.HostPagePool`, a staging pool, or any pytree of them. Host-side, not
    jittable.

    Args:
      tree: a pytree whose leaves are ``jax.Array`` (counted under their sharding's memory
        kind: ``"device"``, ``"pinned_host"``, ``"unpinned_host"``), numpy arrays (counted under
        ``"numpy"``) or anything else (ignored: Python scalars, None).

    Returns:
      ``{memory kind: bytes}`` for the kinds present (global bytes of sharded arrays).

    Example:
      >>> measure_bytes((jnp.zeros((4, 8)), jnp.zeros(3, jnp.int8)))
      {'device': 131}
    """
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            kind = leaf.sharding.memory_kind or "device"
        elif isinstance(leaf, np.ndarray):
            kind = "numpy"
        else:
            continue
        out[kind] = out.get(kind, 0) + int(leaf.nbytes)
    return out


def page_nbytes(
    k_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
    v_pages: Shaped[Array, "*L K P C H"] | QuantizedPages | LayerPools,
) -> int:
    """Bytes of one page of a pool, keys and values over all layers, measured from its arrays.

    The page-indexed leaves' ``nbytes`` (data, scales, kivi2 zero-points; not a kivi2
    residual, which is per sequence) divided by the page count ``P``: multiply by the pages a
    tier holds for its bytes (``OffloadManager.record_device_pages`` does it for the device).
    Host-side, not jittable.

    Args:
      k_pages: ``[L, K, P, C, H]`` or ``[K, P, C, H]`` keys, float or ``paged.QuantizedPages``,
        in any memory kind.
      v_pages: values, same shape.

    Returns:
      Bytes per page (an int).

    Raises:
      ValueError: on pools of different shapes, kinds or formats.

    Example:
      >>> k = jnp.zeros((2, 4, 8, 16, 32))
      >>> page_nbytes(k, k) == 2 * 2 * 4 * 16 * 32 * 4
      True
    """
    check_pool("page_nbytes", "k_pages/v_pages", k_pages, v_pages)
    pages = k_pages.shape[-3]
    total = sum(int(x.nbytes) for x in leaves(k_pages) + leaves(v_pages))
    return total // pages


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


@dataclasses.dataclass(frozen=True)
class OffloadSnapshot:
    """An immutable, consistent copy of an :class:`OffloadStats` (see :meth:`OffloadStats.snapshot`).

    Attributes:
      transfers: :attr:`OffloadStats.DIRECTIONS` -> :class:`TransferTotals` (read-only mapping).
      tier_bytes: :attr:`OffloadStats.TIERS` -> bytes resident, all requests (read-only mapping).
      num_requests: request ids with any tier bytes recorded.
    """

    transfers: Mapping[str, TransferTotals]
    tier_bytes: Mapping[str, int]
    num_requests: int


class OffloadStats:
    """Bytes per tier and transfer totals per direction (host-side, mutable, thread-safe).

    Attributes:
      TIERS: the tiers it counts bytes of, ``("device", "host", "disk")``.
      DIRECTIONS: the transfer directions it totals, ``("device_to_host", "host_to_device",
        "host_to_disk", "disk_to_host")``.

    Example:
      >>> stats = OffloadStats()
      >>> stats.record_transfer("device_to_host", 1 << 20, 0.001, request_id="r1")
      >>> stats.transfers("device_to_host").count
      1
    """

    TIERS: tuple[str, ...] = TIERS
    DIRECTIONS: tuple[str, ...] = DIRECTIONS

    def __init__(self):
        self._totals = {d: TransferTotals() for d in DIRECTIONS}
        self._tiers: dict[tuple[str, str | None], int] = {}
        self._request_bytes: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def record_issue(self, direction: str, nbytes: int | np.integer) -> None:
        """Counts a transfer as in flight until :meth:`record_transfer` with ``issued=True``.

        Raises:
          ValueError: on an unknown direction or negative ``nbytes``.
        """
        check_choice("OffloadStats.record_issue", "direction", direction, DIRECTIONS)
        nbytes = check_int("OffloadStats.record_issue", "nbytes", nbytes, low=0)
        with self._lock:
            t = self._totals[direction]
            self._totals[direction] = dataclasses.replace(
                t, in_flight=t.in_flight + 1, in_flight_bytes=t.in_flight_bytes + nbytes
            )

    def record_transfer(
        self,
        direction: str,
        nbytes: int | np.integer,
        seconds: float | int | np.floating | np.integer,
        *,
        request_id: str | None = None,
        issued: bool = False,
    ) -> None:
        """Records a completed transfer.

        Args:
          direction: one of :attr:`OffloadStats.DIRECTIONS`.
          nbytes: bytes moved, >= 0.
          seconds: issue-to-completion time, >= 0.
          request_id: the request the bytes belong to (kept per request too).
          issued: whether :meth:`record_issue` counted it as in flight.

        Raises:
          ValueError: on an unknown direction or negative ``nbytes`` / ``seconds``.
        """
        fn = "OffloadStats.record_transfer"
        check_choice(fn, "direction", direction, DIRECTIONS)
        nbytes = check_int(fn, "nbytes", nbytes, low=0)
        seconds = check_float(fn, "seconds", seconds, low=0.0)
        with self._lock:
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

    def add_tier_bytes(
        self, tier: str, delta: int | np.integer, *, request_id: str | None = None
    ) -> None:
        """Adds ``delta`` (may be negative) to the bytes resident in ``tier``.

        With a ``request_id`` both the request's figure and the total change.

        Raises:
          ValueError: on an unknown tier, or a total or request figure that would go negative.
        """
        fn = "OffloadStats.add_tier_bytes"
        check_choice(fn, "tier", tier, TIERS)
        delta = check_int(fn, "delta", delta)
        keys = [(tier, None)] + ([(tier, request_id)] if request_id is not None else [])
        with self._lock:
            for key in keys:
                if self._tiers.get(key, 0) + delta < 0:
                    raise ValueError(
                        f"{fn}: delta: expected the {tier} bytes of {key[1] or 'all requests'} "
                        f"to stay >= 0, got {self._tiers.get(key, 0)} + {delta}"
                    )
            for key in keys:
                self._tiers[key] = self._tiers.get(key, 0) + delta

    def tier_bytes(self, tier: str, *, request_id: str | None = None) -> int:
        """Bytes resident in ``tier`` (of one request when ``request_id`` is given).

        Raises:
          ValueError: on an unknown tier.
        """
        check_choice("OffloadStats.tier_bytes", "tier", tier, TIERS)
        with self._lock:
            return self._tiers.get((tier, request_id), 0)

    def transfers(self, direction: str) -> TransferTotals:
        """Totals for one direction.

        Raises:
          ValueError: on an unknown direction.
        """
        check_choice("OffloadStats.transfers", "direction", direction, DIRECTIONS)
        with self._lock:
            return self._totals[direction]

    def request_transfer_bytes(self, direction: str, request_id: str) -> int:
        """Bytes moved in ``direction`` for one request."""
        check_choice("OffloadStats.request_transfer_bytes", "direction", direction, DIRECTIONS)
        with self._lock:
            return self._request_bytes.get((direction, request_id), 0)

    def requests(self) -> list[str]:
        """Request ids with any tier bytes recorded."""
        with self._lock:
            return sorted({r for (_, r) in self._tiers if r is not None})

    def snapshot(self) -> OffloadSnapshot:
        """One consistent, immutable copy of the totals and tier bytes (taken under the lock).

        Example:
          >>> stats = OffloadStats()
          >>> stats.record_transfer("host_to_disk", 4096, 0.002)
          >>> snap = stats.snapshot()
          >>> stats.record_transfer("host_to_disk", 4096, 0.002)
          >>> snap.transfers["host_to_disk"].count, stats.snapshot().transfers["host_to_disk"].count
          (1, 2)
        """
        with self._lock:
            return OffloadSnapshot(
                transfers=types.MappingProxyType(dict(self._totals)),
                tier_bytes=types.MappingProxyType(
                    {t: self._tiers.get((t, None), 0) for t in TIERS}
                ),
                num_requests=len({r for (_, r) in self._tiers if r is not None}),
            )

    def as_dict(self) -> dict:
        """A JSON-friendly snapshot: ``{"tiers": {...}, "transfers": {...}, "requests": {...}}``."""
        with self._lock:
            totals = dict(self._totals)
            tiers = dict(self._tiers)
        requests = sorted({r for (_, r) in tiers if r is not None})
        return {
            "tiers": {t: tiers.get((t, None), 0) for t in TIERS},
            "transfers": {
                d: {**dataclasses.asdict(v), "gib_per_second": v.gib_per_second}
                for d, v in totals.items()
            },
            "requests": {r: {t: tiers.get((t, r), 0) for t in TIERS} for r in requests},
        }

    def to_markdown(self) -> str:
        """The snapshot as two Markdown tables (tiers, transfers)."""
        snap = self.snapshot()
        lines = ["| tier | bytes |", "|---|---:|"]
        lines += [f"| {t} | {snap.tier_bytes[t]} |" for t in TIERS]
        lines += [
            "",
            "| direction | count | bytes | seconds | GiB/s | in flight |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for d, v in snap.transfers.items():
            lines.append(
                f"| {d} | {v.count} | {v.nbytes} | {v.seconds:.4f} | {v.gib_per_second:.2f} "
                f"| {v.in_flight} |"
            )
        return "\n".join(lines)
