"""Prometheus text exposition format 0.0.4 for the flat metrics dict (no server, no client).

:func:`to_prometheus` prints ``{sample key: value}`` (from :func:`offload.monitoring.compute_metrics`, or
any dict of the same form) as a scrape page: one ``# HELP`` and ``# TYPE`` line per family,
then its samples together; histograms as cumulative ``_bucket{le="..."}`` samples in
increasing ``le`` order ending with ``le="+Inf"``, then ``_sum`` and ``_count``. Serve the
string with any HTTP handler as ``text/plain; version=0.0.4``.
"""

import itertools
import math
import re
from collections.abc import Mapping

import numpy as np

from offload.monitoring._metric_families import METRIC_FAMILIES

__all__ = ["PROMETHEUS_CONTENT_TYPE", "escape_label_value", "to_prometheus"]

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` of a page produced by :func:`to_prometheus`."""

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_KEY = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?", re.DOTALL)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)', re.DOTALL)
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def escape_label_value(value: str) -> str:
    """Escapes ``\\``, ``"`` and newlines for a label value (format 0.0.4)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _parse_key(fn: str, key) -> tuple[str, list[tuple[str, str]]]:
    if not isinstance(key, str):
        raise ValueError(f"{fn}: metrics: expected str sample keys, got {key!r}")
    match = _KEY.fullmatch(key)
    if match is None:
        raise ValueError(
            f'{fn}: metrics: expected a key like name or name{{label="value",...}}, got {key!r}'
        )
    name, body = match.group(1), match.group(2)
    labels: list[tuple[str, str]] = []
    position = 0
    while body and position < len(body):
        label = _LABEL.match(body, position)
        if label is None or label.end() == position:
            raise ValueError(f"{fn}: metrics: expected well-formed labels in {key!r}")
        raw = label.group(2)
        value = re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], raw)
        if re.search(r"\\[^\\\"n]", raw.replace("\\\\", "")):
            raise ValueError(f"{fn}: metrics: unknown escape in a label value of {key!r}")
        labels.append((label.group(1), value))
        position = label.end()
        if label.group(3) == "" and position < len(body):
            raise ValueError(f"{fn}: metrics: expected well-formed labels in {key!r}")
    names = [n for n, _ in labels]
    if len(set(names)) != len(names):
        raise ValueError(f"{fn}: metrics: expected distinct label names, got {key!r}")
    return name, labels


def _format_value(value) -> str:
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _family_of(name: str, families: Mapping) -> tuple[str, str, str]:
    """(family name, type, help) of a sample name."""
    if name in families:
        kind, text = families[name]
        return name, kind, text
    for suffix in _HISTOGRAM_SUFFIXES:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and families.get(base, ("",))[0] == "histogram":
            kind, text = families[base]
            return base, kind, text
    return name, "untyped", ""


def _le(fn: str, family: str, labels) -> float:
    values = [v for n, v in labels if n == "le"]
    if len(values) != 1:
        raise ValueError(f"{fn}: metrics: {family}_bucket: expected one le label, got {labels}")
    try:
        return float(values[0])  # accepts "+Inf"
    except ValueError:
        raise ValueError(
            f"{fn}: metrics: {family}_bucket: expected a number or +Inf as le, got {values[0]!r}"
        ) from None


def _histogram_lines(fn: str, family: str, samples) -> list[str]:
    """Orders and checks one histogram's samples (per label set without ``le``)."""
    groups: dict[tuple, dict] = {}
    for name, labels, value in samples:
        rest = tuple(sorted((n, v) for n, v in labels if n != "le"))  # label order: one group
        group = groups.setdefault(rest, {"buckets": [], "sum": None, "count": None})
        if name == f"{family}_bucket":
            group["buckets"].append((_le(fn, family, labels), labels, value))
        elif name == f"{family}_sum":
            group["sum"] = (labels, value)
        elif name == f"{family}_count":
            group["count"] = (labels, value)
        else:
            raise ValueError(
                f"{fn}: metrics: histogram {family}: expected _bucket, _sum or _count samples, "
                f"got {name}"
            )
    lines = []
    for rest, group in groups.items():
        buckets = sorted(group["buckets"], key=lambda b: b[0])
        bounds = [b[0] for b in buckets]
        counts = [b[2] for b in buckets]
        if not bounds or bounds[-1] != math.inf or len(set(bounds)) != len(bounds):
            raise ValueError(
                f"{fn}: metrics: histogram {family}{dict(rest)}: expected distinct buckets "
                f'ending with le="+Inf", got {bounds}'
            )
        if any(a > b for a, b in itertools.pairwise(counts)):
            raise ValueError(
                f"{fn}: metrics: histogram {family}{dict(rest)}: expected cumulative "
                f"(non-decreasing) bucket counts, got {counts}"
            )
        if group["sum"] is None or group["count"] is None:
            raise ValueError(
                f"{fn}: metrics: histogram {family}{dict(rest)}: expected _sum and _count"
            )
        if group["count"][1] != counts[-1]:
            raise ValueError(
                f"{fn}: metrics: histogram {family}{dict(rest)}: expected _count == the +Inf "
                f"bucket, got {group['count'][1]} and {counts[-1]}"
            )
        for _, labels, value in buckets:
            lines.append(_sample_line(f"{family}_bucket", labels, value))
        lines.append(_sample_line(f"{family}_sum", *group["sum"]))
        lines.append(_sample_line(f"{family}_count", *group["count"]))
    return lines


def _sample_line(name: str, labels, value) -> str:
    if not labels:
        return f"{name} {_format_value(value)}"
    inner = ",".join(f'{n}="{escape_label_value(v)}"' for n, v in labels)
    return f"{name}{{{inner}}} {_format_value(value)}"


def to_prometheus(
    metrics: Mapping[str, int | float | np.integer | np.floating],
    *,
    labels: Mapping[str, str] | None = None,
) -> str:
    """Prints a flat metrics dict in the Prometheus text exposition format 0.0.4.

    Families are printed in the order their first sample appears; types and help texts come
    from :data:`offload.monitoring.METRIC_FAMILIES` (other names are ``untyped``). A series
    is its name and its set of labels: two keys that write one series differently (labels in
    another order, spaces) are rejected, not printed twice (Prometheus refuses such a page)
    nor summed (a gauge or a histogram's ``_sum`` cannot be added up blindly). Label values are
    escaped (``\\`` ``"`` and newline); ints print exactly, floats with ``repr``, and NaN /
    infinities as ``NaN`` / ``+Inf`` / ``-Inf``.

    Args:
      metrics: ``{sample key: value}``; a key is a metric name, optionally with labels in
        Prometheus syntax (label values escaped), e.g. ``'x_total{direction="host_to_disk"}'``.
      labels: constant labels added to every sample (``{"instance": "gpu-0"}``); values are
        escaped here.

    Returns:
      The page, ending with a newline (empty for an empty dict).

    Raises:
      ValueError: on a malformed key, a non-number value, a reserved (``__``) or repeated
        label name, a constant label also present in a sample, two keys naming the same
        series (same name and labels, in any order or spacing), or a histogram whose buckets
        are not cumulative, lack ``+Inf``, or disagree with its ``_count``.

    Example:
      >>> print(to_prometheus({"longctx_allocator_sequences": 3}, labels={"pool": "a"}), end="")
      # HELP longctx_allocator_sequences Live sequences.
      # TYPE longctx_allocator_sequences gauge
      longctx_allocator_sequences{pool="a"} 3
    """
    fn = "to_prometheus"
    if not isinstance(metrics, Mapping):
        raise ValueError(f"{fn}: metrics: expected a mapping, got {type(metrics).__name__}")
    extra: list[tuple[str, str]] = []
    for name, value in (labels or {}).items():
        if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ValueError(
                f"{fn}: labels: expected label names matching [a-zA-Z_][a-zA-Z0-9_]* and not "
                f"starting with __, got {name!r}"
            )
        if not isinstance(value, str):
            raise ValueError(f"{fn}: labels: expected str values, got {name}={value!r}")
        extra.append((name, value))
    families: dict[str, tuple[str, str, list]] = {}
    series: dict[tuple, str] = {}  # (name, sorted labels) -> the key that named it first
    for key, value in metrics.items():
        name, sample_labels = _parse_key(fn, key)
        identity = (name, tuple(sorted(extra + sample_labels)))
        if identity in series:
            raise ValueError(
                f"{fn}: metrics: expected one key per series, got {series[identity]!r} and "
                f"{key!r}, the same series written differently (label order and spaces do not "
                f"make another series): merge them into one key"
            )
        series[identity] = key
        if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)
        ):
            raise ValueError(f"{fn}: metrics: {key}: expected a number, got {value!r}")
        for label, _ in sample_labels:
            if label.startswith("__"):
                raise ValueError(f"{fn}: metrics: {key}: label names starting with __ are reserved")
            if any(label == n for n, _ in extra):
                raise ValueError(f"{fn}: labels: {label!r} is already a label of {key}")
        family, kind, text = _family_of(name, METRIC_FAMILIES)
        entry = families.setdefault(family, (kind, text, []))
        entry[2].append((name, extra + sample_labels, value))
    lines: list[str] = []
    for family, (kind, text, samples) in families.items():
        if text:
            lines.append(f"# HELP {family} {_escape_help(text)}")
        lines.append(f"# TYPE {family} {kind}")
        if kind == "histogram":
            lines += _histogram_lines(fn, family, samples)
        else:
            lines += [_sample_line(name, ls, value) for name, ls, value in samples]
    return "\n".join(lines) + "\n" if lines else ""
