"""Monitoring the page allocator and the offload tiers: metrics, alerts, Prometheus text, and
prompt hygiene for prefix caching.

``offload.monitoring`` is a public subpackage of ``offload`` (as ``optax.contrib`` is of
``optax``): ``import offload`` does not import it; ``import offload.monitoring`` does.
:func:`compute_metrics` turns a ``paged.AllocatorStats`` and an ``offload.OffloadSnapshot``
(``offload.OffloadStats.snapshot()``) into a flat ``{sample: value}`` dict and the
:class:`Alert` s that fire under a :class:`MetricsConfig`; :class:`Monitor` polls them over
time; :func:`to_prometheus` prints the dict as a Prometheus scrape page (families in
:data:`METRIC_FAMILIES`, served as :data:`PROMETHEUS_CONTENT_TYPE`).
:func:`find_high_cardinality_spans` finds the prompt spans that defeat prefix sharing and
:func:`replay_hit_rate` replays prompts through a fresh ``paged.PageAllocator``.
:func:`mass_kept_from_page_mass` estimates the share of the attention mass that retention
kept from an observed page mass (the exact share is ``offload.mass_kept_from_lse``).

Shape legend (as in ``ringattn``, ``paged`` and ``offload``):

====  ==========================================
B     prompts in a batch
T     tokens of one prompt
P     pages in a pool
C     tokens per page (``page_size``)
====  ==========================================
"""

from offload.monitoring._mass_kept import mass_kept_from_page_mass
from offload.monitoring._metric_families import METRIC_FAMILIES
from offload.monitoring._monitor import Monitor
from offload.monitoring._monitoring import (
    Alert,
    MetricsConfig,
    MetricsReport,
    MetricsSnapshot,
    compute_metrics,
)
from offload.monitoring._prometheus import (
    PROMETHEUS_CONTENT_TYPE,
    escape_label_value,
    to_prometheus,
)
from offload.monitoring._prompt_hygiene import (
    PromptHygiene,
    PromptSpan,
    find_high_cardinality_spans,
    replay_hit_rate,
)

__all__: list[str] = [
    "METRIC_FAMILIES",
    "PROMETHEUS_CONTENT_TYPE",
    "Alert",
    "MetricsConfig",
    "MetricsReport",
    "MetricsSnapshot",
    "Monitor",
    "PromptHygiene",
    "PromptSpan",
    "compute_metrics",
    "escape_label_value",
    "find_high_cardinality_spans",
    "mass_kept_from_page_mass",
    "replay_hit_rate",
    "to_prometheus",
]
