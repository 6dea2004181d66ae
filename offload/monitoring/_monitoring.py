"""Production metrics and alerts from the allocator and offload counters (the article's rules 9-12).

:func:`compute_metrics` turns a :class:`paged.AllocatorStats` and an
:class:`offload.OffloadSnapshot` (optionally with the previous pair and the wall time between
them) into a flat ``{sample: value}`` dict and the :class:`Alert` s that fire under a
:class:`MetricsConfig`. Sample keys are Prometheus sample names with their labels
(``'longctx_offload_transfer_bytes_total{direction="host_to_disk"}'``), so
:func:`offload.monitoring.to_prometheus` can print them as a scrape page; the dict itself is JSON-ready.

What maps to what in the article ("The engineering truth of long-context inference, 2026",
``offload.planning.ARTICLE``):

========================  ==============================================  ==================
alert                     value                                           article
========================  ==============================================  ==================
``prefix_hit_rate_low``   prefix-cache hit rate (over the window if any)  rule 9, incident A
``page_table_bytes_high`` page-table bytes of the longest live sequence   rule 10
``host_bytes_rate_high``  device<->host bytes / second over the window    rules 6 and 11
``host_ops_rate_high``    device<->host transfers / second                rules 6 and 11
``disk_bytes_rate_high``  host<->disk bytes / second                      rule 11, incident C
``disk_ops_rate_high``    host<->disk transfers / second (IOPS)           rule 11, incident C
========================  ==============================================  ==================

Rule 12 (review the lengths of the requests that ran out of memory) is the histogram
``longctx_allocator_out_of_pages_request_tokens``. Incident B (ring communication) has no
counter here: neither the allocator nor the offload tiers see the ring's traffic.
"""

import dataclasses
import itertools
from typing import NamedTuple

from offload import OffloadSnapshot, OffloadStats
from offload._checks import check_float, check_int
from offload.monitoring._metric_families import METRIC_PREFIX
from paged import AllocatorStats

DIRECTIONS, TIERS = OffloadStats.DIRECTIONS, OffloadStats.TIERS

__all__ = ["Alert", "MetricsConfig", "MetricsReport", "MetricsSnapshot", "compute_metrics"]

_PREFIX = METRIC_PREFIX
_LINKS = {"host": ("device_to_host", "host_to_device"), "disk": ("host_to_disk", "disk_to_host")}


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """Alert thresholds and histogram buckets (validated on construction).

    A ``None`` limit disables its alert. Comparisons are strict: a value exactly at its
    threshold does not fire.

    Attributes:
      min_prefix_hit_rate: ``prefix_hit_rate_low`` fires under this rate (rule 9: 30%).
      min_tokens_admitted: the hit-rate alert needs at least this many admitted tokens (in
        the window when there is one), so an idle server does not page anyone.
      max_page_table_bytes: ``page_table_bytes_high`` fires when one request's page table is
        over this many bytes (rule 10: 1 MB, read as 1 MiB = 2**20).
      max_host_bytes_per_second: device<->host bytes/s limit (the host link, swap space).
      max_host_ops_per_second: device<->host transfers/s limit.
      max_disk_bytes_per_second: host<->disk bytes/s limit.
      max_disk_ops_per_second: host<->disk transfers/s limit (rule 11: 100k IOPS).
      out_of_pages_buckets: increasing upper bounds (tokens) of the out-of-pages histogram;
        ``+Inf`` is added.

    Raises:
      ValueError: on a rate outside ``[0, 1]``, a negative or non-number limit, or buckets
        that are empty, not positive ints, or not strictly increasing.
    """

    min_prefix_hit_rate: float = 0.30
    min_tokens_admitted: int = 1
    max_page_table_bytes: int | None = 2**20
    max_host_bytes_per_second: float | None = None
    max_host_ops_per_second: float | None = None
    max_disk_bytes_per_second: float | None = None
    max_disk_ops_per_second: float | None = 100_000.0
    out_of_pages_buckets: tuple[int, ...] = tuple(2**k for k in range(10, 21, 2))

    def __post_init__(self):
        fn = "MetricsConfig"
        check_float(fn, "min_prefix_hit_rate", self.min_prefix_hit_rate, low=0.0, high=1.0)
        check_int(fn, "min_tokens_admitted", self.min_tokens_admitted, low=0)
        if self.max_page_table_bytes is not None:
            check_int(fn, "max_page_table_bytes", self.max_page_table_bytes, low=0)
        for name in (
            "max_host_bytes_per_second",
            "max_host_ops_per_second",
            "max_disk_bytes_per_second",
            "max_disk_ops_per_second",
        ):
            if getattr(self, name) is not None:
                check_float(fn, name, getattr(self, name), low=0.0)
        buckets = self.out_of_pages_buckets
        if (
            not isinstance(buckets, tuple)
            or not buckets
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in buckets)
            or any(a >= b for a, b in itertools.pairwise(buckets))
        ):
            raise ValueError(
                f"{fn}: out_of_pages_buckets: expected a non-empty tuple of strictly increasing "
                f"positive ints, got {buckets!r}"
            )


