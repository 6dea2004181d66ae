"""Pool metrics and the eager invariant check of the allocator.

:class:`AllocatorStats` is a snapshot of usage, waste, prefix-cache hits and of what is still
waiting for a :meth:`paged.PageAllocator.commit` (a missed commit shows there). ``validate``
checks every invariant of the pool and raises ``ValueError`` naming the first broken one.
"""

import dataclasses
from collections import Counter

from paged._pool import NULL_PAGE, PoolState
from paged._prefix import hash_page

__all__ = ["AllocatorStats", "PoolMetrics"]

_PAGE_TABLE_ENTRY_BYTES = 4  # int32


@dataclasses.dataclass(frozen=True)
class AllocatorStats:
    """A snapshot of pool usage (see :meth:`PageAllocator.stats`).

    Attributes:
      num_pages: usable pages ``P - 1`` (the null page excluded).
      pages_used: pages referenced by a sequence or the device reserve.
      pages_free: pages on the free list.
      pages_cached: cached pages no sequence references (evictable); ``used + free + cached ==
        num_pages``.
      pages_reserved: pages handed to the device by :meth:`PageAllocator.reserve`, not settled.
      pages_shared: pages referenced more than once.
      num_sequences: live sequences.
      tokens_stored: token slots filled in the pages sequences hold, each physical page once.
      tokens_logical: sum of sequence lengths (shared pages counted once per holder).
      waste: ``(allocated slots - tokens_stored) / allocated slots`` over the pages sequences
        hold (reserve and cached pages excluded); 0 when none.
      tokens_admitted: prompt tokens seen by :meth:`PageAllocator.admit`.
      tokens_hit: of those, tokens served from the prefix cache (recomputed ones excluded).
      prefix_hit_rate: ``tokens_hit / tokens_admitted`` (0 when nothing was admitted).
      evictions: cached pages evicted so far to satisfy allocations.
      page_table_bytes: int32 page-table entries the live sequences actually need, in bytes.
      page_table_bytes_padded: bytes of the padded ``[B, M]`` table for all live sequences.
      tokens_uncommitted: tokens of live sequences not yet reported written on the device
        (by :meth:`PageAllocator.commit` or :meth:`PageAllocator.settle`); non-zero between
        a write and its commit, and forever if a commit is missed.
      pages_uncommitted: full pages of live sequences whose token ids are known but which no
        commit has keyed yet: they cannot serve prefix-cache hits until committed.
      pages_freed_uncommitted: such pages freed before any commit, so far (prefix-cache hits
        lost to missed commits).
      page_table_bytes_max: int32 page-table entries of the longest live sequence, in bytes
        (the article's rule 10 watches one request's table); 0 without sequences.
      out_of_pages_lengths: ``(length, count)`` pairs sorted by length: how many ``allocate``,
        ``admit``, ``extend`` and ``fork`` calls asked for a sequence of ``length`` tokens and
        raised :class:`OutOfPages`, so far (the article's rule 12: a histogram of the lengths
        of requests that ran out of memory). Exact, and bounded by the ``M * C + 1`` possible
        lengths. ``reserve`` failures (not a request) are not counted.
    """

    num_pages: int
    pages_used: int
    pages_free: int
    pages_cached: int
    pages_reserved: int
    pages_shared: int
    num_sequences: int
    tokens_stored: int
    tokens_logical: int
    waste: float
    tokens_admitted: int
    tokens_hit: int
    prefix_hit_rate: float
    evictions: int
    page_table_bytes: int
    page_table_bytes_padded: int
    tokens_uncommitted: int
    pages_uncommitted: int
    pages_freed_uncommitted: int
    page_table_bytes_max: int = 0
    out_of_pages_lengths: tuple[tuple[int, int], ...] = ()

    @property
    def out_of_pages(self) -> int:
        """Requests that raised :class:`OutOfPages` so far (the sum of the histogram)."""
        return sum(count for _, count in self.out_of_pages_lengths)


