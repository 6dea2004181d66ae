"""The allocator's pool state and the internal moves every public operation is built from.

:class:`PoolState` owns the free list, the reference counts, the live sequences, the device
reserve and the :class:`~paged._prefix.PrefixIndex`. Its private methods check arguments
(raising ``ValueError`` in the package's one format) and move pages between the states
*free*, *used* and *cached*; its public methods are the read-only queries (``page_table``,
``lengths``, ``sequence_pages``...). The other public operations live in :mod:`paged._allocator` (life
cycle), :mod:`paged._handover` (device hand-over) and :mod:`paged._metrics` (stats, validate).
"""

import dataclasses
from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np
from jaxtyping import Int

from paged._checks import host_int_array, int_option, is_int
from paged._prefix import CachedPage, PrefixIndex, hash_page

__all__ = ["NULL_PAGE", "OutOfPages", "PoolState"]

NULL_PAGE = 0
"""Page id 0: never handed out; padding slots of a page table point to it."""


class OutOfPages(RuntimeError):
    """The pool cannot satisfy a request; the allocator's pool state is left untouched.

    Only the failure itself is recorded: the requested sequence length goes into
    ``PageAllocator.stats().out_of_pages_lengths`` (``reserve`` failures are not recorded).

    Attributes:
      requested: pages the operation needed.
      free: pages on the free list.
      evictable: cached pages no sequence references (usable after eviction).
    """

    def __init__(self, what: str, *, requested: int, free: int, evictable: int):
        self.requested = requested
        self.free = free
        self.evictable = evictable
        super().__init__(
            f"{what}: out of pages: requested {requested}, free {free}, evictable {evictable}"
        )


@dataclasses.dataclass
class _Sequence:
    pages: list[int]
    length: int
    tokens: list[int]  # known token ids: a prefix of the sequence (all of it when tracked)
    written: int  # leading tokens whose KV is on the device (commit / settle)
    hashes: list[bytes]  # chain keys of the first min(written, len(tokens)) // C pages
    salt: bytes | None


