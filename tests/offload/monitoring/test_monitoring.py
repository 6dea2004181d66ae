"""Monitoring: metrics and alerts from allocator / offload counters, Prometheus text, hygiene.

The Prometheus page is read back by a strict parser written here (independent of the module's
own key parsing); metric values are checked against numbers worked out by hand from a scripted
allocator / offload session; the hygiene scenario's hit rates come from the real allocator and
are checked against the closed form of that replay.
"""

import dataclasses
import itertools
import math
import re
import sys
import threading

import numpy as np
import pytest

from offload import OffloadSnapshot, OffloadStats, TransferTotals
from offload.monitoring import (
    METRIC_FAMILIES,
    PROMETHEUS_CONTENT_TYPE,
    Alert,
    MetricsConfig,
    MetricsSnapshot,
    Monitor,
    PromptSpan,
    compute_metrics,
    escape_label_value,
    find_high_cardinality_spans,
    replay_hit_rate,
    to_prometheus,
)
from paged import OutOfPages, PageAllocator

# ------------------------------------------------------------------ a strict 0.0.4 parser

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


def _parse_labels(text: str, line: str) -> dict[str, str]:
    """Character by character: name="value" pairs, escapes \\\\ \\" \\n only."""
    labels: dict[str, str] = {}
    i = 0
    while i < len(text):
        match = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*").match(text, i)
        assert match, f"bad label name in {line!r}"
        name = match.group(0)
        i = match.end()
        assert text[i : i + 2] == '="', f'expected =" after {name} in {line!r}'
        i += 2
        value = []
        while True:
            assert i < len(text), f"unterminated label value in {line!r}"
            char = text[i]
            if char == "\\":
                nxt = text[i + 1]
                assert nxt in '\\"n', f"bad escape \\{nxt} in {line!r}"
                value.append({"\\": "\\", '"': '"', "n": "\n"}[nxt])
                i += 2
            elif char == '"':
                i += 1
                break
            else:
                assert char != "\n", f"raw newline in {line!r}"
                value.append(char)
                i += 1
        assert name not in labels, f"repeated label {name} in {line!r}"
        labels[name] = "".join(value)
        if i < len(text):
            assert text[i] == ",", f"expected , in {line!r}"
            i += 1
    return labels


def _parse_value(text: str) -> float:
    if text in ("+Inf", "-Inf", "NaN"):
        return {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}[text]
    assert re.fullmatch(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?", text), f"bad value {text!r}"
    return float(text)


def parse_prometheus(page: str) -> dict[str, dict]:
    """``{family: {"type", "help", "samples": [(name, labels, value)]}}``; asserts the format."""
    assert page == "" or page.endswith("\n")
    families: dict[str, dict] = {}
    current = None
    for line in page.splitlines():
        assert line, "blank line"
        if line.startswith("# HELP "):
            name, _, text = line[7:].partition(" ")
            assert re.fullmatch(_NAME, name), line
            assert name not in families or "help" not in families[name], f"second HELP {name}"
            assert "\n" not in text and not re.search(r"\\[^\\n]", text.replace("\\\\", ""))
            families.setdefault(name, {"samples": []})["help"] = text
            current = name
            continue
        if line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert kind in _TYPES, line
            assert re.fullmatch(_NAME, name), line
            family = families.setdefault(name, {"samples": []})
            assert "type" not in family and not family["samples"], f"TYPE after samples: {name}"
            family["type"] = kind
            current = name
            continue
        assert not line.startswith("#"), line
        match = re.fullmatch(rf"({_NAME})(?:\{{(.*)\}})? (\S+)", line)
        assert match, f"bad sample line {line!r}"
        name, body, value = match.groups()
        assert current is not None, f"sample before any TYPE: {line!r}"
        kind = families[current]["type"]
        allowed = {current}
        if kind == "histogram":
            allowed = {current + s for s in ("_bucket", "_sum", "_count")}
        assert name in allowed, f"{name} is not a sample of family {current} ({kind})"
        families[current]["samples"].append(
            (name, _parse_labels(body or "", line), _parse_value(value))
        )
    for name, family in families.items():
        assert "type" in family and family["samples"], f"family {name} without TYPE or samples"
        if family["type"] == "histogram":
            _check_histogram(name, family["samples"])
    return families


def _check_histogram(name, samples):
    groups: dict[tuple, dict] = {}
    for sample, labels, value in samples:
        rest = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        group = groups.setdefault(rest, {"le": [], "sum": None, "count": None})
        if sample.endswith("_bucket"):
            assert not group["sum"] and not group["count"], "bucket after _sum / _count"
            group["le"].append((_parse_value(labels["le"]), value))
        elif sample.endswith("_sum"):
            group["sum"] = value
        else:
            group["count"] = value
    for group in groups.values():
        bounds = [b for b, _ in group["le"]]
        counts = [c for _, c in group["le"]]
        assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds), bounds
        assert bounds[-1] == math.inf, "histogram without +Inf"
        assert all(a <= b for a, b in itertools.pairwise(counts)), counts
        assert group["count"] == counts[-1] and group["sum"] is not None


