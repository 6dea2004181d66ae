"""The planner and monitoring names moved out of the ``offload`` core into the public
subpackages ``offload.planning`` and ``offload.monitoring``: each old name fails with an
``AttributeError`` that names its new location, and the new location has it."""

import importlib

import pytest

import offload

PLANNING = (
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
MONITORING = (
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
MOVED = [(name, "planning") for name in PLANNING] + [(name, "monitoring") for name in MONITORING]


@pytest.mark.parametrize(("name", "sub"), MOVED)
def test_a_moved_name_raises_with_its_new_location(name, sub):
    with pytest.raises(AttributeError, match=rf"offload\.{name} moved to offload\.{sub}\.{name}"):
        getattr(offload, name)
    assert name not in offload.__all__
    assert not hasattr(offload, name)


@pytest.mark.parametrize(("name", "sub"), MOVED)
def test_a_moved_name_is_public_in_its_subpackage(name, sub):
    module = importlib.import_module(f"offload.{sub}")
    assert name in module.__all__
    assert getattr(module, name) is not None


def test_the_subpackages_export_exactly_the_moved_names():
    planning = importlib.import_module("offload.planning")
    monitoring = importlib.import_module("offload.monitoring")
    assert sorted(planning.__all__) == sorted(PLANNING)
    assert sorted(monitoring.__all__) == sorted(MONITORING)
    assert not set(offload.__all__) & (set(PLANNING) | set(MONITORING))


def test_the_core_keeps_its_names_and_offload_snapshot():
    # 35 after the split, plus the five serving helpers of issue 29 (shared pages, staging,
    # measured bytes): the core's concerns, not the subpackages'.
    assert len(offload.__all__) <= 40
    assert "OffloadSnapshot" in offload.__all__  # what OffloadStats.snapshot() returns
    assert offload.OffloadStats().snapshot().__class__ is offload.OffloadSnapshot


def test_an_unknown_name_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match=r"module 'offload' has no attribute 'no_such_name'"):
        offload.no_such_name  # noqa: B018


def test_a_subpackage_not_yet_imported_says_how_to_import_it(monkeypatch):
    # Once imported (by this test session) it is an attribute of ``offload``; take it away.
    for sub in ("planning", "monitoring"):
        monkeypatch.delattr(offload, sub, raising=False)
        with pytest.raises(AttributeError, match=rf"use `import offload\.{sub}`"):
            getattr(offload, sub)