@dataclasses.dataclass(frozen=True)
class Alert:
    """One alert that fired.

    Attributes:
      name: e.g. ``"prefix_hit_rate_low"`` (see the module docstring's table).
      value: the measured value.
      threshold: the configured limit it crossed.
      rule: the article's rule / incident it implements, e.g. ``"rule 9, incident A"``.
      message: a sentence for a human on call.
    """

    name: str
    value: float
    threshold: float
    rule: str
    message: str


class MetricsSnapshot(NamedTuple):
    """The inputs of one :func:`compute_metrics` call, kept to serve as the next ``previous``."""

    allocator: AllocatorStats | None
    offload: OffloadSnapshot | None


class MetricsReport(NamedTuple):
    """Result of :func:`compute_metrics`.

    Attributes:
      metrics: flat ``{sample key: value}``; keys are Prometheus sample names with labels.
      alerts: the alerts that fired, in the module table's order.
      snapshot: this call's inputs, to pass as ``previous`` next time.
    """

    metrics: dict[str, int | float]
    alerts: tuple[Alert, ...]
    snapshot: MetricsSnapshot


def _key(name: str, **labels: str) -> str:
    # Our own label values are identifiers (no quotes, backslashes or newlines to escape).
    if not labels:
        return _PREFIX + name
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{_PREFIX}{name}{{{inner}}}"


def _check_inputs(fn, allocator, offload, previous, elapsed_seconds, config):
    if allocator is not None and not isinstance(allocator, AllocatorStats):
        raise ValueError(
            f"{fn}: allocator: expected paged.AllocatorStats or None, got "
            f"{type(allocator).__name__}"
        )
    if isinstance(offload, OffloadStats):
        offload = offload.snapshot()
    if offload is not None and not isinstance(offload, OffloadSnapshot):
        raise ValueError(
            f"{fn}: offload: expected an OffloadSnapshot, OffloadStats or None, got "
            f"{type(offload).__name__}"
        )
    if previous is not None and not isinstance(previous, MetricsSnapshot):
        raise ValueError(
            f"{fn}: previous: expected a MetricsSnapshot or None, got {type(previous).__name__}"
        )
    if elapsed_seconds is not None:
        elapsed_seconds = check_float(
            fn, "elapsed_seconds", elapsed_seconds, low=0.0, low_open=True
        )
    if not isinstance(config, MetricsConfig):
        raise ValueError(f"{fn}: config: expected a MetricsConfig, got {type(config).__name__}")
    return offload, elapsed_seconds


