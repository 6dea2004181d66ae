"""A polling monitor over live counters: :class:`Monitor`.

It snapshots a :class:`paged.PageAllocator` and an :class:`offload.OffloadStats` each time it is
polled and hands the pair, the previous pair and the wall time between them to
:func:`offload.monitoring.compute_metrics` (in :mod:`offload.monitoring._monitoring`), so rates
are over the window since the last poll.
"""

import math
import threading
import time
from collections.abc import Callable

from offload import OffloadStats
from offload.monitoring._monitoring import (
    MetricsConfig,
    MetricsReport,
    MetricsSnapshot,
    compute_metrics,
)
from paged import PageAllocator

__all__ = ["Monitor"]


class Monitor:
    """Polls an allocator and offload stats, keeping the window between polls (host side).

    Each :meth:`poll` computes :func:`compute_metrics` over the window since the previous poll
    (the first poll: since construction), timed by ``clock``. Thread-safe: concurrent polls
    are serialised.

    Args:
      allocator: a :class:`paged.PageAllocator`, or ``None``.
      offload: an :class:`OffloadStats` (e.g. ``OffloadManager.stats``), or ``None``.
      config: thresholds and buckets (``MetricsConfig()`` when ``None``).
      clock: seconds, monotonic (``time.monotonic`` by default; inject one in tests).

    Raises:
      ValueError: on arguments of the wrong type, or neither source given.

    Example:
      >>> from paged import PageAllocator
      >>> ticks = iter([0.0, 2.0])
      >>> stats = OffloadStats()
      >>> monitor = Monitor(None, stats, clock=lambda: next(ticks))
      >>> stats.record_transfer("host_to_disk", 1000, 0.01)
      >>> monitor.poll().metrics['longctx_offload_link_bytes_per_second{link="disk"}']
      500.0
    """

    def __init__(
        self,
        allocator: PageAllocator | None = None,
        offload: OffloadStats | None = None,
        *,
        config: MetricsConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        fn = "Monitor"
        if allocator is not None and not isinstance(allocator, PageAllocator):
            raise ValueError(
                f"{fn}: allocator: expected a paged.PageAllocator or None, got "
                f"{type(allocator).__name__}"
            )
        if offload is not None and not isinstance(offload, OffloadStats):
            raise ValueError(
                f"{fn}: offload: expected an OffloadStats or None, got {type(offload).__name__}"
            )
        config = MetricsConfig() if config is None else config
        if allocator is None and offload is None:
            raise ValueError(f"{fn}: allocator, offload: expected at least one, got neither")
        if not isinstance(config, MetricsConfig):
            raise ValueError(f"{fn}: config: expected a MetricsConfig, got {type(config).__name__}")
        if not callable(clock):
            raise ValueError(f"{fn}: clock: expected a callable, got {clock!r}")
        self._allocator = allocator
        self._offload = offload
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._last = self._take()
        self._last_time = float(clock())

    def _take(self) -> MetricsSnapshot:
        return MetricsSnapshot(
            self._allocator.stats() if self._allocator is not None else None,
            self._offload.snapshot() if self._offload is not None else None,
        )

    def poll(self) -> MetricsReport:
        """Metrics and alerts over the window since the last poll; starts the next window.

        A zero-length window (the clock did not advance) reports no rates.
        """
        with self._lock:
            current = self._take()
            now = float(self._clock())
            elapsed = now - self._last_time
            report = compute_metrics(
                current.allocator,
                current.offload,
                previous=self._last,
                elapsed_seconds=elapsed if elapsed > 0 and math.isfinite(elapsed) else None,
                config=self._config,
            )
            self._last, self._last_time = current, now
            return report
