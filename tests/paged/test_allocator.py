"""Unit tests of the host-side PageAllocator: every operation, every error, awkward lengths."""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

from paged import (
    NULL_PAGE,
    Admission,
    AllocatorStats,
    OutOfPages,
    PageAllocator,
    init_paged_cache,
    paged_attention,
    with_page_table,
    write,
)


def snapshot(alloc: PageAllocator):
    """Everything an atomic failure must leave unchanged.

    ``stats().out_of_pages_lengths`` is left out: counting the failure is its purpose (tests of
    it check it separately).
    """
    seqs = {
        seq: (
            list(r.pages),
            r.length,
            list(r.tokens),
            r.written,
            list(r.hashes),
        )
        for seq, r in alloc._seqs.items()
    }
    return (
        seqs,
        list(alloc._free),
        list(alloc._refcount),
        sorted(alloc._reserved),
        alloc._index.items(),
        alloc._index.evictable_pages(),
        dataclasses.replace(alloc.stats(), out_of_pages_lengths=()),
    )


def prompt(n, start=0):
    return list(range(start, start + n))


# ------------------------------------------------------------------ construction


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_pages=1, page_size=4, max_pages_per_seq=2), "num_pages"),
        (dict(num_pages=4.0, page_size=4, max_pages_per_seq=2), "num_pages"),
        (dict(num_pages=True, page_size=4, max_pages_per_seq=2), "num_pages"),
        (dict(num_pages=8, page_size=0, max_pages_per_seq=2), "page_size"),
        (dict(num_pages=8, page_size=-4, max_pages_per_seq=2), "page_size"),
        (dict(num_pages=8, page_size=4.0, max_pages_per_seq=2), "page_size"),
        (dict(num_pages=8, page_size=4, max_pages_per_seq=0), "max_pages_per_seq"),
        (dict(num_pages=8, page_size=4, max_pages_per_seq="2"), "max_pages_per_seq"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PageAllocator(kwargs.pop("num_pages"), kwargs.pop("page_size"), **kwargs)


@pytest.mark.no_typecheck
@pytest.mark.parametrize("page_size", [3, 12])
def test_page_size_is_one_rule_for_the_allocator_and_the_cache(page_size):
    """Any int >= 1, what the XLA kernels need: ``PageAllocator`` refused 12 while
    ``init_paged_cache`` took it. Both now take the same sizes and refuse the same ones with
    one message, and the allocator's table drives a cache of that page size to the dense
    answer (lengths C + 1 and 2 C, so a partial page and a full one)."""
    makers = {
        "PageAllocator": lambda C: PageAllocator(8, C, max_pages_per_seq=2),
        "init_paged_cache": lambda C: init_paged_cache(1, 1, 8, C, 8, batch=1, max_pages_per_seq=2),
    }
    for fn, make in makers.items():
        make(page_size)
        for bad in (0, -4, 4.0, True):
            match = rf"{fn}: page_size: expected an int >= 1, got {re.escape(repr(bad))}"
            with pytest.raises(ValueError, match=match):
                make(bad)
    m, H, N = 3, 8, 2
    alloc = PageAllocator(1 + 2 * m, page_size, max_pages_per_seq=m)
    lengths = [page_size + 1, 2 * page_size]
    for seq, length in enumerate(lengths):
        alloc.allocate(seq, length)
    cache = init_paged_cache(1, 1, 1 + 2 * m, page_size, H, batch=2, max_pages_per_seq=m)
    cache = with_page_table(cache, alloc.page_table([0, 1]), np.zeros(2, np.int32))
    rng = np.random.default_rng(page_size)
    k, v = rng.standard_normal((2, 1, 2, 2 * page_size, 1, H), dtype=np.float32)
    cache = write(cache, jnp.asarray(k), jnp.asarray(v), 0, count=jnp.asarray(lengths))
    np.testing.assert_array_equal(cache.lengths, lengths)
    q = rng.standard_normal((2, 1, N, H), dtype=np.float32)
    out = paged_attention(
        jnp.asarray(q), cache.k_pages[0], cache.v_pages[0], cache.page_table, cache.lengths
    ).out
    for b, length in enumerate(lengths):
        s = np.einsum("nh,sh->ns", q[b, 0], k[0, b, :length, 0]) / np.sqrt(H)
        p = np.exp(s - s.max(-1, keepdims=True))
        want = (p / p.sum(-1, keepdims=True)) @ v[0, b, :length, 0]
        np.testing.assert_allclose(np.asarray(out[b, 0]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [1, 2, 3, 4, 12, 16, 64])
def test_any_page_size_and_awkward_lengths(page_size):
    m = 3
    alloc = PageAllocator(1 + 5 * m, page_size, max_pages_per_seq=m)
    lengths = [0, 1, page_size, page_size + 1, m * page_size]
    lengths = sorted(set(lengths))
    for seq, length in enumerate(lengths):
        pages = alloc.allocate(seq, length)
        assert pages.dtype == np.int32 and len(pages) == -(-length // page_size)
        assert NULL_PAGE not in pages
    table = alloc.page_table(range(len(lengths)))
    assert table.shape == (len(lengths), m) and table.dtype == np.int32
    np.testing.assert_array_equal(alloc.lengths(range(len(lengths))), lengths)
    for row, length in enumerate(lengths):
        count = -(-length // page_size)
        assert (table[row, :count] > 0).all() and (table[row, count:] == NULL_PAGE).all()
    used = table[table > 0]
    assert len(np.unique(used)) == len(used)
    stats = alloc.stats()
    assert stats.tokens_stored == sum(lengths) == stats.tokens_logical
    assert stats.pages_used == len(used)
    assert stats.page_table_bytes == 4 * len(used)
    assert stats.page_table_bytes_padded == 4 * m * len(lengths)
    alloc.validate()
    for seq in range(len(lengths)):
        alloc.free(seq)
    assert alloc.stats().pages_free == alloc.num_pages - 1
    alloc.validate()


def test_null_page_never_handed_out_and_pool_exhaustion_is_atomic():
    alloc = PageAllocator(6, 2, max_pages_per_seq=8)
    alloc.allocate("a", 7)  # 4 pages
    alloc.allocate("b", 1)  # 1 page: pool full
    assert sorted(alloc.sequence_pages("a").tolist() + alloc.sequence_pages("b").tolist()) == [
        1,
        2,
        3,
        4,
        5,
    ]
    before = snapshot(alloc)
    for call in (
        lambda: alloc.allocate("c", 1),
        lambda: alloc.admit("c", [1]),
        lambda: alloc.extend("b", 3),
        lambda: alloc.fork("b", "c"),
        lambda: alloc.reserve(1),
    ):
        with pytest.raises(OutOfPages, match=r"requested 1, free 0, evictable 0") as info:
            call()
        assert isinstance(info.value, RuntimeError)
        assert (info.value.requested, info.value.free, info.value.evictable) == (1, 0, 0)
        assert snapshot(alloc) == before
    alloc.validate()


def test_out_of_pages_lengths_histogram_counts_each_failed_request_by_its_length():
    alloc = PageAllocator(6, 2, max_pages_per_seq=8)
    assert alloc.stats().out_of_pages_lengths == () and alloc.stats().out_of_pages == 0
    alloc.allocate("a", 7)  # 4 pages
    alloc.allocate("b", 1)  # 1 page: pool full
    assert alloc.stats().page_table_bytes_max == 4 * 4  # "a": 4 int32 entries
    calls = [
        (lambda: alloc.allocate("c", 5), 5),
        (lambda: alloc.admit("c", [1, 2, 3]), 3),
        (lambda: alloc.extend("b", 3), 3),
        (lambda: alloc.fork("b", "c"), 1),  # the child's length
        (lambda: alloc.reserve(2), None),  # not a request: not counted
        (lambda: alloc.allocate("c", 5), 5),
    ]
    for call, _ in calls:
        with pytest.raises(OutOfPages):
            call()
    stats = alloc.stats()
    assert stats.out_of_pages_lengths == ((1, 1), (3, 2), (5, 2))
    assert stats.out_of_pages == 5
    alloc.free("a")
    alloc.allocate("c", 5)  # a success adds nothing
    assert alloc.stats().out_of_pages_lengths == ((1, 1), (3, 2), (5, 2))
    assert alloc.stats().page_table_bytes_max == 3 * 4
    alloc.validate()


def test_out_of_pages_counts_evictable_pages():
    alloc = PageAllocator(5, 2, max_pages_per_seq=8)
    alloc.admit("a", prompt(5))
    alloc.commit("a")
    alloc.free("a")  # two keyed pages cached, one partial page free
    before = snapshot(alloc)
    with pytest.raises(OutOfPages, match=r"requested 5, free 2, evictable 2") as info:
        alloc.allocate("b", 10)
    assert info.value.evictable == 2
    assert snapshot(alloc) == before


# ------------------------------------------------------------------ prefix caching


@pytest.mark.parametrize("page_size", [1, 4])
def test_admit_reuses_cached_prefix_and_recomputes_last_page(page_size):
    c = page_size
    alloc = PageAllocator(32, c, max_pages_per_seq=8)
    first = alloc.admit("a", prompt(3 * c))
    assert isinstance(first, Admission)
    assert first.num_cached_tokens == 0 and first.num_new_tokens == 3 * c
    alloc.commit("a")
    # Fully cached prompt: the last page is recomputed, so only 2 pages are hits.
    again = alloc.admit("b", prompt(3 * c))
    assert again.num_cached_tokens == 2 * c and again.num_cached_pages == 2
    assert again.page_ids[:2] == first.page_ids[:2] and again.page_ids[2] != first.page_ids[2]
    # Longer prompt with the same start: the three full pages hit.
    longer = alloc.admit("c", prompt(3 * c + 1))
    assert longer.num_cached_tokens == 3 * c and longer.page_ids[:3] == first.page_ids
    # One token differs in page 1: page 0 hits, and page 2 misses although its own tokens
    # match, because its key chains through page 1.
    tokens = prompt(3 * c + 1)
    tokens[c] = 999
    other = alloc.admit("d", tokens)
    assert other.num_cached_tokens == c
    stats = alloc.stats()
    assert stats.tokens_admitted == 3 * c + 3 * c + 3 * c + 1 + 3 * c + 1
    assert stats.tokens_hit == 2 * c + 3 * c + c
    assert stats.prefix_hit_rate == pytest.approx(stats.tokens_hit / stats.tokens_admitted)
    assert stats.pages_shared >= 1
    alloc.validate()


@pytest.mark.parametrize("length", [0, 1, 4, 5])
def test_admit_lengths_and_single_token_prompt_never_hits(length):
    alloc = PageAllocator(8, 4, max_pages_per_seq=2)
    alloc.admit("a", prompt(length))
    alloc.commit("a")
    adm = alloc.admit("b", prompt(length))
    # At most ceil(T / C) - 1 pages hit: 0 for T <= C, one for T = 5.
    assert adm.num_cached_tokens == (4 if length == 5 else 0)
    assert adm.num_tokens == length and len(adm.page_ids) == -(-length // 4)
    alloc.validate()


def test_admit_full_capacity_prompt():
    alloc = PageAllocator(16, 4, max_pages_per_seq=3)
    alloc.admit("a", np.arange(12))
    alloc.commit("a")
    adm = alloc.admit("b", np.arange(12))
    assert adm.num_cached_tokens == 8 and len(adm.page_ids) == 3
    with pytest.raises(
        ValueError, match=r"len\(token_ids\): expected at most M \* C = 3 \* 4 = 12 tokens.*got 13"
    ):
        alloc.admit("c", np.arange(13))
    alloc.validate()


def test_salts_isolate_tenants():
    alloc = PageAllocator(32, 2, max_pages_per_seq=8)
    alloc.admit("a", prompt(7), salt="tenant-a")
    alloc.commit("a")
    assert alloc.admit("b", prompt(7), salt="tenant-b").num_cached_tokens == 0
    assert alloc.admit("c", prompt(7)).num_cached_tokens == 0
    assert alloc.admit("d", prompt(7), salt=b"tenant-a").num_cached_tokens == 6  # UTF-8 bytes
    assert alloc.admit("e", prompt(7), salt="tenant-a").num_cached_tokens == 6
    alloc.validate()


@pytest.mark.no_typecheck
@pytest.mark.parametrize("salt", [1, 2.0, ["a"], object()])
def test_bad_salt_type(salt):
    alloc = PageAllocator(8, 2, max_pages_per_seq=4)
    with pytest.raises(ValueError, match="salt: expected None, str or bytes"):
        alloc.admit("a", [1], salt=salt)
    with pytest.raises(ValueError, match="salt: expected None, str or bytes"):
        alloc.allocate("a", 1, salt=salt)
    assert "a" not in alloc


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    "tokens, match",
    [
        ([[1, 2]], "token_ids: expected a 1-D integer array"),
        ([1.5, 2.0], "token_ids: expected a 1-D integer array"),
        (["a"], "token_ids: expected a 1-D integer array"),
        ([1, -2], "token_ids: expected non-negative token ids"),
    ],
)
def test_admit_rejects_bad_token_ids(tokens, match):
    alloc = PageAllocator(8, 2, max_pages_per_seq=4)
    with pytest.raises(ValueError, match=match):
        alloc.admit("a", tokens)


def test_unreferenced_cached_pages_stay_until_the_free_list_is_empty():
    alloc = PageAllocator(8, 2, max_pages_per_seq=8)  # 7 usable pages
    alloc.admit("a", prompt(5))  # pages 1, 2 (full) and 3 (partial)
    alloc.commit("a")
    alloc.free("a")
    stats = alloc.stats()
    assert (stats.pages_cached, stats.pages_free, stats.pages_used) == (2, 5, 0)
    alloc.allocate("b", 8)  # 4 of the 5 free pages, no eviction
    assert alloc.stats().evictions == 0 and alloc.stats().pages_cached == 2
    # Revive the cached prefix from the LRU: only the last page is new.
    adm = alloc.admit("c", prompt(5))
    assert adm.num_cached_tokens == 4 and adm.page_ids[:2] == (1, 2)
    assert alloc.stats().pages_cached == 0
    alloc.validate()
    alloc.free("c")  # released last-first: page 2, then page 1, enter the LRU
    alloc.allocate("d", 1)  # takes c's partial page from the free list
    assert alloc.stats().evictions == 0
    alloc.allocate("e", 1)  # free list empty: evicts the oldest cached page, the tail page 2
    assert alloc.stats().evictions == 1 and alloc.sequence_pages("e").tolist() == [2]
    alloc.free("b")
    assert alloc.admit("f", prompt(5)).num_cached_tokens == 2  # page 1 still cached
    alloc.validate()


def test_eviction_breaks_the_chain_after_the_evicted_page():
    alloc = PageAllocator(5, 2, max_pages_per_seq=8)  # 4 usable pages
    alloc.admit("a", prompt(6))
    alloc.commit("a")  # all three pages are full, so all are keyed
    alloc.free("a")  # LRU, oldest first: 3, 2, 1
    assert alloc.stats().pages_cached == 3
    alloc.allocate("x", 4)  # the free page 4, then evicts page 3
    assert alloc.stats().evictions == 1 and alloc.sequence_pages("x").tolist() == [4, 3]
    alloc.free("x")
    adm = alloc.admit("b", prompt(7))
    assert adm.num_cached_tokens == 4  # pages 1, 2 hit; the third page's key is gone
    alloc.validate()


def test_commit_keys_pages_and_duplicates_stay_unkeyed():
    alloc = PageAllocator(16, 2, max_pages_per_seq=8)
    alloc.admit("a", prompt(5))
    alloc.admit("b", prompt(5))  # nothing committed yet: no hits
    alloc.commit("a", 3)  # one full page written
    assert len(alloc._index) == 1
    alloc.commit("b")
    assert len(alloc._index) == 2  # b's page 0 duplicates a's; b's page 1 is new
    alloc.commit("a")
    assert len(alloc._index) == 2
    assert alloc.admit("c", prompt(5)).num_cached_tokens == 4
    alloc.validate()
    alloc.free("a")
    alloc.free("b")
    alloc.free("c")
    alloc.validate()


@pytest.mark.no_typecheck
@pytest.mark.parametrize("num_tokens", [-1, 6, 1.0, True])
def test_commit_rejects_bad_counts(num_tokens):
    alloc = PageAllocator(16, 2, max_pages_per_seq=8)
    alloc.admit("a", prompt(5))
    with pytest.raises(ValueError, match=r"num_tokens: expected an int in \[0, 5\]"):
        alloc.commit("a", num_tokens)


def test_commit_cannot_unwrite():
    alloc = PageAllocator(16, 2, max_pages_per_seq=8)
    alloc.admit("a", prompt(5))
    alloc.commit("a", 4)
    with pytest.raises(ValueError, match=r"num_tokens: expected an int in \[4, 5\]"):
        alloc.commit("a", 3)
    with pytest.raises(ValueError, match="seq: expected a live sequence id, got 'z'"):
        alloc.commit("z")


# ------------------------------------------------------------------ extend


def test_extend_allocates_pages_and_tracks_tokens():
    alloc = PageAllocator(16, 4, max_pages_per_seq=3)
    alloc.allocate("a", 0)
    assert alloc.page_table(["a"]).tolist() == [[0, 0, 0]]
    assert alloc.extend("a", 1, token_ids=[7]).pairs() == []
    assert alloc.extend("a", 4, token_ids=[7, 7, 7]).pairs() == []
    assert alloc.extend("a", 5, token_ids=[8]).pairs() == []
    assert alloc.extend("a", 5).pairs() == []  # no-op
    assert len(alloc.sequence_pages("a")) == 2
    alloc.commit("a")
    assert alloc.admit("b", [7, 7, 7, 7, 9]).num_cached_tokens == 4
    assert alloc.extend("a", 12, token_ids=[1] * 7).pairs() == []  # full capacity
    assert alloc.sequence_length("a") == 12
    alloc.validate()


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    "new_length, token_ids, match",
    [
        (2, None, "new_length: expected >= current length 3"),
        (9, None, r"new_length: expected at most M \* C = 4 \* 2 = 8 tokens.*got 9"),
        (-1, None, "new_length: expected a non-negative int"),
        (4.0, None, "new_length: expected a non-negative int"),
        (5, [1], "token_ids: expected 2 ids"),
        (4, [[1]], "token_ids: expected a 1-D integer array"),
        (4, [-1], "token_ids: expected non-negative"),
    ],
)
def test_extend_rejects_bad_arguments(new_length, token_ids, match):
    alloc = PageAllocator(16, 2, max_pages_per_seq=4)
    alloc.admit("a", [1, 2, 3])
    before = snapshot(alloc)
    with pytest.raises(ValueError, match=match):
        alloc.extend("a", new_length, token_ids=token_ids)
    assert snapshot(alloc) == before


def test_extend_without_token_ids_makes_the_rest_uncacheable():
    alloc = PageAllocator(16, 2, max_pages_per_seq=8)
    alloc.admit("a", [1, 2, 3])
    alloc.extend("a", 4)
    with pytest.raises(
        ValueError, match="token_ids: expected no ids for 'a', which has untracked tokens"
    ):
        alloc.extend("a", 5, token_ids=[9])
    alloc.commit("a")
    assert len(alloc._index) == 1  # page 0 only: page 1's last token is unknown
    alloc.validate()


@pytest.mark.no_typecheck
def test_operations_reject_unknown_duplicate_and_unhashable_ids():
    alloc = PageAllocator(16, 2, max_pages_per_seq=4)
    alloc.allocate("a", 1)
    with pytest.raises(ValueError, match="seq: expected a new id, got duplicate sequence 'a'"):
        alloc.allocate("a", 1)
    with pytest.raises(ValueError, match="seq: expected a new id, got duplicate sequence 'a'"):
        alloc.admit("a", [1])
    with pytest.raises(ValueError, match="seq: expected a hashable id"):
        alloc.allocate(["x"], 1)
    with pytest.raises(ValueError, match="length: expected a non-negative int"):
        alloc.allocate("b", -1)
    with pytest.raises(
        ValueError,
        match=r"length: expected at most M \* C = 4 \* 2 = 8 tokens \(the capacity\), got 9",
    ):
        alloc.allocate("b", 9)
    for call in (
        lambda: alloc.extend("b", 1),
        lambda: alloc.free("b"),
        lambda: alloc.sequence_length("b"),
        lambda: alloc.sequence_pages("b"),
    ):
        with pytest.raises(ValueError, match="seq: expected a live sequence id, got 'b'"):
            call()
    with pytest.raises(ValueError, match=r"seqs\[1\]: expected a live sequence id, got 'b'"):
        alloc.page_table(["a", "b"])
    with pytest.raises(ValueError, match=r"seqs\[0\]: expected a live sequence id, got 'b'"):
        alloc.lengths(["b"])
    with pytest.raises(ValueError, match="seqs: expected distinct sequence ids"):
        alloc.page_table(["a", "a"])
    with pytest.raises(ValueError, match="parent: expected a live sequence id, got 'b'"):
        alloc.fork("b", "c")
    with pytest.raises(ValueError, match="child: expected a new id, got duplicate sequence 'a'"):
        alloc.fork("a", "a")
    assert "a" in alloc and "b" not in alloc and ["x"] not in alloc
    assert alloc.sequences == ("a",)


# ------------------------------------------------------------------ fork and copy-on-write


@pytest.mark.parametrize("length", [0, 1, 4, 5, 8])
def test_fork_shares_full_pages_and_copies_the_partial_page(length):
    alloc = PageAllocator(16, 4, max_pages_per_seq=2)
    alloc.admit("p", prompt(length))
    alloc.commit("p")
    plan = alloc.fork("p", "c")
    parent, child = alloc.sequence_pages("p").tolist(), alloc.sequence_pages("c").tolist()
    full = length // 4
    assert child[:full] == parent[:full]
    if length % 4:
        assert plan.pairs() == [(parent[-1], child[-1])] and child[-1] != parent[-1]
        assert plan.src.dtype == plan.dst.dtype == np.int32
    else:
        assert plan.pairs() == [] and child == parent
        assert plan.src.shape == plan.dst.shape == (0,) and plan.src.dtype == np.int32
    assert alloc.sequence_length("c") == length
    assert alloc.stats().pages_shared == full
    alloc.validate()
    alloc.free("p")
    alloc.validate()
    if length == 8:  # the child can keep appending into fresh pages, no copy
        assert alloc.extend("c", 8).pairs() == []


def test_lazy_fork_copies_on_first_append():
    alloc = PageAllocator(16, 4, max_pages_per_seq=4)
    alloc.admit("p", prompt(6))
    alloc.commit("p")
    assert alloc.fork("p", "c", lazy=True).pairs() == []
    shared = alloc.sequence_pages("p")[-1]
    assert alloc.sequence_pages("c")[-1] == shared and alloc.stats().pages_shared == 2
    # The parent appends into the shared partial page: it gets a private copy first.
    plan = alloc.extend("p", 7, token_ids=[50])
    new = alloc.sequence_pages("p")[-1]
    assert plan.pairs() == [(shared, new)] and new != shared
    # The child now owns the original alone and writes in place.
    assert alloc.extend("c", 9, token_ids=[60, 61, 62]).pairs() == []
    assert alloc.sequence_pages("c")[1] == shared
    alloc.commit("p")
    alloc.commit("c")
    alloc.validate()


def test_lazy_fork_copy_is_atomic_under_pressure():
    alloc = PageAllocator(4, 4, max_pages_per_seq=4)
    alloc.allocate("p", 6)
    alloc.fork("p", "c", lazy=True)
    alloc.allocate("x", 1)  # pool full
    before = snapshot(alloc)
    with pytest.raises(OutOfPages, match=r"extend\('c'\).*requested 1"):
        alloc.extend("c", 7)
    assert snapshot(alloc) == before
    alloc.free("x")
    assert len(alloc.extend("c", 7).src) == 1
    alloc.validate()


# ------------------------------------------------------------------ device reserve and settle


def test_reserve_and_settle_round_trip():
    alloc = PageAllocator(16, 2, max_pages_per_seq=4)
    alloc.admit("a", [1, 2, 3])
    alloc.admit("b", [4, 5])
    stack = alloc.reserve(4)
    assert stack.dtype == np.int32 and len(set(stack.tolist())) == 4 and NULL_PAGE not in stack
    assert alloc.stats().pages_reserved == 4 and alloc.stats().pages_used == 7
    alloc.validate()
    table = alloc.page_table(["a", "b"])
    # Device loop: a grows 3 -> 6 (one new page), b grows 2 -> 5 (two new pages).
    table[0, 2] = stack[0]
    table[1, 1:3] = stack[1:3]
    alloc.settle(
        ["a", "b"],
        table,
        np.array([6, 5]),
        unused=[],
        token_ids=[[6, 7, 8], None],
    )
    assert alloc.sequence_pages("a").tolist()[2] == stack[0]
    assert alloc.sequence_pages("b").tolist()[1:] == stack[1:3].tolist()
    assert alloc.stats().pages_reserved == 1  # stack[3] stays reserved for a later loop
    alloc.validate()
    # a's tokens were all given and written: its three pages are keyed.
    assert alloc.admit("c", [1, 2, 3, 6, 7, 8, 0]).num_cached_tokens == 6
    alloc.settle([], np.zeros((0, 4), np.int32), np.zeros(0, np.int32), unused=stack[3:])
    assert alloc.stats().pages_reserved == 0
    alloc.validate()


@pytest.mark.no_typecheck
def test_reserve_rejects_bad_counts():
    alloc = PageAllocator(4, 2, max_pages_per_seq=4)
    for num in (-1, 1.0, None):
        with pytest.raises(ValueError, match="num: expected an int >= 0"):
            alloc.reserve(num)
    assert alloc.reserve(0).tolist() == []
    with pytest.raises(OutOfPages, match="requested 4, free 3"):
        alloc.reserve(4)


@pytest.fixture
def loop_state():
    alloc = PageAllocator(16, 2, max_pages_per_seq=4)
    alloc.admit("a", [1, 2, 3])
    alloc.admit("b", [4, 5])
    stack = alloc.reserve(3)
    table = alloc.page_table(["a", "b"])
    table[0, 2] = stack[0]
    return alloc, stack, table


@pytest.mark.no_typecheck
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(table=lambda t, s: t[:, :3]), r"page_table: expected shape \(2, 4\)"),
        (dict(table=lambda t, s: t.astype(np.float32)), "page_table: expected a 2-D integer"),
        (dict(lengths=[5]), r"lengths: expected shape \(2,\)"),
        (dict(lengths=[2, 2]), r"lengths\[0\]: expected in \[3, 8\]"),
        (dict(lengths=[9, 2]), r"lengths\[0\]: expected in \[3, 8\]"),
        (
            dict(table=lambda t, s: t.__setitem__((0, 0), 9) or t),
            r"page_table\[0\]: expected the first 2",
        ),
        (
            dict(table=lambda t, s: t.__setitem__((0, 2), 15) or t),
            r"page_table\[0\]: expected reserved pages .*got page 15 \(not reserved",
        ),
        (
            dict(table=lambda t, s: t.__setitem__((1, 1), s[0]) or t, lengths=[5, 3]),
            r"page_table\[1\]: expected reserved pages .* taken by another row",
        ),
        (dict(unused=lambda s: s[:1]), "unused: expected distinct reserved pages"),
        (dict(unused=lambda s: [s[1], s[1]]), "unused: expected distinct reserved pages"),
        (dict(unused=lambda s: [14]), "unused: expected distinct reserved pages"),
        (dict(token_ids=[[1]]), "token_ids: expected 2 rows"),
        (dict(token_ids=[[1], None]), r"token_ids\[0\]: expected 2 ids"),
        (dict(seqs=["a", "a"]), "seqs: expected distinct sequence ids"),
        (dict(seqs=["a", "z"]), r"seqs\[1\]: expected a live sequence id, got 'z'"),
    ],
)
def test_settle_rejects_bad_results(loop_state, change, match):
    alloc, stack, table = loop_state
    args = dict(seqs=["a", "b"], table=table, lengths=[5, 2], unused=[], token_ids=None)
    for key, value in change.items():
        if key == "table":
            args[key] = value(table.copy(), stack)
        elif key == "unused":
            args[key] = value(stack)
        else:
            args[key] = value
    before = snapshot(alloc)
    with pytest.raises(ValueError, match=match):
        alloc.settle(
            args["seqs"],
            args["table"],
            np.asarray(args["lengths"]),
            unused=args["unused"],
            token_ids=args["token_ids"],
        )
    assert snapshot(alloc) == before
    alloc.settle(["a", "b"], table, np.array([5, 2]), unused=stack[1:])
    alloc.validate()