class PoolMetrics(PoolState):
    """``stats`` / ``validate`` of the allocator."""

    def stats(self) -> AllocatorStats:
        """Current pool usage, waste and prefix-cache metrics.

        Example:
          >>> from paged import PageAllocator
          >>> alloc = PageAllocator(8, 4, max_pages_per_seq=4)
          >>> _ = alloc.allocate(0, 5)
          >>> s = alloc.stats()
          >>> s.pages_used, s.tokens_stored, s.waste, s.page_table_bytes
          (2, 5, 0.375, 8)
          >>> _ = alloc.admit(1, [7, 8, 9, 10, 11])  # ... and no commit(1) yet:
          >>> alloc.stats().tokens_uncommitted, alloc.stats().pages_uncommitted
          (10, 1)
        """
        size = self.page_size
        fill: dict[int, int] = {}
        entries = 0
        for record in self._seqs.values():
            entries += len(record.pages)
            full = record.length // size
            for i, page in enumerate(record.pages):
                if page == NULL_PAGE:  # emptied by release_pages
                    continue
                # Holders of a shared page agree on its fill except for stale partial pages.
                amount = size if i < full else record.length - full * size
                if fill.get(page, -1) < amount:
                    fill[page] = amount
        slots = len(fill) * size
        stored = sum(fill.values())
        evictable = self._index.num_evictable
        free = len(self._free)
        return AllocatorStats(
            num_pages=self.num_pages - 1,
            pages_used=self.num_pages - 1 - free - evictable,
            pages_free=free,
            pages_cached=evictable,
            pages_reserved=len(self._reserved),
            pages_shared=sum(1 for count in self._refcount if count > 1),
            num_sequences=len(self._seqs),
            tokens_stored=stored,
            tokens_logical=sum(r.length for r in self._seqs.values()),
            waste=(slots - stored) / slots if slots else 0.0,
            tokens_admitted=self._tokens_admitted,
            tokens_hit=self._tokens_hit,
            prefix_hit_rate=(
                self._tokens_hit / self._tokens_admitted if self._tokens_admitted else 0.0
            ),
            evictions=self._evictions,
            page_table_bytes=entries * _PAGE_TABLE_ENTRY_BYTES,
            page_table_bytes_padded=(
                len(self._seqs) * self.max_pages_per_seq * _PAGE_TABLE_ENTRY_BYTES
            ),
            tokens_uncommitted=sum(r.length - r.written for r in self._seqs.values()),
            pages_uncommitted=sum(self._uncommitted_pages(r) for r in self._seqs.values()),
            pages_freed_uncommitted=self._pages_freed_uncommitted,
            page_table_bytes_max=max(
                (len(r.pages) * _PAGE_TABLE_ENTRY_BYTES for r in self._seqs.values()), default=0
            ),
            out_of_pages_lengths=tuple(sorted(self._out_of_pages_lengths.items())),
        )

    def validate(self) -> None:
        """Checks every invariant eagerly (for tests and notebooks; O(pool + tokens)).

        Checked: reference counts equal the holders (sequences + reserve); every non-null page
        is exactly one of free / used / cached, so nothing leaks; the null page is never held;
        keyed pages' keys match their recorded tokens and each holder's tokens and chain;
        partial pages are never keyed; lengths, page counts and written counts agree.

        Raises:
          ValueError: naming the first broken invariant (``"PageAllocator.validate: ..."``).
        """
        fn = "PageAllocator.validate"
        size = self.page_size
        holders: Counter[int] = Counter(self._reserved)
        for seq, record in self._seqs.items():
            if not 0 <= record.written <= record.length <= self.capacity:
                raise ValueError(f"{fn}: {seq!r}: written/length out of range")
            if len(record.pages) != -(-record.length // size):
                raise ValueError(f"{fn}: {seq!r}: {len(record.pages)} pages for {record.length}")
            held = [page for page in record.pages if page != NULL_PAGE]
            if len(set(held)) != len(held):
                raise ValueError(f"{fn}: {seq!r}: holds a page twice")
            if len(record.tokens) > record.length:
                raise ValueError(f"{fn}: {seq!r}: more token ids than tokens")
            known = min(record.written, len(record.tokens)) // size
            if len(record.hashes) != known:
                raise ValueError(f"{fn}: {seq!r}: {len(record.hashes)} keys, expected {known}")
            parent = None
            for i, page in enumerate(record.pages):
                tokens = tuple(record.tokens[i * size : (i + 1) * size])
                if i < known:
                    key = hash_page(parent, tokens, record.salt)
                    if key != record.hashes[i]:
                        raise ValueError(f"{fn}: {seq!r}: key chain broken at page {i}")
                    parent = key
                entry = self._index.entry(page)
                if entry is None:
                    continue
                if (i + 1) * size > record.length:
                    raise ValueError(f"{fn}: {seq!r}: partial page {page} is keyed")
                if i < known and entry.key != record.hashes[i]:
                    raise ValueError(f"{fn}: {seq!r}: page {page} keyed for other contents")
                if len(tokens) == size and (entry.tokens != tokens or entry.salt != record.salt):
                    raise ValueError(
                        f"{fn}: {seq!r}: page {page} cached tokens differ from its own"
                    )
            holders.update(held)
        if holders.get(NULL_PAGE) or self._refcount[NULL_PAGE] or self._index.is_keyed(NULL_PAGE):
            raise ValueError(f"{fn}: the null page is held, counted or keyed")
        if NULL_PAGE in self._free:
            raise ValueError(f"{fn}: the null page is on the free list")
        free = set(self._free)
        if len(free) != len(self._free):
            raise ValueError(f"{fn}: a page is on the free list twice")
        evictable = set(self._index.evictable_pages())
        for page in range(1, self.num_pages):
            count = self._refcount[page]
            if count != holders.get(page, 0):
                raise ValueError(f"{fn}: page {page}: refcount {count}, holders {holders[page]}")
            states = (count > 0) + (page in free) + (page in evictable)
            if states != 1:
                raise ValueError(f"{fn}: page {page}: in {states} of used/free/cached")
            if count == 0 and self._index.is_keyed(page) != (page in evictable):
                raise ValueError(f"{fn}: page {page}: unreferenced keyed page not in the LRU")
        for page in self._reserved:
            if self._refcount[page] != 1:
                raise ValueError(f"{fn}: reserved page {page} is also held by a sequence")
        self._index.validate()