def samples_of(families) -> dict[tuple, float]:
    return {
        (name, tuple(sorted(labels.items()))): value
        for family in families.values()
        for name, labels, value in family["samples"]
    }


def key_to_tuple(key: str) -> tuple:
    name, _, rest = key.partition("{")
    labels = _parse_labels(rest[:-1], key) if rest else {}
    return name, tuple(sorted(labels.items()))


# ------------------------------------------------------------------ a scripted session


def scripted_allocator() -> PageAllocator:
    """8 usable pages of 4 tokens, M = 4; worked out by hand in ``test_metrics_by_hand``."""
    alloc = PageAllocator(9, 4, max_pages_per_seq=4)
    alloc.admit("a", list(range(10)))  # pages 1 2 3, no hit
    alloc.commit("a")
    alloc.admit("b", [*range(8), 50, 51])  # shares pages 1 2 (8 tokens hit), new page 4
    alloc.allocate("c", 16)  # pages 5-8: the pool is full
    for call in (
        lambda: alloc.allocate("d", 5),
        lambda: alloc.extend("b", 13),
        lambda: alloc.admit("e", [1, 2, 3]),
        lambda: alloc.reserve(1),  # not a request: not in the histogram
    ):
        with pytest.raises(OutOfPages):
            call()
    return alloc


def scripted_offload(stats: OffloadStats, scale: int = 1) -> None:
    for _ in range(2 * scale):
        stats.record_transfer("device_to_host", 1000, 0.5, request_id="r1")
    for _ in range(3 * scale):
        stats.record_transfer("host_to_disk", 4096, 0.25, request_id="r2")
    stats.record_issue("disk_to_host", 512)
    stats.add_tier_bytes("host", 2000 * scale, request_id="r1")
    stats.add_tier_bytes("disk", 12288 * scale, request_id="r2")


CONFIG = MetricsConfig(out_of_pages_buckets=(4, 8, 16))


def test_metrics_by_hand():
    stats = OffloadStats()
    scripted_offload(stats)
    report = compute_metrics(scripted_allocator().stats(), stats, config=CONFIG)
    m = report.metrics
    expected = {
        'longctx_allocator_pages{state="used"}': 8,
        'longctx_allocator_pages{state="free"}': 0,
        'longctx_allocator_pages{state="cached"}': 0,
        'longctx_allocator_pages{state="reserved"}': 0,
        "longctx_allocator_pages_shared": 2,  # pages 1 and 2, held by a and b
        "longctx_allocator_sequences": 3,
        # a: 4 + 4 + 2, b's own page: 2, c: 16 (shared pages counted once)
        'longctx_allocator_tokens{kind="stored"}': 28,
        'longctx_allocator_tokens{kind="logical"}': 36,
        # never committed: b's 2 tokens after its 8 cached ones, all of c
        'longctx_allocator_tokens{kind="uncommitted"}': 2 + 16,
        "longctx_allocator_waste_ratio": (32 - 28) / 32,
        "longctx_allocator_prefix_tokens_admitted_total": 20,
        "longctx_allocator_prefix_tokens_hit_total": 8,
        "longctx_allocator_prefix_hit_rate": 0.4,
        "longctx_allocator_evictions_total": 0,
        "longctx_allocator_page_table_bytes": (3 + 3 + 4) * 4,
        "longctx_allocator_page_table_bytes_per_request": 40 / 3,
        "longctx_allocator_page_table_bytes_max": 16,
        "longctx_allocator_out_of_pages_total": 3,
        # failed lengths 5 (allocate), 13 (extend), 3 (admit); buckets 4, 8, 16
        'longctx_allocator_out_of_pages_request_tokens_bucket{le="4.0"}': 1,
        'longctx_allocator_out_of_pages_request_tokens_bucket{le="8.0"}': 2,
        'longctx_allocator_out_of_pages_request_tokens_bucket{le="16.0"}': 3,
        'longctx_allocator_out_of_pages_request_tokens_bucket{le="+Inf"}': 3,
        "longctx_allocator_out_of_pages_request_tokens_sum": 21,
        "longctx_allocator_out_of_pages_request_tokens_count": 3,
        'longctx_offload_tier_bytes{tier="device"}': 0,
        'longctx_offload_tier_bytes{tier="host"}': 2000,
        'longctx_offload_tier_bytes{tier="disk"}': 12288,
        "longctx_offload_requests": 2,
        'longctx_offload_transfers_total{direction="device_to_host"}': 2,
        'longctx_offload_transfers_total{direction="host_to_disk"}': 3,
        'longctx_offload_transfers_total{direction="disk_to_host"}': 0,
        'longctx_offload_transfer_bytes_total{direction="device_to_host"}': 2000,
        'longctx_offload_transfer_bytes_total{direction="host_to_disk"}': 3 * 4096,
        'longctx_offload_transfer_seconds_total{direction="device_to_host"}': 1.0,
        'longctx_offload_transfer_seconds_total{direction="host_to_disk"}': 0.75,
        'longctx_offload_transfers_in_flight{direction="disk_to_host"}': 1,
        'longctx_offload_transfer_bytes_in_flight{direction="disk_to_host"}': 512,
        # hit rate 0.4 over 20 tokens is not under 0.30; 16 bytes is not over 1 MiB
        'longctx_alert_firing{alert="prefix_hit_rate_low"}': 0,
        'longctx_alert_firing{alert="page_table_bytes_high"}': 0,
    }
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-12, abs=0), key
    # no window: no rates, no window hit rate, no rate alerts
    assert not any("per_second" in k or "window" in k or "rate_high" in k for k in m)
    assert report.alerts == ()
    assert report.snapshot.allocator == scripted_allocator().stats()
    assert isinstance(report.snapshot.offload, OffloadSnapshot)
    # every key belongs to a documented family
    for key in m:
        name = key.partition("{")[0]
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in METRIC_FAMILIES or METRIC_FAMILIES[base][0] == "histogram", key


