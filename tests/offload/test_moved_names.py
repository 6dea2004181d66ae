"""The planner, monitoring and retrieval names moved out of the ``offload`` core into the
public subpackages ``offload.planning``, ``offload.monitoring`` and ``offload.retrieval``: each
old name fails with an ``AttributeError`` that names its new location, and the new location
has it."""

import importlib

import pytest

import offload

# The subpackages' ``__all__`` is the truth; the core keeps a mirror of it (``_MOVED``, it may
# not import them) for its error messages, checked equal below.
SUBPACKAGES = {
    sub: importlib.import_module(f"offload.{sub}")
    for sub in ("planning", "monitoring", "retrieval")
}
MOVED = sorted((name, sub) for sub, module in SUBPACKAGES.items() for name in module.__all__)


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
    assert offload._MOVED == dict(MOVED)  # the core's mirror of the subpackages' names
    # 37 moved from the core, and retrieval_decode_attention_jit, new in offload.retrieval.
    assert len(MOVED) == 38 and not set(offload.__all__) & set(offload._MOVED)


def test_the_core_keeps_its_names_and_offload_snapshot():
    # 35 after the split, plus the five serving helpers of issue 29 (shared pages, staging,
    # measured bytes): the core's concerns; query-aware retrieval (issue 31) is its own
    # subpackage, the page-mass estimate of the mass kept is monitoring's (the exact one,
    # from log-sum-exps, is what mixed_residency_attention reports, so it stays), and TIERS /
    # DIRECTIONS are attributes of OffloadStats: 37.
    assert len(offload.__all__) <= 37
    assert "OffloadSnapshot" in offload.__all__  # what OffloadStats.snapshot() returns
    assert offload.OffloadStats().snapshot().__class__ is offload.OffloadSnapshot


@pytest.mark.parametrize("name", ["TIERS", "DIRECTIONS"])
def test_tiers_and_directions_are_attributes_of_offload_stats(name):
    with pytest.raises(AttributeError, match=rf"offload\.{name} moved to offload\.OffloadStats"):
        getattr(offload, name)
    assert name not in offload.__all__
    assert getattr(offload.OffloadStats, name) == getattr(offload.OffloadStats(), name)
    assert len(getattr(offload.OffloadStats, name)) in (3, 4)


def test_an_unknown_name_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match=r"module 'offload' has no attribute 'no_such_name'"):
        offload.no_such_name  # noqa: B018


def test_a_subpackage_not_yet_imported_says_how_to_import_it(monkeypatch):
    # Once imported (by this test session) it is an attribute of ``offload``; take it away.
    for sub in ("planning", "monitoring", "retrieval"):
        monkeypatch.delattr(offload, sub, raising=False)
        with pytest.raises(AttributeError, match=rf"use `import offload\.{sub}`"):
            getattr(offload, sub)