def _allocator_metrics(fn, stats, before, config, out) -> tuple[float | None, int]:
    """Fills ``out``; returns (hit rate the alert looks at or None, admitted tokens behind it)."""
    out[_key("allocator_pages", state="used")] = stats.pages_used
    out[_key("allocator_pages", state="free")] = stats.pages_free
    out[_key("allocator_pages", state="cached")] = stats.pages_cached
    out[_key("allocator_pages", state="reserved")] = stats.pages_reserved
    out[_key("allocator_pages_shared")] = stats.pages_shared
    out[_key("allocator_sequences")] = stats.num_sequences
    out[_key("allocator_tokens", kind="stored")] = stats.tokens_stored
    out[_key("allocator_tokens", kind="logical")] = stats.tokens_logical
    out[_key("allocator_tokens", kind="uncommitted")] = stats.tokens_uncommitted
    out[_key("allocator_waste_ratio")] = stats.waste
    out[_key("allocator_prefix_tokens_admitted_total")] = stats.tokens_admitted
    out[_key("allocator_prefix_tokens_hit_total")] = stats.tokens_hit
    out[_key("allocator_prefix_hit_rate")] = stats.prefix_hit_rate
    admitted, hit = stats.tokens_admitted, stats.tokens_hit
    if before is not None:
        if stats.tokens_admitted < before.tokens_admitted or stats.tokens_hit < before.tokens_hit:
            raise ValueError(
                f"{fn}: previous: expected allocator counters not above the current ones (same "
                f"allocator, earlier), got tokens_admitted {before.tokens_admitted} > "
                f"{stats.tokens_admitted} or tokens_hit {before.tokens_hit} > {stats.tokens_hit}"
            )
        admitted -= before.tokens_admitted
        hit -= before.tokens_hit
        out[_key("allocator_prefix_hit_rate_window")] = hit / admitted if admitted else 0.0
    out[_key("allocator_evictions_total")] = stats.evictions
    out[_key("allocator_page_table_bytes")] = stats.page_table_bytes
    out[_key("allocator_page_table_bytes_per_request")] = (
        stats.page_table_bytes / stats.num_sequences if stats.num_sequences else 0.0
    )
    out[_key("allocator_page_table_bytes_max")] = stats.page_table_bytes_max
    out[_key("allocator_out_of_pages_total")] = stats.out_of_pages
    histogram = "allocator_out_of_pages_request_tokens"
    for bound in config.out_of_pages_buckets:
        count = sum(c for length, c in stats.out_of_pages_lengths if length <= bound)
        out[_key(f"{histogram}_bucket", le=_format_bound(bound))] = count
    out[_key(f"{histogram}_bucket", le="+Inf")] = stats.out_of_pages
    out[_key(f"{histogram}_sum")] = sum(length * c for length, c in stats.out_of_pages_lengths)
    out[_key(f"{histogram}_count")] = stats.out_of_pages
    return (hit / admitted if admitted else None), admitted


def _format_bound(bound: int) -> str:
    return repr(float(bound))


def _offload_metrics(fn, snap, before, elapsed, out) -> dict[str, tuple[float, float]]:
    """Fills ``out``; returns ``{link: (bytes/s, ops/s)}`` when there is a window, else ``{}``."""
    for tier in TIERS:
        out[_key("offload_tier_bytes", tier=tier)] = snap.tier_bytes[tier]
    out[_key("offload_requests")] = snap.num_requests
    for name, field in (
        ("offload_transfers_total", "count"),
        ("offload_transfer_bytes_total", "nbytes"),
        ("offload_transfer_seconds_total", "seconds"),
        ("offload_transfers_in_flight", "in_flight"),
        ("offload_transfer_bytes_in_flight", "in_flight_bytes"),
    ):
        for d in DIRECTIONS:
            out[_key(name, direction=d)] = getattr(snap.transfers[d], field)
    if elapsed is None:
        return {}
    deltas = {}
    for d in DIRECTIONS:
        now = snap.transfers[d]
        then = before.transfers[d] if before is not None else None
        count = now.count - (then.count if then else 0)
        nbytes = now.nbytes - (then.nbytes if then else 0)
        if count < 0 or nbytes < 0:
            raise ValueError(
                f"{fn}: previous: expected {d} counters not above the current ones (same "
                f"stats, earlier), got count {then.count} > {now.count} or bytes "
                f"{then.nbytes} > {now.nbytes}"
            )
        deltas[d] = (nbytes, count)
        out[_key("offload_transfer_bytes_per_second", direction=d)] = nbytes / elapsed
        out[_key("offload_transfer_ops_per_second", direction=d)] = count / elapsed
    rates = {}
    for link, directions in _LINKS.items():
        nbytes = sum(deltas[d][0] for d in directions)
        ops = sum(deltas[d][1] for d in directions)
        rates[link] = (nbytes / elapsed, ops / elapsed)
        out[_key("offload_link_bytes_per_second", link=link)] = rates[link][0]
        out[_key("offload_link_ops_per_second", link=link)] = rates[link][1]
    return rates