def test_rates_over_a_window_and_since_start():
    stats = OffloadStats()
    scripted_offload(stats)
    first = compute_metrics(None, stats)
    scripted_offload(stats, scale=2)  # +4 device_to_host (4000 B), +6 host_to_disk (24576 B)
    report = compute_metrics(None, stats, previous=first.snapshot, elapsed_seconds=2.0)
    m = report.metrics
    assert m['longctx_offload_transfer_bytes_per_second{direction="device_to_host"}'] == 2000.0
    assert m['longctx_offload_transfer_ops_per_second{direction="device_to_host"}'] == 2.0
    assert m['longctx_offload_transfer_ops_per_second{direction="host_to_disk"}'] == 3.0
    assert m['longctx_offload_link_bytes_per_second{link="host"}'] == 2000.0
    assert m['longctx_offload_link_bytes_per_second{link="disk"}'] == 24576 / 2
    assert m['longctx_offload_link_ops_per_second{link="disk"}'] == 3.0
    since_start = compute_metrics(None, stats, elapsed_seconds=4.0).metrics
    assert since_start['longctx_offload_link_ops_per_second{link="disk"}'] == 9 / 4
    assert since_start['longctx_offload_link_bytes_per_second{link="host"}'] == 6000 / 4


def _stats(**changes):
    """Allocator stats with some counters set (the hit rate kept consistent with them)."""
    stats = dataclasses.replace(PageAllocator(4, 4, max_pages_per_seq=2).stats(), **changes)
    admitted, hit = stats.tokens_admitted, stats.tokens_hit
    return dataclasses.replace(stats, prefix_hit_rate=hit / admitted if admitted else 0.0)


@pytest.mark.parametrize(
    ("hit", "fires"), [(299, True), (300, False), (301, False), (0, True), (1000, False)]
)
def test_prefix_hit_rate_alert_at_and_around_30_percent(hit, fires):
    report = compute_metrics(_stats(tokens_admitted=1000, tokens_hit=hit))
    names = [a.name for a in report.alerts]
    assert names == (["prefix_hit_rate_low"] if fires else [])
    assert report.metrics['longctx_alert_firing{alert="prefix_hit_rate_low"}'] == int(fires)
    if fires:
        (alert,) = report.alerts
        assert alert == Alert(
            "prefix_hit_rate_low", hit / 1000, 0.30, "rule 9, incident A", alert.message
        )
        assert "under 30%" in alert.message


def test_prefix_hit_rate_alert_needs_admitted_tokens_and_uses_the_window():
    assert compute_metrics(_stats()).alerts == ()  # nothing admitted: rate 0 does not alert
    assert (
        'longctx_alert_firing{alert="prefix_hit_rate_low"}' not in compute_metrics(_stats()).metrics
    )
    quiet = MetricsConfig(min_tokens_admitted=101)
    assert compute_metrics(_stats(tokens_admitted=100, tokens_hit=0), config=quiet).alerts == ()
    # cumulative 1000 / 2000 = 50%, but the last window only 100 / 1000 = 10%
    before = MetricsSnapshot(_stats(tokens_admitted=1000, tokens_hit=900), None)
    now = _stats(tokens_admitted=2000, tokens_hit=1000)
    report = compute_metrics(now, previous=before)
    assert report.metrics["longctx_allocator_prefix_hit_rate"] == 0.5
    assert report.metrics["longctx_allocator_prefix_hit_rate_window"] == 0.1
    assert [a.value for a in report.alerts] == [0.1]
    assert compute_metrics(now, previous=MetricsSnapshot(now, None)).alerts == ()  # empty window


