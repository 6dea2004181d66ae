"""The metric families of the monitoring exports: names, Prometheus types and help texts.

One table shared by :func:`offload.monitoring.compute_metrics` (which emits these names) and
:func:`offload.monitoring.to_prometheus` (which prints their ``# HELP`` and ``# TYPE`` lines). Every name
starts with ``longctx_``.
"""

import types

__all__ = ["METRIC_FAMILIES", "METRIC_PREFIX"]

METRIC_PREFIX = "longctx_"
_PREFIX = METRIC_PREFIX

METRIC_FAMILIES = types.MappingProxyType(
    {
        f"{_PREFIX}allocator_pages": (
            "gauge",
            "Usable pages by state (used, free, cached, reserved).",
        ),
        f"{_PREFIX}allocator_pages_shared": ("gauge", "Pages referenced more than once."),
        f"{_PREFIX}allocator_sequences": ("gauge", "Live sequences."),
        f"{_PREFIX}allocator_tokens": ("gauge", "Tokens: stored (physical), logical, uncommitted."),
        f"{_PREFIX}allocator_waste_ratio": ("gauge", "Unfilled slots over allocated slots."),
        f"{_PREFIX}allocator_prefix_tokens_admitted_total": ("counter", "Prompt tokens admitted."),
        f"{_PREFIX}allocator_prefix_tokens_hit_total": (
            "counter",
            "Admitted prompt tokens served from the prefix cache.",
        ),
        f"{_PREFIX}allocator_prefix_hit_rate": (
            "gauge",
            "Prefix-cache hit rate since the allocator started.",
        ),
        f"{_PREFIX}allocator_prefix_hit_rate_window": (
            "gauge",
            "Prefix-cache hit rate over the last window (rule 9).",
        ),
        f"{_PREFIX}allocator_evictions_total": ("counter", "Cached pages evicted."),
        f"{_PREFIX}allocator_page_table_bytes": (
            "gauge",
            "Page-table bytes the live sequences need.",
        ),
        f"{_PREFIX}allocator_page_table_bytes_per_request": (
            "gauge",
            "Mean page-table bytes per live sequence.",
        ),
        f"{_PREFIX}allocator_page_table_bytes_max": (
            "gauge",
            "Page-table bytes of the longest live sequence (rule 10).",
        ),
        f"{_PREFIX}allocator_out_of_pages_total": (
            "counter",
            "Requests that raised OutOfPages.",
        ),
        f"{_PREFIX}allocator_out_of_pages_request_tokens": (
            "histogram",
            "Sequence lengths (tokens) of the requests that raised OutOfPages (rule 12).",
        ),
        f"{_PREFIX}offload_tier_bytes": ("gauge", "Bytes resident per tier."),
        f"{_PREFIX}offload_requests": ("gauge", "Requests with bytes in some tier."),
        f"{_PREFIX}offload_transfers_total": ("counter", "Completed transfers per direction."),
        f"{_PREFIX}offload_transfer_bytes_total": ("counter", "Bytes of completed transfers."),
        f"{_PREFIX}offload_transfer_seconds_total": (
            "counter",
            "Summed issue-to-completion seconds of completed transfers.",
        ),
        f"{_PREFIX}offload_transfers_in_flight": ("gauge", "Transfers issued, not yet complete."),
        f"{_PREFIX}offload_transfer_bytes_in_flight": ("gauge", "Bytes of transfers in flight."),
        f"{_PREFIX}offload_transfer_bytes_per_second": (
            "gauge",
            "Bytes per wall-clock second over the window, per direction.",
        ),
        f"{_PREFIX}offload_transfer_ops_per_second": (
            "gauge",
            "Transfers per wall-clock second over the window, per direction.",
        ),
        f"{_PREFIX}offload_link_bytes_per_second": (
            "gauge",
            "Bytes per second over the window per link (host: device<->host, disk: host<->disk).",
        ),
        f"{_PREFIX}offload_link_ops_per_second": (
            "gauge",
            "Transfers per second over the window per link (rule 11).",
        ),
        f"{_PREFIX}alert_firing": ("gauge", "1 when the alert fires, 0 when evaluated and quiet."),
    }
)
"""Every metric family :func:`compute_metrics` emits: name -> (Prometheus type, help text)."""