def test_settle_refuses_growth_into_a_shared_partial_page():
    alloc = PageAllocator(16, 2, max_pages_per_seq=4)
    alloc.allocate("a", 3)
    alloc.fork("a", "b", lazy=True)
    stack = alloc.reserve(1)
    with pytest.raises(
        ValueError, match=r"lengths\[0\]: expected 'a' not to grow into its shared partial page"
    ):
        alloc.settle(["a"], alloc.page_table(["a"]), np.array([4]))
    alloc.extend("a", 3)  # no growth: no copy either
    assert len(alloc.extend("a", 4).src) == 1  # the host-side copy-on-write
    alloc.settle(["a"], alloc.page_table(["a"]), np.array([4]), unused=stack)
    alloc.validate()


# ------------------------------------------------------------------ stats and validate


def test_stats_waste_and_hit_rate():
    alloc = PageAllocator(32, 4, max_pages_per_seq=4)
    stats = alloc.stats()
    assert isinstance(stats, AllocatorStats)
    assert (stats.waste, stats.prefix_hit_rate, stats.pages_free) == (0.0, 0.0, 31)
    alloc.admit("a", prompt(9))  # 3 pages, 12 slots, 9 tokens
    assert alloc.stats().waste == pytest.approx(3 / 12)
    alloc.commit("a")
    alloc.admit("b", prompt(9))  # 8 cached tokens, new last page
    stats = alloc.stats()
    assert stats.tokens_stored == 9 + 1 and stats.tokens_logical == 18
    assert stats.waste == pytest.approx((16 - 10) / 16)  # 4 distinct pages
    assert stats.prefix_hit_rate == pytest.approx(8 / 18)
    assert stats.page_table_bytes == 4 * 6
    with pytest.raises(Exception, match=r"frozen|cannot assign"):
        stats.waste = 0.0