@pytest.mark.parametrize(
    ("nbytes", "fires"), [(2**20 - 4, False), (2**20, False), (2**20 + 4, True)]
)
def test_page_table_bytes_alert_at_and_around_1_mib(nbytes, fires):
    report = compute_metrics(_stats(page_table_bytes_max=nbytes))
    assert [(a.name, a.value, a.threshold, a.rule) for a in report.alerts] == (
        [("page_table_bytes_high", nbytes, 2**20, "rule 10")] if fires else []
    )
    off = compute_metrics(
        _stats(page_table_bytes_max=nbytes), config=MetricsConfig(max_page_table_bytes=None)
    )
    assert off.alerts == () and not any("page_table_bytes_high" in k for k in off.metrics)


def _window(direction, count, nbytes):
    """Two snapshots ``count`` transfers and ``nbytes`` bytes apart in ``direction``."""
    zero = OffloadStats().snapshot()
    totals = dict(zero.transfers)
    totals[direction] = TransferTotals(count=count, nbytes=nbytes)
    return zero, OffloadSnapshot(totals, zero.tier_bytes, 0)


@pytest.mark.parametrize(
    ("link", "direction", "kind", "limit", "rule"),
    [
        ("disk", "host_to_disk", "ops", 100_000.0, "rule 11, incident C"),
        ("disk", "disk_to_host", "bytes", 5e9, "rule 11, incident C"),
        ("host", "device_to_host", "ops", 50.0, "rules 6 and 11"),
        ("host", "host_to_device", "bytes", 2e10, "rules 6 and 11"),
    ],
)
@pytest.mark.parametrize("over", [-1, 0, 1])
def test_transfer_rate_alerts_at_and_around_their_limits(link, direction, kind, limit, rule, over):
    elapsed = 2.0
    if kind == "ops":
        count, nbytes = int(limit * elapsed) + over, 0
    else:
        count, nbytes = 1, int(limit * elapsed) + over
    before, after = _window(direction, count, nbytes)
    config = MetricsConfig(**{f"max_{link}_{kind}_per_second": limit})
    report = compute_metrics(
        None,
        after,
        previous=MetricsSnapshot(None, before),
        elapsed_seconds=elapsed,
        config=config,
    )
    value = (count if kind == "ops" else nbytes) / elapsed
    name = f"{link}_{kind}_rate_high"
    fired = [a for a in report.alerts if a.name == name]
    assert bool(fired) == (over > 0)
    assert report.metrics[f'longctx_alert_firing{{alert="{name}"}}'] == int(over > 0)
    if fired:
        assert (fired[0].value, fired[0].threshold, fired[0].rule) == (value, limit, rule)
    assert [a for a in report.alerts if a.name != name] == []


def test_rate_alerts_off_by_default_except_disk_iops_and_need_a_window():
    before, after = _window("device_to_host", 10**6, 10**12)
    report = compute_metrics(
        None, after, previous=MetricsSnapshot(None, before), elapsed_seconds=1.0
    )
    assert report.alerts == ()  # host limits are None by default
    assert [k for k in report.metrics if k.startswith("longctx_alert")] == [
        'longctx_alert_firing{alert="disk_ops_rate_high"}'
    ]
    assert compute_metrics(None, after).alerts == ()  # no elapsed time: no rates