class PoolState:
    """Pool bookkeeping shared by the allocator's operations (see :class:`paged.PageAllocator`)."""

    def __init__(self, num_pages, page_size, *, max_pages_per_seq):
        fn = "PageAllocator"
        if not is_int(num_pages) or num_pages < 2:
            raise ValueError(
                f"{fn}: num_pages: expected an int >= 2 (page 0 is null), got {num_pages!r}"
            )
        # Any positive C, the rule of init_paged_cache and the XLA kernels (the Pallas GPU
        # decode states its own, a power of two >= 16, when impl="pallas" asks for it).
        int_option(fn, "page_size", page_size, minimum=1)
        int_option(fn, "max_pages_per_seq", max_pages_per_seq, minimum=1)
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.max_pages_per_seq = int(max_pages_per_seq)
        self.capacity = self.page_size * self.max_pages_per_seq
        # Popped from the end, so pages are first handed out in increasing order.
        self._free: list[int] = list(range(self.num_pages - 1, NULL_PAGE, -1))
        self._refcount: list[int] = [0] * self.num_pages
        self._seqs: dict[Hashable, _Sequence] = {}
        self._reserved: set[int] = set()
        self._index = PrefixIndex()
        self._tokens_admitted = 0
        self._tokens_hit = 0
        self._evictions = 0
        self._pages_freed_uncommitted = 0
        # Requested sequence length (tokens) -> number of requests that hit OutOfPages.
        self._out_of_pages_lengths: Counter[int] = Counter()

    # ------------------------------------------------------------------ queries

    @property
    def sequences(self) -> tuple[Hashable, ...]:
        """Live sequence ids, in creation order."""
        return tuple(self._seqs)

    def __contains__(self, seq) -> bool:
        try:
            return seq in self._seqs
        except TypeError:
            return False

    def sequence_length(self, seq: Hashable) -> int:
        """Tokens stored for ``seq``."""
        return self._get("PageAllocator.sequence_length", seq, "seq").length

    def sequence_pages(self, seq: Hashable) -> Int[np.ndarray, " n"]:
        """Pages of ``seq`` in order, ``ceil(length / C)`` int32 ids (0 at slots emptied by
        :meth:`PageAllocator.release_pages`)."""
        record = self._get("PageAllocator.sequence_pages", seq, "seq")
        return np.asarray(record.pages, dtype=np.int32)

    def page_table(self, seqs: Sequence[Hashable]) -> Int[np.ndarray, "B M"]:
        """Page table of a batch, padded with the null page.

        Args:
          seqs: ``B`` distinct live sequence ids; ``None`` for an empty row (a batch slot with
            no admitted sequence: all null pages, length 0; pass ``active=`` to
            :func:`paged.ensure_next_page` so a decode loop does not give it pages).

        Returns:
          ``[B, M]`` int32; row ``b`` holds ``seqs[b]``'s pages, then zeros.

        Raises:
          ValueError: on an unknown or repeated id.

        Example:
          >>> from paged import PageAllocator
          >>> alloc = PageAllocator(8, 4, max_pages_per_seq=3)
          >>> _ = alloc.allocate(7, 5)
          >>> alloc.page_table([7]).tolist()
          [[1, 2, 0]]
        """
        records = self._batch("PageAllocator.page_table", seqs)
        table = np.zeros((len(records), self.max_pages_per_seq), dtype=np.int32)
        for row, record in enumerate(records):
            if record is not None:
                table[row, : len(record.pages)] = record.pages
        return table

    def lengths(self, seqs: Sequence[Hashable]) -> Int[np.ndarray, " B"]:
        """Lengths of a batch as ``[B]`` int32, 0 for a ``None`` row (see :meth:`page_table`).

        Example:
          >>> from paged import PageAllocator
          >>> alloc = PageAllocator(8, 4, max_pages_per_seq=3)
          >>> _ = alloc.allocate(7, 5)
          >>> alloc.lengths([7]).tolist()
          [5]
        """
        return np.asarray(
            [0 if r is None else r.length for r in self._batch("PageAllocator.lengths", seqs)],
            dtype=np.int32,
        )

    # ------------------------------------------------------------------ argument checks

    def _get(self, fn: str, seq, name: str) -> _Sequence:
        try:
            return self._seqs[seq]
        except KeyError:
            raise ValueError(f"{fn}: {name}: expected a live sequence id, got {seq!r}") from None
        except TypeError:
            raise ValueError(f"{fn}: {name}: expected a hashable id, got {seq!r}") from None

    def _check_new(self, fn: str, seq, name: str) -> None:
        try:
            hash(seq)
        except TypeError:
            raise ValueError(f"{fn}: {name}: expected a hashable id, got {seq!r}") from None
        if seq is None:
            raise ValueError(
                f"{fn}: {name}: expected an id other than None (None is an empty row of a batch "
                "in page_table, lengths and settle), got None"
            )
        if seq in self._seqs:
            raise ValueError(
                f"{fn}: {name}: expected a new id, got duplicate sequence {seq!r} (already live)"
            )

    def _batch(self, fn: str, seqs) -> list[_Sequence | None]:
        """The records of ``seqs``; ``None`` (an empty row of the batch) gives None."""
        seqs = list(seqs)
        records = [
            None if seq is None else self._get(fn, seq, f"seqs[{i}]") for i, seq in enumerate(seqs)
        ]
        real = [id(r) for r in records if r is not None]
        if len(set(real)) != len(real):
            raise ValueError(f"{fn}: seqs: expected distinct sequence ids, got {seqs!r}")
        return records

    def _check_length(self, fn: str, length, name: str) -> int:
        if not is_int(length) or length < 0:
            raise ValueError(f"{fn}: {name}: expected a non-negative int, got {length!r}")
        if length > self.capacity:
            raise ValueError(
                f"{fn}: {name}: expected at most M * C = {self.max_pages_per_seq} * "
                f"{self.page_size} = {self.capacity} tokens (the capacity), got {length}"
            )
        return int(length)

    @staticmethod
    def _check_tokens(fn: str, token_ids, name: str) -> list[int]:
        array = host_int_array(fn, name, token_ids, 1)
        if array.size and array.min() < 0:
            raise ValueError(
                f"{fn}: {name}: expected non-negative token ids, got min {array.min()}"
            )
        return array.tolist()

    def _check_appended(self, fn: str, record, token_ids, new_length, seq, name: str) -> list[int]:
        tokens = self._check_tokens(fn, token_ids, name)
        if len(tokens) != new_length - record.length:
            raise ValueError(
                f"{fn}: {name}: expected {new_length - record.length} ids (new length minus "
                f"current length of {seq!r}), got {len(tokens)}"
            )
        if len(record.tokens) != record.length:
            raise ValueError(
                f"{fn}: {name}: expected no ids for {seq!r}, which has untracked tokens "
                "(extended without token ids; its later token ids cannot be recorded), "
                f"got {len(tokens)}"
            )
        return tokens

    # ------------------------------------------------------------------ page moves

    def _needs_copy(self, record: _Sequence, new_length: int) -> bool:
        return (
            new_length > record.length
            and record.length % self.page_size != 0
            and self._refcount[record.pages[-1]] > 1
        )

    def _check_available(
        self, count: int, what: str, *, reviving: int = 0, length: int | None = None
    ) -> None:
        """Raises :class:`OutOfPages` when ``count`` pages are not available.

        ``length`` is the sequence length (tokens) the failing request asked for; it is the one
        thing a failure records (``stats().out_of_pages_lengths``); ``None`` records nothing
        (the device reserve is not a request).
        """
        evictable = self._index.num_evictable - reviving
        if count > len(self._free) + evictable:
            if length is not None:
                self._out_of_pages_lengths[length] += 1
            raise OutOfPages(what, requested=count, free=len(self._free), evictable=evictable)

    def _pop(self, count: int) -> list[int]:
        """Takes ``count`` pages (free list first, then LRU eviction); caller checked room."""
        take = min(count, len(self._free))
        pages = self._free[len(self._free) - take :][::-1]
        del self._free[len(self._free) - take :]
        for _ in range(count - take):
            pages.append(self._index.evict_oldest())
            self._evictions += 1
        for page in pages:
            self._refcount[page] = 1
        return pages

    def _release(self, page: int) -> None:
        if page == NULL_PAGE:  # a slot emptied by release_pages
            return
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            if self._index.is_keyed(page):
                self._index.park(page)
            else:
                self._free.append(page)

    def _uncommitted_pages(self, record: _Sequence) -> int:
        """Full pages whose token ids are known but which no commit keyed yet."""
        return min(record.length, len(record.tokens)) // self.page_size - len(record.hashes)

    def _key_full_pages(self, record: _Sequence) -> None:
        size = self.page_size
        for i in range(len(record.hashes), min(record.written, len(record.tokens)) // size):
            parent = record.hashes[-1] if record.hashes else None
            tokens = tuple(record.tokens[i * size : (i + 1) * size])
            key = hash_page(parent, tokens, record.salt)
            record.hashes.append(key)
            page = record.pages[i]
            if page != NULL_PAGE and not self._index.is_keyed(page):
                # False when an identical page is already cached: this one stays unkeyed.
                self._index.insert(page, CachedPage(key, parent, tokens, record.salt))