def test_validate_detects_corruption():
    alloc = PageAllocator(16, 2, max_pages_per_seq=4)
    alloc.admit("a", [1, 2, 3])
    alloc.commit("a")
    alloc.validate()
    alloc._refcount[1] += 1
    with pytest.raises(ValueError, match="page 1: refcount 2, holders 1"):
        alloc.validate()
    alloc._refcount[1] -= 1
    alloc._free.append(1)
    with pytest.raises(ValueError, match="page 1: in 2 of used/free/cached"):
        alloc.validate()
    alloc._free.pop()
    alloc._seqs["a"].tokens[0] = 99
    with pytest.raises(ValueError, match="key chain broken"):
        alloc.validate()


def test_hand_over_with_the_device_free_stack():
    """End to end with the device side: prefill, fork copy, a jitted-style loop, settle."""
    import jax.numpy as jnp

    from paged import (
        append,
        copy_pages,
        ensure_next_page,
        init_paged_cache,
        make_free_stack,
        taken_pages,
        with_page_table,
    )

    size, width, num_pages = 2, 4, 12
    alloc = PageAllocator(num_pages, size, max_pages_per_seq=width)
    tokens = {"a": [1, 2, 3], "b": [4]}
    for seq, ids in tokens.items():
        alloc.admit(seq, ids)
    plan = alloc.fork("a", "c")
    tokens["c"] = list(tokens["a"])
    seqs = ["a", "b", "c"]
    # Prefill: token t's key is the value t, in its page slot.
    pool = np.zeros((1, 1, num_pages, size, 1), np.float32)
    for seq in ("a", "b"):
        pages = alloc.sequence_pages(seq)
        for position, token in enumerate(tokens[seq]):
            pool[0, 0, pages[position // size], position % size, 0] = token
    for seq in ("a", "b"):
        alloc.commit(seq)
    cache = init_paged_cache(1, 1, num_pages, size, 1, batch=3, max_pages_per_seq=width)
    cache = cache._replace(k_pages=jnp.asarray(pool), v_pages=jnp.asarray(pool))
    cache = with_page_table(cache, alloc.page_table(seqs), alloc.lengths(seqs))
    cache = copy_pages(cache, plan)  # the allocator's plan, as it is
    reserved = alloc.reserve(4)
    stack = make_free_stack(reserved)
    for step in range(3):
        cache, stack, ok = ensure_next_page(cache, stack)
        assert bool(ok.all())
        new = [10 * (row + 1) + step for row in range(3)]
        kv = jnp.asarray(new, jnp.float32).reshape(1, 3, 1, 1)  # [L, B, K, H]
        cache = append(cache, kv, kv)
        for seq, token in zip(seqs, new, strict=True):
            tokens[seq].append(token)
    taken, unused = taken_pages(stack, len(reserved))
    assert len(taken) == 3 and len(unused) == 1
    alloc.settle(
        seqs,
        np.asarray(cache.page_table),
        np.asarray(cache.lengths),
        unused=unused,
        token_ids=[None, tokens["b"][-3:], tokens["c"][-3:]],
    )
    alloc.validate()
    np.testing.assert_array_equal(alloc.page_table(seqs), np.asarray(cache.page_table))
    assert alloc.stats().pages_reserved == 0
    keys = np.asarray(cache.k_pages)
    for seq in seqs:
        pages = alloc.sequence_pages(seq)
        read = [keys[0, 0, pages[i // size], i % size, 0] for i in range(len(tokens[seq]))]
        assert read == tokens[seq], seq
    # c's tokens were given and written: a prompt equal to c plus one token hits 3 pages.
    assert alloc.admit("d", tokens["c"] + [0]).num_cached_tokens == 6


# ------------------------------------------------------------------ life cycle and scalars


def test_missed_commit_is_visible_in_stats():
    """admit -> write -> (no commit) -> free: nothing is cached, and stats say why."""
    alloc = PageAllocator(16, 2, max_pages_per_seq=4)
    alloc.admit("a", prompt(5))  # two full pages and a partial one
    stats = alloc.stats()
    assert (stats.tokens_uncommitted, stats.pages_uncommitted) == (5, 2)
    assert stats.pages_freed_uncommitted == 0
    alloc.free("a")  # commit missed
    stats = alloc.stats()
    assert stats.pages_freed_uncommitted == 2 and stats.pages_cached == 0
    assert alloc.admit("b", prompt(5)).num_cached_tokens == 0  # the miss it caused
    alloc.commit("b", 3)  # partial commit: one of two full pages
    stats = alloc.stats()
    assert (stats.tokens_uncommitted, stats.pages_uncommitted) == (2, 1)
    alloc.commit("b")
    stats = alloc.stats()
    assert (stats.tokens_uncommitted, stats.pages_uncommitted) == (0, 0)
    plan = alloc.extend("b", 6, token_ids=[5])  # a new token waits for its commit
    assert plan.pairs() == [] and alloc.stats().tokens_uncommitted == 1
    assert alloc.stats().pages_uncommitted == 1  # page 2 is now full and known
    alloc.free("b")
    assert alloc.stats().pages_freed_uncommitted == 3
    # Untracked sequences (no token ids) count tokens but no cacheable pages.
    alloc.allocate("c", 4)
    assert (alloc.stats().tokens_uncommitted, alloc.stats().pages_uncommitted) == (4, 0)
    alloc.validate()


def test_settle_counts_as_commit():
    alloc = PageAllocator(16, 2, max_pages_per_seq=4)
    alloc.admit("a", [1, 2, 3])
    stack = alloc.reserve(1)
    table = alloc.page_table(["a"])
    table[0, 2] = stack[0]
    alloc.settle(["a"], table, [5], token_ids=[[4, 5]])
    stats = alloc.stats()
    assert (stats.tokens_uncommitted, stats.pages_uncommitted) == (0, 0)


def test_numpy_integer_scalars_are_accepted_everywhere():
    alloc = PageAllocator(np.int64(16), np.int32(2), max_pages_per_seq=np.int16(4))
    assert isinstance(alloc.num_pages, int) and alloc.capacity == 8
    alloc.allocate("a", np.int32(3))
    alloc.admit("b", np.array([1, 2, 3], np.int64))
    alloc.commit("b", np.int64(2))
    alloc.extend("a", np.int32(4))
    alloc.fork("a", "c")
    assert alloc.reserve(np.uint8(2)).tolist() == [5, 6]
    table = alloc.page_table(["a"])
    alloc.settle(["a"], table, np.array([4], np.int64), unused=np.array([5, 6], np.int32))
    alloc.validate()


@pytest.mark.no_typecheck
@pytest.mark.parametrize("bad", [True, 3.0, np.float32(3.0), "3", None])
def test_int_arguments_reject_bools_floats_and_others(bad):
    alloc = PageAllocator(16, 2, max_pages_per_seq=4)
    alloc.admit("a", [1, 2, 3])
    before = snapshot(alloc)
    with pytest.raises(ValueError, match=r"PageAllocator.extend: new_length: expected"):
        alloc.extend("a", bad)
    with pytest.raises(ValueError, match=r"PageAllocator.allocate: length: expected"):
        alloc.allocate("b", bad)
    if bad is not None:
        with pytest.raises(ValueError, match=r"PageAllocator.commit: num_tokens: expected"):
            alloc.commit("a", bad)
    with pytest.raises(ValueError, match=r"PageAllocator.reserve: num: expected"):
        alloc.reserve(bad)
    with pytest.raises(ValueError, match=r"PageAllocator: num_pages: expected"):
        PageAllocator(bad, 2, max_pages_per_seq=4)
    assert snapshot(alloc) == before


def test_settle_accepts_device_arrays():
    import jax.numpy as jnp

    alloc = PageAllocator(16, 2, max_pages_per_seq=4)
    alloc.allocate("a", 2)
    stack = alloc.reserve(1)
    table = alloc.page_table(["a"])
    table[0, 1] = stack[0]
    alloc.settle(["a"], jnp.asarray(table), jnp.asarray([3]), unused=jnp.zeros((0,), jnp.int32))
    assert alloc.sequence_length("a") == 3
    alloc.validate()


def test_token_ids_may_be_numpy_or_jax_arrays():
    import jax.numpy as jnp

    alloc = PageAllocator(16, 2, max_pages_per_seq=4)
    alloc.admit("a", jnp.asarray([1, 2, 3]))
    alloc.extend("a", 4, token_ids=jnp.asarray([4]))
    alloc.commit("a")
    stack = alloc.reserve(1)
    table = alloc.page_table(["a"])
    table[0, 2] = stack[0]
    alloc.settle(["a"], table, [5], token_ids=[np.asarray([5])])
    assert alloc.admit("b", [1, 2, 3, 4, 5, 0]).num_cached_tokens == 4
    alloc.validate()


def test_release_pages_frees_only_pages_nobody_else_holds():
    alloc = PageAllocator(16, 2, max_pages_per_seq=4)
    alloc.admit("a", [1, 2, 3, 4, 5])
    alloc.commit("a")
    assert alloc.admit("b", [1, 2, 3, 4, 9]).num_cached_tokens == 4  # shares pages 1, 2
    shared = alloc.page_table(["a"])[0, :2].tolist()
    assert alloc.release_pages("b", [0, 1]).tolist() == []  # "a" still holds them
    assert alloc.page_table(["b"])[0, :2].tolist() == [NULL_PAGE, NULL_PAGE]
    assert alloc.lengths(["b"]).tolist() == [5]
    alloc.validate()
    assert alloc.release_pages("a", [1]).tolist() == [shared[1]]  # nobody holds it now
    alloc.validate()
    assert shared[1] not in alloc.page_table(["a", "b"])
    # The freed page left the prefix cache: a new prompt re-uses page 1 only.
    assert alloc.admit("c", [1, 2, 3, 4, 7]).num_cached_tokens == 2
    alloc.fork("b", "d")  # the child shares the emptied slots as empty
    assert alloc.page_table(["d"])[0, :2].tolist() == [NULL_PAGE, NULL_PAGE]
    alloc.validate()
    for seq in ("a", "b", "c", "d"):
        alloc.free(seq)
    alloc.validate()
    assert alloc.stats().pages_used == 0


@pytest.mark.no_typecheck
def test_release_pages_errors():
    alloc = PageAllocator(16, 2, max_pages_per_seq=4)
    alloc.allocate("a", 5)
    fn = "PageAllocator.release_pages"
    with pytest.raises(ValueError, match=f"{fn}: slots: expected slots in \\[0, 3\\)"):
        alloc.release_pages("a", [3])
    with pytest.raises(ValueError, match=f"{fn}: slots: expected no partial last page"):
        alloc.release_pages("a", [2])
    with pytest.raises(ValueError, match=f"{fn}: slots: expected distinct slots"):
        alloc.release_pages("a", [0, 0])
    with pytest.raises(ValueError, match=f"{fn}: slots: expected a 1-D list of ints"):
        alloc.release_pages("a", [0.5])
    with pytest.raises(ValueError, match=f"{fn}: seq"):
        alloc.release_pages("zz", [0])
    alloc.release_pages("a", [0])
    with pytest.raises(ValueError, match=f"{fn}: slots: expected slots still holding a page"):
        alloc.release_pages("a", [0])
    alloc.validate()