@pytest.mark.no_typecheck
def test_compute_metrics_errors():
    stats = _stats()
    with pytest.raises(ValueError, match=r"compute_metrics: allocator: expected paged.Allocator"):
        compute_metrics({"pages": 1})
    with pytest.raises(ValueError, match=r"compute_metrics: offload: expected an OffloadSnapshot"):
        compute_metrics(None, {"tiers": {}})
    with pytest.raises(ValueError, match=r"compute_metrics: previous: expected a MetricsSnapshot"):
        compute_metrics(stats, previous=stats)
    for bad in (0.0, -1.0, math.nan, True):
        with pytest.raises(ValueError, match=r"compute_metrics: elapsed_seconds"):
            compute_metrics(stats, elapsed_seconds=bad)
    with pytest.raises(ValueError, match=r"compute_metrics: config: expected a MetricsConfig"):
        compute_metrics(stats, config={"min_prefix_hit_rate": 0.3})
    later = _stats(tokens_admitted=10)
    with pytest.raises(ValueError, match=r"compute_metrics: previous: expected allocator"):
        compute_metrics(stats, previous=MetricsSnapshot(later, None))
    before, after = _window("host_to_disk", 3, 10)
    with pytest.raises(ValueError, match=r"compute_metrics: previous: expected host_to_disk"):
        compute_metrics(None, before, previous=MetricsSnapshot(None, after), elapsed_seconds=1.0)


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"min_prefix_hit_rate": 1.5}, "min_prefix_hit_rate"),
        ({"min_prefix_hit_rate": True}, "min_prefix_hit_rate"),
        ({"min_tokens_admitted": -1}, "min_tokens_admitted"),
        ({"max_page_table_bytes": 1.0}, "max_page_table_bytes"),
        ({"max_disk_ops_per_second": -1.0}, "max_disk_ops_per_second"),
        ({"max_host_bytes_per_second": math.inf}, "max_host_bytes_per_second"),
        ({"out_of_pages_buckets": ()}, "out_of_pages_buckets"),
        ({"out_of_pages_buckets": (4, 4)}, "out_of_pages_buckets"),
        ({"out_of_pages_buckets": (8, 4)}, "out_of_pages_buckets"),
        ({"out_of_pages_buckets": [4, 8]}, "out_of_pages_buckets"),
        ({"out_of_pages_buckets": (0, 4)}, "out_of_pages_buckets"),
    ],
)
def test_config_errors(changes, match):
    with pytest.raises(ValueError, match=rf"MetricsConfig: {match}: expected"):
        MetricsConfig(**changes)


# ------------------------------------------------------------------ Prometheus text


def test_prometheus_page_parses_back_strictly_with_every_value():
    stats = OffloadStats()
    scripted_offload(stats)
    first = compute_metrics(scripted_allocator().stats(), stats, config=CONFIG)
    scripted_offload(stats)
    report = compute_metrics(
        scripted_allocator().stats(),
        stats,
        previous=first.snapshot,
        elapsed_seconds=0.5,
        config=CONFIG,
    )
    page = to_prometheus(report.metrics)
    families = parse_prometheus(page)
    assert all(name.startswith("longctx_") for name in families)
    for name, family in families.items():
        kind, text = METRIC_FAMILIES[name]
        assert family["type"] == kind and family["help"] == text
    assert families["longctx_allocator_evictions_total"]["type"] == "counter"
    assert families["longctx_allocator_out_of_pages_request_tokens"]["type"] == "histogram"
    got = samples_of(families)
    want = {key_to_tuple(k): float(v) for k, v in report.metrics.items()}
    assert got == want
    # bucket order in the page is increasing le, +Inf last, then _sum and _count
    hist = families["longctx_allocator_out_of_pages_request_tokens"]["samples"]
    assert [s[1].get("le") for s in hist] == ["4.0", "8.0", "16.0", "+Inf", None, None]
    assert [s[0].rsplit("_", 1)[1] for s in hist[-2:]] == ["sum", "count"]
    assert PROMETHEUS_CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_prometheus_escapes_labels_and_help_and_formats_values():
    tricky = 'a "quoted" \\ back\nslash'
    assert escape_label_value(tricky) == 'a \\"quoted\\" \\\\ back\\nslash'
    metrics = {
        "longctx_allocator_sequences": 3,
        f'custom_metric{{path="{escape_label_value(tricky)}",x="1"}}': 0.25,
        "custom_nan": math.nan,
        "custom_inf": -math.inf,
        "custom_numpy": np.int64(7),
    }
    page = to_prometheus(metrics, labels={"instance": 'gpu "0"\n'})
    families = parse_prometheus(page)
    assert (
        families["custom_metric"]["type"] == "untyped" and "help" not in families["custom_metric"]
    )
    ((_, labels, value),) = families["custom_metric"]["samples"]
    assert labels == {"instance": 'gpu "0"\n', "path": tricky, "x": "1"} and value == 0.25
    assert math.isnan(families["custom_nan"]["samples"][0][2])
    assert families["custom_inf"]["samples"][0][2] == -math.inf
    assert 'longctx_allocator_sequences{instance="gpu \\"0\\"\\n"} 3\n' in page
    assert "custom_numpy{" in page and page.endswith(" 7\n")
    assert to_prometheus({}) == ""


