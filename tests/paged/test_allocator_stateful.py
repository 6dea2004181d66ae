"""Property-based test of PageAllocator: random admit / extend / commit / fork / free /
reserve+settle sequences under memory pressure, against a shadow of the device's page contents.

The shadow ``device`` maps each page to the token ids "written" in its slots, following the
allocator's page tables and copy plans exactly as a device would. After every step:

* ``validate()`` passes (refcounts, no leak, null page, keys match recorded tokens);
* every sequence reads its own tokens back through its page table (so copy-on-write and
  eviction never clobbered a page someone still uses);
* every cached page's device contents equal the tokens its key was computed from;
* a failed operation (``OutOfPages``) left the state untouched.
"""

from collections import Counter

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged import NULL_PAGE, OutOfPages, PageAllocator
from tests.paged.test_allocator import snapshot

MAX_PAGES_PER_SEQ = 6
VOCAB = 5  # small, so independent prompts collide and share pages
FAMILIES = [list(np.random.default_rng(i).integers(0, VOCAB, 64)) for i in range(2)]


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(4, 24))
    def setup(self, page_size, num_pages):
        self.size = page_size
        self.alloc = PageAllocator(num_pages, page_size, max_pages_per_seq=MAX_PAGES_PER_SEQ)
        self.capacity = page_size * MAX_PAGES_PER_SEQ
        self.device: dict[int, list] = {p: [None] * page_size for p in range(num_pages)}
        self.truth: dict[int, list[int]] = {}
        self.reserved: list[int] = []
        self.next_id = 0

    # ---------------------------------------------------------------- helpers

    def new_id(self):
        self.next_id += 1
        return self.next_id

    def pick(self, index):
        live = sorted(self.truth)
        return live[index % len(live)]

    def write(self, seq, start, stop):
        pages = self.alloc.sequence_pages(seq)
        for position in range(start, stop):
            page = int(pages[position // self.size])
            assert page != NULL_PAGE
            self.device[page][position % self.size] = self.truth[seq][position]

    def apply_copies(self, plan):
        assert plan.src.dtype == plan.dst.dtype == np.int32
        for source, target in plan.pairs():
            self.device[target] = list(self.device[source])

    def expect_out_of_pages(self, call, length=None):
        """``length``: the sequence length a failure must add to the out-of-pages histogram."""
        before = snapshot(self.alloc)
        histogram = Counter(dict(self.alloc.stats().out_of_pages_lengths))
        try:
            return call(), False
        except OutOfPages as error:
            event("OutOfPages")
            assert error.requested > error.free + error.evictable
            assert snapshot(self.alloc) == before
            if length is not None:
                histogram[length] += 1
            assert dict(self.alloc.stats().out_of_pages_lengths) == dict(histogram)
            return None, True

    def read(self, seq):
        """The sequence's tokens through its pages; None at slots emptied by release_pages."""
        pages = self.alloc.sequence_pages(seq)
        length = self.alloc.sequence_length(seq)
        return [
            None if pages[i // self.size] == NULL_PAGE else self.device[int(pages[i // self.size])][i % self.size]
            for i in range(length)
        ]  # fmt: skip

    def expected(self, seq):
        """``truth`` with None at the released slots (what :meth:`read` must return)."""
        pages = self.alloc.sequence_pages(seq)
        return [None if pages[i // self.size] == NULL_PAGE else t for i, t in enumerate(self.truth[seq])]  # fmt: skip

    # ---------------------------------------------------------------- rules

    @rule(
        family=st.integers(0, len(FAMILIES)),
        length=st.integers(0, 16),
        salt=st.sampled_from([None, "tenant"]),
        partial_commit=st.booleans(),
    )
    def admit(self, family, length, salt, partial_commit):
        length = min(length, self.capacity)
        if family < len(FAMILIES):
            tokens = [int(t) for t in FAMILIES[family][:length]]
        else:
            tokens = [
                int(t) for t in np.random.default_rng(self.next_id).integers(0, VOCAB, length)
            ]
        seq = self.new_id()
        admission, failed = self.expect_out_of_pages(
            lambda: self.alloc.admit(seq, tokens, salt=salt), len(tokens)
        )
        if failed:
            return
        cached = admission.num_cached_tokens
        event("admit: prefix hit" if cached else "admit: miss")
        assert cached % self.size == 0 and (cached < length or length == 0)
        # Pages served from the cache must already hold this prompt's tokens.
        for i in range(admission.num_cached_pages):
            assert self.device[admission.page_ids[i]] == tokens[i * self.size : (i + 1) * self.size]
        self.truth[seq] = tokens
        self.write(seq, cached, length)
        self.alloc.commit(seq, cached + (length - cached) // 2 if partial_commit else length)

    @precondition(lambda self: self.truth)
    @rule(
        index=st.integers(0, 10**6),
        count=st.integers(0, 6),
        with_ids=st.booleans(),
        commit=st.booleans(),
    )
    def extend(self, index, count, with_ids, commit):
        self.grow(self.pick(index), count, with_ids, commit, seed=index)

    def grow(self, seq, count, with_ids, commit, *, seed):
        old = self.alloc.sequence_length(seq)
        new = min(old + count, self.capacity)
        tokens = [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, new - old)]
        record = self.alloc._seqs[seq]
        tracked = len(record.tokens) == record.length
        ids = tokens if with_ids and tracked else None
        plan, failed = self.expect_out_of_pages(
            lambda: self.alloc.extend(seq, new, token_ids=ids), new
        )
        if failed:
            return
        assert len(plan.src) <= 1
        if plan.pairs():
            event("extend: copy-on-write")
        self.apply_copies(plan)
        self.truth[seq] = self.truth[seq] + tokens
        self.write(seq, old, new)
        if commit:
            self.alloc.commit(seq)

    @precondition(lambda self: self.truth)
    @rule(
        index=st.integers(0, 10**6),
        count=st.integers(1, 3),
        extend_child=st.booleans(),
        with_ids=st.booleans(),
    )
    def lazy_fork_then_extend(self, index, count, extend_child, with_ids):
        parent = self.pick(index)
        child = self.next_id + 1
        self.fork(index, lazy=True)
        if child in self.truth:
            self.grow(child if extend_child else parent, count, with_ids, True, seed=index)

    @precondition(lambda self: self.truth)
    @rule(index=st.integers(0, 10**6), lazy=st.booleans())
    def fork(self, index, lazy):
        parent = self.pick(index)
        child = self.new_id()
        plan, failed = self.expect_out_of_pages(
            lambda: self.alloc.fork(parent, child, lazy=lazy), len(self.truth[parent])
        )
        if failed:
            return
        assert len(plan.src) == int(not lazy and len(self.truth[parent]) % self.size != 0)
        self.apply_copies(plan)
        self.truth[child] = list(self.truth[parent])

    @precondition(lambda self: self.truth)
    @rule(index=st.integers(0, 10**6))
    def free(self, index):
        seq = self.pick(index)
        self.alloc.free(seq)
        del self.truth[seq]

    @precondition(lambda self: self.truth)
    @rule(index=st.integers(0, 10**6), picks=st.lists(st.integers(0, 10**6), max_size=3))
    def release(self, index, picks):
        """Demotes some pages of a sequence; the freed ones are overwritten on the device."""
        seq = self.pick(index)
        pages = self.alloc.sequence_pages(seq)
        length = self.alloc.sequence_length(seq)
        partial = length % self.size != 0
        held = [
            i
            for i, p in enumerate(pages)
            if p != NULL_PAGE and not (partial and i == len(pages) - 1)
        ]
        if not held:
            return
        slots = sorted({held[i % len(held)] for i in picks})
        before = {int(pages[i]) for i in slots}
        freed = self.alloc.release_pages(seq, slots)
        assert set(freed.tolist()) <= before
        for table_seq in self.truth:  # a freed page is held by nobody
            assert not set(freed.tolist()) & set(self.alloc.sequence_pages(table_seq).tolist())
        for page in freed.tolist():
            self.device[page] = ["scrubbed"] * self.size
        if slots:
            event("released pages")

    @rule(count=st.integers(0, 4))
    def reserve(self, count):
        pages, failed = self.expect_out_of_pages(lambda: self.alloc.reserve(count))
        if not failed:
            assert len(set(pages.tolist()) | set(self.reserved)) == len(self.reserved) + count
            self.reserved += pages.tolist()

    @precondition(lambda self: self.truth or self.reserved)
    @rule(
        picks=st.lists(st.integers(0, 10**6), max_size=3),
        growth=st.lists(st.integers(0, 5), min_size=3, max_size=3),
        with_ids=st.booleans(),
        keep=st.integers(0, 2),
    )
    def decode_loop(self, picks, growth, with_ids, keep):
        """Simulates a jitted decode loop popping pages from the device stack, then settles."""
        seqs = sorted({self.pick(i) for i in picks}) if self.truth else []
        stack = list(self.reserved)
        table = self.alloc.page_table(seqs)
        lengths = self.alloc.lengths(seqs)
        appended = []
        for row, seq in enumerate(seqs):
            old = int(lengths[row])
            pages = self.alloc.sequence_pages(seq)
            shared_tail = old % self.size and self.alloc._refcount[int(pages[-1])] > 1
            new = old if shared_tail else min(old + growth[row], self.capacity)
            rng = np.random.default_rng(old + row)
            tokens = [int(t) for t in rng.integers(0, VOCAB, new - old)]
            for position in range(old, new):
                slot = position // self.size
                if slot >= len(pages) and table[row, slot] == NULL_PAGE:
                    if not stack:  # the device stack ran dry: this sequence stops
                        new = position
                        tokens = tokens[: new - old]
                        break
                    table[row, slot] = stack.pop()
                page = int(table[row, slot])
                self.device[page][position % self.size] = tokens[position - old]
            lengths[row] = new
            self.truth[seq] = self.truth[seq] + tokens
            record = self.alloc._seqs[seq]
            tracked = len(record.tokens) == record.length
            appended.append(tokens if with_ids and tracked else None)
        unused, self.reserved = stack[keep:], stack[:keep]
        self.alloc.settle(seqs, table, lengths, unused=unused, token_ids=appended)
        for seq, tokens in zip(seqs, appended, strict=True):
            record = self.alloc._seqs[seq]
            if tokens is not None:  # all written and known: every full page has its key
                assert len(record.hashes) == record.length // self.size

    # ---------------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        if not hasattr(self, "alloc"):
            return
        self.alloc.validate()
        for seq, tokens in self.truth.items():
            assert len(tokens) == self.alloc.sequence_length(seq)
            assert self.read(seq) == self.expected(seq), f"sequence {seq} reads back wrong tokens"
        for page, entry in self.alloc._index.items():
            assert tuple(self.device[page]) == entry.tokens, f"cached page {page} contents"
        stats = self.alloc.stats()
        if stats.evictions:
            event("evictions happened")
        assert stats.pages_used + stats.pages_free + stats.pages_cached == stats.num_pages
        assert stats.pages_reserved == len(self.reserved)
        assert 0.0 <= stats.prefix_hit_rate <= 1.0 and 0.0 <= stats.waste < 1.0
        assert 0 <= stats.tokens_uncommitted <= stats.tokens_logical
        assert stats.pages_uncommitted >= 0 and stats.pages_freed_uncommitted >= 0
        assert stats.num_sequences == len(self.truth)


AllocatorMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorMachine = AllocatorMachine.TestCase