def compute_metrics(
    allocator: AllocatorStats | None = None,
    offload: OffloadSnapshot | OffloadStats | None = None,
    *,
    previous: MetricsSnapshot | None = None,
    elapsed_seconds: float | None = None,
    config: MetricsConfig | None = None,
) -> MetricsReport:
    """Flat metrics and fired alerts from allocator and offload counters (pure).

    Cumulative counters and current gauges need only the current stats. A *window* needs
    ``previous`` (an earlier :attr:`MetricsReport.snapshot` of the same allocator and stats)
    and/or ``elapsed_seconds`` (wall time since it): with ``previous`` the hit rate is taken
    over the window (``longctx_allocator_prefix_hit_rate_window``); with ``elapsed_seconds``
    transfer and link rates (bytes and transfers per second) are computed from the counters'
    differences, or from the counters themselves when ``previous`` is ``None`` (a window
    since the counters started). Rate alerts need ``elapsed_seconds``.

    Args:
      allocator: ``PageAllocator.stats()``, or ``None`` to skip allocator metrics.
      offload: ``OffloadStats`` (snapshotted here) or its ``snapshot()``, or ``None``.
      previous: the snapshot that opens the window.
      elapsed_seconds: wall seconds since ``previous`` (or since the counters started), > 0.
      config: thresholds and buckets (``MetricsConfig()`` when ``None``).

    Returns:
      A :class:`MetricsReport` (``metrics``, ``alerts``, ``snapshot``); every evaluated alert
      also appears as ``longctx_alert_firing{alert="<name>"}`` 0 or 1.

    Raises:
      ValueError: on inputs of the wrong type, ``elapsed_seconds <= 0``, or a ``previous``
        whose counters exceed the current ones (another allocator, or a reset).

    Example:
      >>> from paged import PageAllocator
      >>> alloc = PageAllocator(16, 4, max_pages_per_seq=4)
      >>> _ = alloc.admit("a", list(range(12))); alloc.commit("a")
      >>> _ = alloc.admit("b", list(range(8)) + [99] * 4)
      >>> report = compute_metrics(alloc.stats())
      >>> report.metrics["longctx_allocator_prefix_hit_rate"], [a.name for a in report.alerts]
      (0.3333333333333333, [])
    """
    fn = "compute_metrics"
    config = MetricsConfig() if config is None else config
    offload, elapsed_seconds = _check_inputs(
        fn, allocator, offload, previous, elapsed_seconds, config
    )
    metrics: dict[str, int | float] = {}
    checks: list[tuple[str, float, float | None, str, str, bool]] = []
    if allocator is not None:
        before = previous.allocator if previous is not None else None
        rate, admitted = _allocator_metrics(fn, allocator, before, config, metrics)
        if rate is not None and admitted >= config.min_tokens_admitted:
            window = "over the window" if before is not None else "since start"
            checks.append(
                (
                    "prefix_hit_rate_low",
                    rate,
                    config.min_prefix_hit_rate,
                    "rule 9, incident A",
                    f"prefix-cache hit rate {rate:.1%} {window} is under "
                    f"{config.min_prefix_hit_rate:.0%}: prompts are not sharing their "
                    "templates; look for high-cardinality spans (find_high_cardinality_spans)",
                    rate < config.min_prefix_hit_rate,
                )
            )
        if config.max_page_table_bytes is not None:
            value = allocator.page_table_bytes_max
            checks.append(
                (
                    "page_table_bytes_high",
                    value,
                    config.max_page_table_bytes,
                    "rule 10",
                    f"one request's page table holds {value} bytes, over "
                    f"{config.max_page_table_bytes}: the sequence is too long; rate-limit or "
                    "split it",
                    value > config.max_page_table_bytes,
                )
            )
    if offload is not None:
        before = previous.offload if previous is not None else None
        rates = _offload_metrics(fn, offload, before, elapsed_seconds, metrics)
        for link, (nbytes, ops) in rates.items():
            rule = "rules 6 and 11" if link == "host" else "rule 11, incident C"
            for kind, value in (("bytes", nbytes), ("ops", ops)):
                limit = getattr(config, f"max_{link}_{kind}_per_second")
                if limit is None:
                    continue
                unit = "bytes/s" if kind == "bytes" else "transfers/s"
                checks.append(
                    (
                        f"{link}_{kind}_rate_high",
                        value,
                        limit,
                        rule,
                        f"{link} link at {value:.6g} {unit}, over the limit {limit:.6g}: "
                        "offload I/O saturates; limit concurrency or keep latency-critical "
                        "requests off this tier",
                        value > limit,
                    )
                )
    alerts = []
    for name, value, threshold, rule, message, fired in checks:
        metrics[_key("alert_firing", alert=name)] = int(fired)
        if fired:
            alerts.append(Alert(name, float(value), float(threshold), rule, message))
    return MetricsReport(metrics, tuple(alerts), MetricsSnapshot(allocator, offload))