def test_prometheus_histogram_labels_in_any_order_are_one_series():
    """Buckets, _sum and _count of one labelled histogram, their labels in different orders,
    print as one series group (each sample once, buckets in le order, then _sum, _count)."""
    name = "longctx_allocator_out_of_pages_request_tokens"
    metrics = {
        f'{name}_bucket{{le="+Inf",a="1",b="2"}}': 3,
        f'{name}_sum{{b="2",a="1"}}': 7.5,
        f'{name}_bucket{{b="2", le="4.0", a="1"}}': 1,
        f'{name}_count{{ a="1",b="2" }}': 3,
    }
    page = to_prometheus(metrics)
    samples = parse_prometheus(page)[name]["samples"]
    assert [(s[0].rsplit("_", 1)[1], s[1].get("le"), s[2]) for s in samples] == [
        ("bucket", "4.0", 1.0),
        ("bucket", "+Inf", 3.0),
        ("sum", None, 7.5),
        ("count", None, 3.0),
    ]
    assert all(
        {k: v for k, v in s[1].items() if k != "le"} == {"a": "1", "b": "2"} for s in samples
    )


def _hist(buckets, total, total_sum=1.0):
    name = "longctx_allocator_out_of_pages_request_tokens"
    out = {f'{name}_bucket{{le="{le}"}}': c for le, c in buckets}
    if total is not None:
        out[f"{name}_count"] = total
    out[f"{name}_sum"] = total_sum
    return out


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    ("metrics", "labels", "match"),
    [
        ({"bad name": 1}, None, "expected a key like"),
        ({'x{a="b"': 1}, None, "expected a key like"),
        ({"x{a=b}": 1}, None, "well-formed labels"),
        ({'x{a="b" c="d"}': 1}, None, "well-formed labels"),
        ({'x{a="\\q"}': 1}, None, "unknown escape"),
        ({'x{a="1",a="2"}': 1}, None, "distinct label names"),
        ({'x{__a="1"}': 1}, None, "reserved"),
        ({"x": True}, None, "expected a number"),
        ({"x": "1"}, None, "expected a number"),
        ({1: 1.0}, None, "expected str sample keys"),
        ({"x": 1}, {"1bad": "v"}, "labels: expected label names"),
        ({"x": 1}, {"__x": "v"}, "labels: expected label names"),
        ({"x": 1}, {"a": 1}, "labels: expected str values"),
        ({'x{a="1"}': 1}, {"a": "2"}, "already a label"),
        (_hist([("1.0", 2), ("+Inf", 1)], 1), None, "cumulative"),
        (_hist([("1.0", 1)], 1), None, r'ending with le="\+Inf"'),
        (_hist([("1.0", 1), ("+Inf", 2)], 3), None, "_count == the"),
        (_hist([("+Inf", 2)], None), None, "expected _sum and _count"),
        (_hist([("x", 2), ("+Inf", 2)], 2), None, "number or \\+Inf as le"),
        # One series written twice: label order, spaces, a constant label, a histogram part.
        ({'x{a="1",b="2"}': 1, 'x{b="2",a="1"}': 2}, None, "one key per series"),
        ({'x{a="1"}': 1, 'x{ a = "1" }': 2}, None, "one key per series"),
        ({'x{a="1",b="2"}': 1, 'x{b="2",a="1"}': 2}, {"c": "3"}, "one key per series"),
        ({"x": 1, "x{}": 2}, None, "one key per series"),
        (
            {**_hist([("+Inf", 1)], 1), "longctx_allocator_out_of_pages_request_tokens_sum{}": 2},
            None,
            "one key per series",
        ),
    ],
)
def test_prometheus_errors(metrics, labels, match):
    with pytest.raises(ValueError, match=rf"to_prometheus: .*{match}"):
        to_prometheus(metrics, labels=labels)
    with pytest.raises(ValueError, match="to_prometheus: metrics: expected a mapping"):
        to_prometheus([("x", 1)])


# ------------------------------------------------------------------ Monitor


def test_monitor_windows_between_polls():
    ticks = iter([10.0, 12.0, 12.0, 16.0])
    alloc = PageAllocator(16, 4, max_pages_per_seq=4)
    stats = OffloadStats()
    stats.record_transfer("host_to_disk", 100, 0.1)  # before the monitor: not in its windows
    monitor = Monitor(alloc, stats, clock=lambda: next(ticks))
    stats.record_transfer("host_to_disk", 300, 0.1)
    alloc.admit("a", list(range(8)))
    first = monitor.poll()  # 2 s
    assert first.metrics['longctx_offload_link_bytes_per_second{link="disk"}'] == 150.0
    assert first.metrics["longctx_allocator_prefix_hit_rate_window"] == 0.0
    second = monitor.poll()  # the clock did not move: no rates
    assert not any("per_second" in k for k in second.metrics)
    alloc.commit("a")
    alloc.admit("b", list(range(8)))  # 4 of 8 hit
    stats.record_transfer("disk_to_host", 800, 0.1)
    third = monitor.poll()  # 4 s
    assert third.metrics['longctx_offload_link_bytes_per_second{link="disk"}'] == 200.0
    assert third.metrics["longctx_allocator_prefix_hit_rate_window"] == 0.5
    assert third.metrics["longctx_allocator_prefix_hit_rate"] == 0.25


