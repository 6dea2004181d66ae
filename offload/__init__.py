"""KV offload tiers and retention policies over pages (docs: concepts/offload.md).

Shape legend (as in ``ringattn`` and ``paged``):

====  ==========================================
P     pages in a pool (``P_host`` for a host pool)
C     tokens per page
K     key/value heads
H     head dim
L     layers
n     pages moved by one call
====  ==========================================

Pools are ``k_pages, v_pages [L, K, P, C, H]`` (or ``[K, P, C, H]`` per layer); tiers are
device memory, pinned host memory and disk. Pages demoted to pinned host can stay readable
per step: their key bounds stay on the device and each decode step fetches only the host
pages its query selects (Quest-style; :mod:`offload.retrieval`, fed by
``select_keep(..., mode="retrieve")``). Quantized pools (``paged.QuantizedPages``, int8,
fp8, int4 or kivi2) move through every tier as they are stored: data and scale pages (kivi2:
and zero-point pages) together, bytes counted for all; a kivi2 pool's residual window (each
sequence's most recent pages) stays on the device.

Transfers take their source first, then their destination, and all return a
:class:`TransferHandle` whose ``value`` is what was written: ``to_host(tree)``,
``to_device(tree)``, ``page_out(k_pages, v_pages, page_ids, host_pool, host_slots)``,
``page_in(host_pool, host_slots, k_pages, v_pages, page_ids)``,
``prefetch_layer(host_pool, host_slots, layer=l)``. Transfers are eager (host-side
orchestration, not jittable); the policies, attention-mass helpers and
:func:`mixed_residency_attention` are pure and jittable with their options bound
(``jax.jit(functools.partial(select_keep, policy=policy))``).

Four public subpackages build on this core and are imported only when asked for
(``import offload`` imports none): :mod:`offload.retrieval` (query-aware retrieval from
pinned host), :mod:`offload.planning` (``plan`` and its cost model),
:mod:`offload.monitoring` (metrics, alerts, Prometheus text, prompt hygiene) and
:mod:`offload.serving` (set-up for serving). The core never
imports them; their former top-level names (``offload.plan``, ``offload.to_prometheus``,
``offload.retrieval_decode_attention``, ...) raise an ``AttributeError`` that names the new
location.

:mod:`offload.serving` holds ``enable_compilation_cache``: JAX's persistent compilation
cache in the user's cache directory (the examples' command lines, the notebooks and the
benchmarks call it).
"""

from offload._attention_mass import mass_kept_from_lse, token_attention_mass
from offload._disk import CorruptCacheError, DiskStore
from offload._host_pool import HostPagePool, make_host_page_pool
from offload._manager import OffloadManager
from offload._mixed import MixedAttention, mixed_residency_attention, split_residency
from offload._policies import (
    PolicyState,
    Selection,
    init_policy_state,
    select_keep,
    update_policy_state,
)
from offload._policy_reference import select_keep_reference, update_policy_state_reference
from offload._retention import POLICY_KINDS, RetentionPolicy, budget_units
from offload._shared_pages import keep_shared_pages
from offload._staging import make_staging_pool, staging_table
from offload._stats import (
    OffloadSnapshot,
    OffloadStats,
    TransferTotals,
    measure_bytes,
    page_nbytes,
)
from offload._tiers import TransferHandle, host_memory_kind, ready, to_device, to_host, wait
from offload._transfers import page_in, page_out, prefetch_layer

__all__: list[str] = [
    # retention policies
    "POLICY_KINDS",
    "PolicyState",
    "RetentionPolicy",
    "Selection",
    "budget_units",
    "init_policy_state",
    "keep_shared_pages",
    "select_keep",
    "select_keep_reference",
    "token_attention_mass",
    "update_policy_state",
    "update_policy_state_reference",
    # decode over mixed residency
    "MixedAttention",
    "mass_kept_from_lse",
    "make_staging_pool",
    "mixed_residency_attention",
    "split_residency",
    "staging_table",
    # tiers, host pool, disk, accounting
    "CorruptCacheError",
    "DiskStore",
    "HostPagePool",
    "OffloadManager",
    "OffloadSnapshot",
    "OffloadStats",
    "TransferHandle",
    "TransferTotals",
    "host_memory_kind",
    "make_host_page_pool",
    "measure_bytes",
    "page_in",
    "page_nbytes",
    "page_out",
    "prefetch_layer",
    "ready",
    "to_device",
    "to_host",
    "wait",
]

_PLANNING = (
    "ARTICLE",
    "ARTICLE_RULES",
    "ARTICLE_SECTIONS",
    "CostEstimate",
    "Decision",
    "Hardware",
    "KV_FORMATS",
    "LengthDistribution",
    "MEASURED",
    "ModelShape",
    "Plan",
    "PlanRow",
    "Reason",
    "Tiers",
    "TIE_THRESHOLD",
    "Workload",
    "plan",
)
_MONITORING = (
    "mass_kept_from_page_mass",
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
    "replay_hit_rate",
    "to_prometheus",
)
_RETRIEVAL = (
    "RetrievalDecode",
    "StagedPages",
    "fetch_selected_pages",
    "retrieval_decode_attention",
    "retrieval_decode_attention_jit",
    "with_host_bounds",
)
_MOVED = (
    {name: "planning" for name in _PLANNING}
    | {name: "monitoring" for name in _MONITORING}
    | {name: "retrieval" for name in _RETRIEVAL}
)


def __getattr__(name: str):
    """Names that moved to a subpackage fail with their new location (nothing is imported)."""
    if name in ("TIERS", "DIRECTIONS"):
        raise AttributeError(
            f"offload.{name} moved to offload.OffloadStats.{name} (the names OffloadStats "
            "accepts; see the migration table in CHANGELOG.md)"
        )
    if name in _MOVED:
        sub = _MOVED[name]
        raise AttributeError(
            f"offload.{name} moved to offload.{sub}.{name}: "
            f"use `from offload.{sub} import {name}` (see the migration table in CHANGELOG.md)"
        )
    if name in ("planning", "monitoring", "retrieval", "serving"):
        raise AttributeError(
            f"offload.{name} is a subpackage that `import offload` does not import: "
            f"use `import offload.{name}` or `from offload.{name} import ...`"
        )
    raise AttributeError(f"module 'offload' has no attribute {name!r}")