@pytest.mark.no_typecheck
def test_monitor_errors():
    with pytest.raises(ValueError, match="Monitor: allocator, offload: expected at least one"):
        Monitor()
    with pytest.raises(ValueError, match=r"Monitor: allocator: expected a paged\.PageAllocator"):
        Monitor(PageAllocator(4, 4, max_pages_per_seq=1).stats())
    with pytest.raises(ValueError, match="Monitor: offload: expected an OffloadStats"):
        Monitor(None, OffloadStats().snapshot())
    with pytest.raises(ValueError, match="Monitor: config: expected a MetricsConfig"):
        Monitor(None, OffloadStats(), config=0.3)
    with pytest.raises(ValueError, match="Monitor: clock: expected a callable"):
        Monitor(None, OffloadStats(), clock=1.0)


# ------------------------------------------------------------------ thread safety


def test_offload_stats_concurrent_records_lose_nothing():
    threads, per_thread = 8, 600
    stats = OffloadStats()
    snapshots = []
    switch = sys.getswitchinterval()

    def work(index):
        for i in range(per_thread):
            stats.record_issue("host_to_disk", 3)
            stats.record_transfer("host_to_disk", 3, 0.5, request_id=f"r{index}", issued=True)
            stats.record_transfer("device_to_host", 1, 0.0)
            stats.add_tier_bytes("disk", 2, request_id=f"r{index}")
            if i % 100 == 0:
                snapshots.append(stats.snapshot())

    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up
    try:
        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(switch)
    total = threads * per_thread
    disk = stats.transfers("host_to_disk")
    assert (disk.count, disk.nbytes, disk.seconds) == (total, 3 * total, 0.5 * total)
    assert (disk.in_flight, disk.in_flight_bytes) == (0, 0)
    assert stats.transfers("device_to_host").count == total
    assert stats.tier_bytes("disk") == 2 * total
    for i in range(threads):
        assert stats.tier_bytes("disk", request_id=f"r{i}") == 2 * per_thread
        assert stats.request_transfer_bytes("host_to_disk", f"r{i}") == 3 * per_thread
    for snap in snapshots:  # each snapshot is one consistent state
        t = snap.transfers["host_to_disk"]
        assert t.nbytes == 3 * t.count and t.in_flight in (0, 1, *range(threads + 1))
        assert snap.tier_bytes["disk"] % 2 == 0
    with pytest.raises(TypeError):
        snapshots[0].transfers["host_to_disk"] = None  # read-only


# ------------------------------------------------------------------ prompt hygiene

VOCAB = 32_000
SYSTEM, HEAD, BLOB, USER, REQUESTS, PAGE = 448, 96, 220, 112, 40, 16


def article_scenario(blob_at: int | None):
    """Incident A: a shared 448-token system prompt, one 112-token user turn per request, and
    (``blob_at`` not None) a per-request 220-token random blob inserted at ``blob_at``."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, VOCAB, SYSTEM)
    prompts = []
    for _ in range(REQUESTS):
        user = rng.integers(0, VOCAB, USER)
        if blob_at is None:
            prompts.append(np.concatenate([system, user]))
        else:
            blob = rng.integers(0, VOCAB, BLOB)
            prompts.append(np.concatenate([system[:blob_at], blob, system[blob_at:], user]))
    return prompts


def test_article_scenario_78_to_12_percent_and_what_moving_the_blob_recovers():
    clean = find_high_cardinality_spans(article_scenario(None), page_size=PAGE)
    # every request after the first hits the 28 system pages: 39/40 * 448/560
    assert clean.hit_rate == pytest.approx(0.78, abs=1e-12)
    assert clean.hit_rate == (REQUESTS - 1) * SYSTEM / (REQUESTS * (SYSTEM + USER))
    assert clean.spans == () and clean.hit_rate_without_spans == clean.hit_rate
    assert clean.tokens_in_spans == 0

    blob = find_high_cardinality_spans(article_scenario(HEAD), page_size=PAGE)
    total = SYSTEM + BLOB + USER
    # only the 6 pages before the blob are shared: 39 * 96 / (40 * 780)
    assert blob.hit_rate == pytest.approx(0.12, abs=1e-12)
    assert blob.hit_rate == (REQUESTS - 1) * HEAD / (REQUESTS * total)
    assert blob.spans == tuple(PromptSpan(i, HEAD, HEAD + BLOB) for i in range(REQUESTS))
    assert blob.tokens_in_spans == REQUESTS * BLOB and blob.tokens_admitted == REQUESTS * total
    # removing the blob restores 78%; moving it after the system prompt: 39 * 448 / (40 * 780)
    assert blob.hit_rate_without_spans == pytest.approx(0.78, abs=1e-12)
    assert blob.hit_rate_spans_moved == pytest.approx(0.56, abs=1e-12)
    assert blob.hit_rate_spans_moved == (REQUESTS - 1) * SYSTEM / (REQUESTS * total)
    assert replay_hit_rate(article_scenario(HEAD), page_size=PAGE) == blob.hit_rate


def test_hygiene_blob_of_varying_length_and_a_short_random_id():
    rng = np.random.default_rng(1)
    system = rng.integers(0, VOCAB, 256).tolist()
    prompts, truth = [], []
    for i in range(12):
        blob = rng.integers(0, VOCAB, 5 + 7 * i).tolist()  # a random id ... a longer blob
        prompts.append(system[:40] + blob + system[40:] + rng.integers(0, VOCAB, 30).tolist())
        truth.append(PromptSpan(i, 40, 40 + len(blob)))
    out = find_high_cardinality_spans(prompts, page_size=8)
    assert out.spans == tuple(truth)
    assert out.hit_rate < out.hit_rate_spans_moved < out.hit_rate_without_spans
    assert out.hit_rate_without_spans == pytest.approx(
        replay_hit_rate([system + p[-30:] for p in prompts], page_size=8)
    )


def test_hygiene_degenerate_inputs():
    rng = np.random.default_rng(2)
    one = rng.integers(0, VOCAB, 100)
    single = find_high_cardinality_spans([one])  # nothing to compare with, nothing cached
    assert single.spans == () and single.hit_rate == 0.0 and single.tokens_admitted == 100
    empty = find_high_cardinality_spans([[], [], np.zeros(0, np.int32)])
    assert empty.spans == () and empty.hit_rate == 0.0 and empty.tokens_admitted == 0
    none = find_high_cardinality_spans([])
    assert none == find_high_cardinality_spans(np.zeros((0, 5), np.int32))
    assert none.spans == () and none.hit_rate == 0.0
    same = find_high_cardinality_spans(np.stack([one] * 5), page_size=16)
    # 100 tokens = 7 pages; the last page is always recomputed: 6 pages hit, 4 prompts of 5
    assert same.spans == () and same.hit_rate == 4 * 96 / (5 * 100)
    mixed = find_high_cardinality_spans([[], one, [], one.tolist()], page_size=16)
    assert mixed.spans == () and mixed.hit_rate == 96 / 200
    short = find_high_cardinality_spans([[1, 2], [1, 2], [3]], ngram=4)  # shorter than ngram
    assert short.spans == ()
    assert replay_hit_rate([[1, 2, 3, 4, 5]] * 2, page_size=2) == 4 / 10
    assert replay_hit_rate([[1, 2, 3, 4, 5, 6, 7]] * 2, page_size=3) == 6 / 14  # any C >= 1


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    ("prompts", "options", "match"),
    [
        ([[1, -2]], {}, r"prompts\[0\]: expected non-negative"),
        ([[1.0, 2.0]], {}, r"prompts\[0\]: expected a 1-D sequence of integer"),
        ([[[1, 2]]], {}, r"prompts\[0\]: expected a 1-D sequence of integer"),
        (["abc"], {}, r"prompts\[0\]: expected token ids"),
        ("abc", {}, "prompts: expected a sequence"),
        (5, {}, "prompts: expected a sequence"),
        ([[1]], {"page_size": 0}, "page_size: expected an int"),
        ([[1]], {"ngram": 0}, "ngram: expected an int"),
        ([[1]], {"min_share": 0.0}, "min_share: expected a float"),
        ([[1]], {"min_share": 1.5}, "min_share: expected a float"),
    ],
)
def test_hygiene_errors(prompts, options, match):
    with pytest.raises(ValueError, match=rf"find_high_cardinality_spans: {match}"):
        find_high_cardinality_spans(prompts, **options)


def test_hygiene_finds_what_the_hit_rate_alert_sees():
    """End to end: the scenario through an allocator, the alert, then the cause."""
    alloc = PageAllocator(2000, PAGE, max_pages_per_seq=64)
    for i, prompt in enumerate(article_scenario(HEAD)):
        alloc.admit(i, prompt)
        alloc.commit(i)
        alloc.free(i)
    (alert,) = compute_metrics(alloc.stats()).alerts
    assert (alert.name, alert.value) == ("prefix_hit_rate_low", pytest.approx(0.12))
    assert find_high_cardinality_spans(article_scenario(HEAD)).hit_rate == pytest.approx(0.12)
