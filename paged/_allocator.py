"""Host-side page allocator: free list, reference counts, prefix caching, forks and metrics.

This is bookkeeping that cannot be static-shaped, so it is a small plain-Python class (not
jitted). Its outputs are what the device-side ``PagedKVCache`` consumes: a page table
``[B, M] int32`` padded with the null page 0, and lengths ``[B] int32``; its copy plans are
``(src, dst)`` page pairs for the device ``copy_pages``.
"""

import dataclasses
from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np
from jaxtyping import Int

from paged._prefix import CachedPage, PrefixIndex, hash_page, normalize_salt

__all__ = ["NULL_PAGE", "Admission", "AllocatorStats", "OutOfPages", "PageAllocator"]

NULL_PAGE = 0
"""Page id 0: never handed out; padding slots of a page table point to it."""

_PAGE_TABLE_ENTRY_BYTES = 4  # int32


class OutOfPages(RuntimeError):
    """The pool cannot satisfy a request; the allocator's state is left untouched.

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


@dataclasses.dataclass(frozen=True)
class Admission:
    """Result of :meth:`PageAllocator.admit`.

    Attributes:
      seq: the new sequence's id.
      page_ids: its pages, in order (the first ``num_cached_pages`` came from the cache).
      num_tokens: prompt length.
      num_cached_tokens: leading tokens whose KV is already in the cache (page-aligned, and
        always ``< num_tokens`` when ``num_tokens > 0``): the prefill computes only the rest.
      page_size: ``C``.
    """

    seq: Hashable
    page_ids: tuple[int, ...]
    num_tokens: int
    num_cached_tokens: int
    page_size: int

    @property
    def num_cached_pages(self) -> int:
        return self.num_cached_tokens // self.page_size

    @property
    def num_new_tokens(self) -> int:
        return self.num_tokens - self.num_cached_tokens


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


@dataclasses.dataclass
class _Sequence:
    pages: list[int]
    length: int
    tokens: list[int]  # known token ids: a prefix of the sequence (all of it when tracked)
    written: int  # leading tokens whose KV is on the device
    hashes: list[bytes]  # chain keys of the first min(written, len(tokens)) // C pages
    salt: bytes | None


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int_array(x, name: str, ndim: int) -> np.ndarray:
    array = np.asarray(x)
    if array.size == 0 and array.dtype.kind not in "iu":
        array = array.astype(np.int64)
    if array.ndim != ndim or array.dtype.kind not in "iu":
        raise ValueError(
            f"{name}: expected a {ndim}-D integer array, got shape {array.shape} "
            f"dtype {array.dtype}"
        )
    return array


class PageAllocator:
    """Host-side allocator of KV pages with prefix caching, copy-on-write forks and metrics.

    Page ``0`` (:data:`NULL_PAGE`) is reserved: it is never handed out, and page-table padding
    points to it (device writes to it are dropped). Every other page is in exactly one state:
    *free* (on the free list), *used* (referenced by sequences and/or the device reserve; the
    reference count equals the number of holders) or *cached* (a keyed full page nobody
    references, kept in an LRU and evicted only when the free list is empty).

    Sequence lifecycle (``seq`` is any hashable id)::

        adm = alloc.admit(seq, prompt_ids, salt=tenant)   # reuse cached prefix, allocate rest
        # device: prefill tokens adm.num_cached_tokens: into alloc.page_table([seq])
        alloc.commit(seq)                 # KV written: full pages become cached (keyed)
        copies = alloc.extend(seq, n + 1, token_ids=[t])  # room for one more token
        # device: copy_pages(copies), then write token t's KV; then alloc.commit(seq)
        copies = alloc.fork(seq, child)   # child shares full pages; partial page copied
        alloc.free(seq)                   # keyed pages stay cached, others return to free

    ``allocate(seq, length)`` creates a sequence without token ids (nothing cached). Keys
    need token ids: a sequence extended once without ``token_ids`` stops being cacheable
    from that point on.

    Copy-on-write: an operation that would write into a page someone else also holds
    returns the ``(src, dst)`` pairs the caller must copy on the device *before* writing. A
    full page is never written again, so sharing full pages is free; ``fork(lazy=True)`` also
    shares the partial last page and defers its copy to the first ``extend`` of either holder.

    Device hand-over for a jitted multi-step decode loop:

    1. ``pages = alloc.reserve(n)``: n free pages go to the device's free-page stack; they
       count as used, owned by the reserve.
    2. The loop pops pages from that stack and appends them to page-table rows as sequences
       cross page boundaries, writing each step's KV. A sequence entering the loop must own
       its last partial page (true unless it came from ``fork(lazy=True)`` and was not
       extended since).
    3. ``alloc.settle(seqs, page_table, lengths, unused=rest, token_ids=new_ids)``: for each
       row the pages past the sequence's old ones (up to ``ceil(length / C)``) must come from
       the reserve and join the sequence; every token up to ``lengths`` counts as written;
       ``unused`` reserved pages return to the free list. Reserved pages that are neither
       used nor returned stay reserved for a later loop.

    Every bad argument raises ``ValueError``; a pool too small raises :class:`OutOfPages`.
    Both leave the state untouched. :meth:`validate` checks every invariant eagerly.

    Args:
      num_pages: ``P``, pages in the pool including the null page; ``>= 2``.
      page_size: ``C``, tokens per page; a power of two.
      max_pages_per_seq: ``M``, page-table width; a sequence holds at most ``M * C`` tokens.

    Raises:
      ValueError: on a bad ``num_pages``, ``page_size`` or ``max_pages_per_seq``.

    Example:
      >>> alloc = PageAllocator(8, 4, max_pages_per_seq=4)
      >>> alloc.admit("a", [1, 2, 3, 4, 5]).num_cached_tokens
      0
      >>> alloc.commit("a")
      >>> alloc.admit("b", [1, 2, 3, 4, 9]).num_cached_tokens
      4
      >>> alloc.page_table(["a", "b"]).tolist()
      [[1, 2, 0, 0], [1, 3, 0, 0]]
    """

    def __init__(self, num_pages: int, page_size: int, *, max_pages_per_seq: int):
        if not _is_int(num_pages) or num_pages < 2:
            raise ValueError(f"num_pages: expected an int >= 2 (page 0 is null), got {num_pages!r}")
        if not _is_int(page_size) or page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size: expected a power of two >= 1, got {page_size!r}")
        if not _is_int(max_pages_per_seq) or max_pages_per_seq < 1:
            raise ValueError(f"max_pages_per_seq: expected an int >= 1, got {max_pages_per_seq!r}")
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
        return self._get(seq, "seq").length

    def sequence_pages(self, seq: Hashable) -> Int[np.ndarray, " n"]:
        """Pages of ``seq`` in order, ``ceil(length / C)`` int32 ids."""
        return np.asarray(self._get(seq, "seq").pages, dtype=np.int32)

    def page_table(self, seqs: Sequence[Hashable]) -> Int[np.ndarray, "B M"]:
        """Page table of a batch, padded with the null page.

        Args:
          seqs: ``B`` distinct live sequence ids.

        Returns:
          ``[B, M]`` int32; row ``b`` holds ``seqs[b]``'s pages, then zeros.

        Raises:
          ValueError: on an unknown or repeated id.

        Example:
          >>> alloc = PageAllocator(8, 4, max_pages_per_seq=3)
          >>> _ = alloc.allocate(7, 5)
          >>> alloc.page_table([7]).tolist()
          [[1, 2, 0]]
        """
        records = self._batch(seqs)
        table = np.zeros((len(records), self.max_pages_per_seq), dtype=np.int32)
        for row, record in enumerate(records):
            table[row, : len(record.pages)] = record.pages
        return table

    def lengths(self, seqs: Sequence[Hashable]) -> Int[np.ndarray, " B"]:
        """Lengths of a batch as ``[B]`` int32 (see :meth:`page_table` for errors).

        Example:
          >>> alloc = PageAllocator(8, 4, max_pages_per_seq=3)
          >>> _ = alloc.allocate(7, 5)
          >>> alloc.lengths([7]).tolist()
          [5]
        """
        return np.asarray([r.length for r in self._batch(seqs)], dtype=np.int32)

    # ------------------------------------------------------------------ lifecycle

    def allocate(
        self, seq: Hashable, length: int, *, salt: str | bytes | None = None
    ) -> Int[np.ndarray, " n"]:
        """Creates a sequence of ``length`` tokens with fresh pages and no token ids.

        Without token ids its pages are never cached; use :meth:`admit` for prompts. A sequence
        allocated with ``length == 0`` can still be tracked by extending it with ``token_ids``.

        Args:
          seq: a new hashable id.
          length: tokens to make room for, ``0 <= length <= M * C``.
          salt: tenant salt (``str`` or ``bytes``) used for the keys of its future pages.

        Returns:
          The ``ceil(length / C)`` new page ids, int32.

        Raises:
          ValueError: duplicate or unhashable ``seq``, bad ``length`` or ``salt``.
          OutOfPages: the pool cannot provide the pages.

        Example:
          >>> PageAllocator(8, 4, max_pages_per_seq=3).allocate("x", 9).tolist()
          [1, 2, 3]
        """
        self._check_new(seq, "seq")
        length = self._check_length(length, "length")
        salt_bytes = normalize_salt(salt)
        count = -(-length // self.page_size)
        self._check_available(count, f"allocate({seq!r})")
        pages = self._pop(count)
        self._seqs[seq] = _Sequence(pages, length, [], 0, [], salt_bytes)
        return np.asarray(pages, dtype=np.int32)

    def admit(
        self,
        seq: Hashable,
        token_ids: Int[np.ndarray, " T"] | Sequence[int],
        *,
        salt: str | bytes | None = None,
    ) -> Admission:
        """Creates a sequence for a prompt, reusing the longest cached page-aligned prefix.

        At most ``ceil(T / C) - 1`` pages (and so at most ``T - 1`` tokens) come from the
        cache: at least one token, the whole last page, is always computed, so a fully
        cached prompt still recomputes its last page. Those recomputed tokens do not count
        as hits.

        Args:
          seq: a new hashable id.
          token_ids: ``[T]`` non-negative token ids, ``T <= M * C``.
          salt: tenant salt; prompts under different salts share no pages.

        Returns:
          An :class:`Admission` (pages, ``num_cached_tokens``).

        Raises:
          ValueError: duplicate ``seq``, bad ``token_ids`` or ``salt``, ``T > M * C``.
          OutOfPages: the pool cannot provide the uncached pages.

        Example:
          >>> alloc = PageAllocator(8, 2, max_pages_per_seq=4)
          >>> alloc.admit(0, [5, 6, 7]).page_ids
          (1, 2)
        """
        self._check_new(seq, "seq")
        tokens = self._check_tokens(token_ids, "token_ids")
        self._check_length(len(tokens), "len(token_ids)")
        salt_bytes = normalize_salt(salt)
        size = self.page_size
        count = -(-len(tokens) // size)
        hits: list[int] = []
        hashes: list[bytes] = []
        for i in range(max(count - 1, 0)):
            key = hash_page(
                hashes[-1] if hashes else None, tokens[i * size : (i + 1) * size], salt_bytes
            )
            page = self._index.lookup(key)
            if page is None:
                break
            hits.append(page)
            hashes.append(key)
        reviving = sum(self._index.is_evictable(page) for page in hits)
        self._check_available(count - len(hits), f"admit({seq!r})", reviving=reviving)
        for page in hits:
            if self._index.is_evictable(page):
                self._index.revive(page)
            self._refcount[page] += 1
        pages = hits + self._pop(count - len(hits))
        cached = len(hits) * size
        self._seqs[seq] = _Sequence(pages, len(tokens), tokens, cached, hashes, salt_bytes)
        self._tokens_admitted += len(tokens)
        self._tokens_hit += cached
        return Admission(seq, tuple(pages), len(tokens), cached, size)

    def commit(self, seq: Hashable, num_tokens: int | None = None) -> None:
        """Records that the KV of the first ``num_tokens`` tokens is written on the device.

        Every full page inside that range whose token ids are known gets its chained key and
        joins the prefix cache (unless an identical page is already cached).

        Args:
          seq: a live id.
          num_tokens: written prefix length, from the current written count up to the
            sequence length; ``None`` means the whole sequence.

        Raises:
          ValueError: unknown ``seq``; ``num_tokens`` below the written count or over the
            length.

        Example:
          >>> alloc = PageAllocator(8, 2, max_pages_per_seq=4)
          >>> _ = alloc.admit(0, [5, 6, 7])
          >>> alloc.commit(0)
          >>> alloc.stats().pages_used, alloc.admit(1, [5, 6, 8]).num_cached_tokens
          (2, 2)
        """
        record = self._get(seq, "seq")
        if num_tokens is None:
            num_tokens = record.length
        if not _is_int(num_tokens) or not record.written <= num_tokens <= record.length:
            raise ValueError(
                f"num_tokens: expected an int in [{record.written}, {record.length}] "
                f"(already written .. length of {seq!r}), got {num_tokens!r}"
            )
        record.written = int(num_tokens)
        self._key_full_pages(record)

    def extend(
        self,
        seq: Hashable,
        new_length: int,
        *,
        token_ids: Int[np.ndarray, " n"] | Sequence[int] | None = None,
    ) -> list[tuple[int, int]]:
        """Grows a sequence to ``new_length`` tokens, allocating pages as needed.

        If the partial last page that will receive the new tokens is shared (a lazy fork), it
        is first replaced by a private copy: the returned ``(src, dst)`` pair must be copied on
        the device before writing.

        Args:
          seq: a live id.
          new_length: ``length <= new_length <= M * C``.
          token_ids: the ``new_length - length`` appended token ids (keeps the sequence
            cacheable); ``None`` makes the new tokens, and all later ones, uncacheable.

        Returns:
          Copy plan: a list of ``(src, dst)`` page pairs (empty or one pair).

        Raises:
          ValueError: unknown ``seq``; ``new_length`` shrinks or exceeds capacity;
            ``token_ids`` of the wrong count or given for a sequence already untracked.
          OutOfPages: the pool cannot provide the pages.

        Example:
          >>> alloc = PageAllocator(8, 2, max_pages_per_seq=4)
          >>> _ = alloc.allocate(0, 1)
          >>> alloc.extend(0, 4), alloc.sequence_pages(0).tolist()
          ([], [1, 2])
        """
        record = self._get(seq, "seq")
        new_length = self._check_length(new_length, "new_length")
        if new_length < record.length:
            raise ValueError(
                f"new_length: expected >= current length {record.length} of {seq!r}, "
                f"got {new_length}"
            )
        tokens = None
        if token_ids is not None:
            tokens = self._check_appended(record, token_ids, new_length, seq, "token_ids")
        grow = -(-new_length // self.page_size) - len(record.pages)
        copy = self._needs_copy(record, new_length)
        self._check_available(grow + copy, f"extend({seq!r})")
        plan = []
        if copy:
            source = record.pages[-1]
            target = self._pop(1)[0]
            self._refcount[source] -= 1  # still >= 1: it was shared
            record.pages[-1] = target
            plan.append((source, target))
        record.pages.extend(self._pop(grow))
        record.length = new_length
        if tokens is not None:
            record.tokens.extend(tokens)
        return plan

    def fork(
        self, parent: Hashable, child: Hashable, *, lazy: bool = False
    ) -> list[tuple[int, int]]:
        """Creates ``child`` as a copy of ``parent`` (beam search, parallel sampling).

        The child shares every full page (reference count + 1). The partial last page, if
        any, is copied to a fresh page (returned as a ``(src, dst)`` pair to copy on the
        device); with ``lazy=True`` it is shared too and copied only when either holder first
        extends into it.

        Args:
          parent: a live id.
          child: a new id.
          lazy: defer the partial-page copy to the first ``extend``.

        Returns:
          Copy plan: a list of ``(src, dst)`` page pairs (empty or one pair).

        Raises:
          ValueError: unknown ``parent`` or duplicate ``child``.
          OutOfPages: no page for the copy.

        Example:
          >>> alloc = PageAllocator(8, 2, max_pages_per_seq=4)
          >>> _ = alloc.allocate("p", 3)
          >>> alloc.fork("p", "c"), alloc.page_table(["p", "c"]).tolist()
          ([(2, 3)], [[1, 2, 0, 0], [1, 3, 0, 0]])
        """
        record = self._get(parent, "parent")
        self._check_new(child, "child")
        copy = int(not lazy and record.length % self.page_size != 0)
        self._check_available(copy, f"fork({parent!r}, {child!r})")
        pages = list(record.pages)
        for page in pages[: len(pages) - copy]:
            self._refcount[page] += 1
        plan = []
        if copy:
            target = self._pop(1)[0]
            plan.append((pages[-1], target))
            pages[-1] = target
        self._seqs[child] = _Sequence(
            pages,
            record.length,
            list(record.tokens),
            record.written,
            list(record.hashes),
            record.salt,
        )
        return plan

    def free(self, seq: Hashable) -> None:
        """Drops a sequence: keyed pages nobody else holds become cached, others free.

        Its pages are released last-first, so a prefix's tail is evicted before its head.

        Raises:
          ValueError: unknown ``seq``.

        Example:
          >>> alloc = PageAllocator(8, 2, max_pages_per_seq=4)
          >>> _ = alloc.allocate(0, 3)
          >>> alloc.free(0)
          >>> alloc.stats().pages_free
          7
        """
        record = self._get(seq, "seq")
        del self._seqs[seq]
        for page in reversed(record.pages):
            self._release(page)

    # ------------------------------------------------------------------ device hand-over

    def reserve(self, num: int) -> Int[np.ndarray, " n"]:
        """Hands ``num`` free pages to the device's free-page stack (see the class docstring).

        Args:
          num: pages to reserve, ``>= 0``.

        Returns:
          ``[num]`` int32 page ids, owned by the device reserve until :meth:`settle`.

        Raises:
          ValueError: ``num`` negative or not an int.
          OutOfPages: not enough free or evictable pages.

        Example:
          >>> PageAllocator(8, 2, max_pages_per_seq=4).reserve(3).tolist()
          [1, 2, 3]
        """
        if not _is_int(num) or num < 0:
            raise ValueError(f"num: expected an int >= 0, got {num!r}")
        self._check_available(int(num), f"reserve({num})")
        pages = self._pop(int(num))
        self._reserved.update(pages)
        return np.asarray(pages, dtype=np.int32)

    def settle(
        self,
        seqs: Sequence[Hashable],
        page_table: Int[np.ndarray, "B M"],
        lengths: Int[np.ndarray, " B"],
        *,
        unused: Int[np.ndarray, " U"] | Sequence[int] = (),
        token_ids: Sequence[Sequence[int] | None] | None = None,
    ) -> None:
        """Takes back the result of a device decode loop (see the class docstring).

        Args:
          seqs: ``B`` distinct live ids, the rows of ``page_table``.
          page_table: ``[B, M]`` table after the loop: each row starts with the sequence's
            current pages, followed by pages taken from the reserve up to
            ``ceil(lengths[b] / C)``; later entries are ignored.
          lengths: ``[B]`` lengths after the loop (``>=`` current ones); every token up to
            them is taken as written on the device.
          unused: reserved page ids the loop did not use; they return to the free list.
          token_ids: optional per-row ids of the appended tokens (``None`` rows or no
            argument: those tokens are not cacheable).

        Raises:
          ValueError: wrong shapes or dtypes; a row whose old pages changed or whose new pages
            are not reserved or are taken twice; lengths that shrink or exceed capacity; a
            sequence that grew into a shared partial page; ``unused`` pages not reserved or
            also used; bad ``token_ids``.

        Example:
          >>> alloc = PageAllocator(8, 2, max_pages_per_seq=4)
          >>> _ = alloc.allocate(0, 2)
          >>> stack = alloc.reserve(2)
          >>> table = alloc.page_table([0])
          >>> table[0, 1] = stack[0]  # what a device loop would do, growing to 3 tokens
          >>> alloc.settle([0], table, [3], unused=stack[1:])
          >>> alloc.sequence_pages(0).tolist(), alloc.stats().pages_free
          ([1, 2], 5)
        """
        records = self._batch(seqs)
        table = _int_array(page_table, "page_table", 2)
        if table.shape != (len(records), self.max_pages_per_seq):
            raise ValueError(
                f"page_table: expected shape {(len(records), self.max_pages_per_seq)}, "
                f"got {table.shape}"
            )
        new_lengths = _int_array(lengths, "lengths", 1)
        if new_lengths.shape != (len(records),):
            raise ValueError(f"lengths: expected shape {(len(records),)}, got {new_lengths.shape}")
        returned = [int(p) for p in _int_array(unused, "unused", 1)]
        if token_ids is not None and len(token_ids) != len(records):
            raise ValueError(f"token_ids: expected {len(records)} rows, got {len(token_ids)}")
        taken: set[int] = set()
        plan = []
        for row, (seq, record) in enumerate(zip(seqs, records, strict=True)):
            new_length = int(new_lengths[row])
            if not record.length <= new_length <= self.capacity:
                raise ValueError(
                    f"lengths[{row}]: expected in [{record.length}, {self.capacity}] "
                    f"(current length of {seq!r} .. capacity), got {new_length}"
                )
            old_count = len(record.pages)
            if table[row, :old_count].tolist() != record.pages:
                raise ValueError(
                    f"page_table[{row}]: the first {old_count} entries must be the pages of "
                    f"{seq!r} {record.pages}, got {table[row, :old_count].tolist()}"
                )
            new_pages = table[row, old_count : -(-new_length // self.page_size)].tolist()
            for page in new_pages:
                if page not in self._reserved or page in taken:
                    raise ValueError(
                        f"page_table[{row}]: page {page} is not a reserved page available to "
                        f"{seq!r} (not reserved, or taken by another row)"
                    )
                taken.add(page)
            if self._needs_copy(record, new_length):
                raise ValueError(
                    f"lengths[{row}]: {seq!r} grew into its shared partial page "
                    f"{record.pages[-1]}; extend it on the host before a device loop"
                )
            tokens = None
            if token_ids is not None and token_ids[row] is not None:
                tokens = self._check_appended(
                    record, token_ids[row], new_length, seq, f"token_ids[{row}]"
                )
            plan.append((record, new_length, new_pages, tokens))
        if len(set(returned)) != len(returned) or any(
            page not in self._reserved or page in taken for page in returned
        ):
            raise ValueError(
                f"unused: expected distinct reserved pages not used by any row, got {returned}"
            )
        for record, new_length, new_pages, tokens in plan:
            self._reserved.difference_update(new_pages)  # ownership moves; refcount stays 1
            record.pages.extend(new_pages)
            record.length = new_length
            if tokens is not None:
                record.tokens.extend(tokens)
            record.written = new_length
            self._key_full_pages(record)
        for page in returned:
            self._reserved.discard(page)
            self._release(page)

    # ------------------------------------------------------------------ metrics and checks

    def stats(self) -> AllocatorStats:
        """Current pool usage, waste and prefix-cache metrics.

        Example:
          >>> alloc = PageAllocator(8, 4, max_pages_per_seq=4)
          >>> _ = alloc.allocate(0, 5)
          >>> s = alloc.stats()
          >>> s.pages_used, s.tokens_stored, s.waste, s.page_table_bytes
          (2, 5, 0.375, 8)
        """
        size = self.page_size
        fill: dict[int, int] = {}
        entries = 0
        for record in self._seqs.values():
            entries += len(record.pages)
            full = record.length // size
            for i, page in enumerate(record.pages):
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
        )

    def validate(self) -> None:
        """Checks every invariant eagerly (for tests and notebooks; O(pool + tokens)).

        Checked: reference counts equal the holders (sequences + reserve); every non-null page
        is exactly one of free / used / cached, so nothing leaks; the null page is never held;
        keyed pages' keys match their recorded tokens and each holder's tokens and chain;
        partial pages are never keyed; lengths, page counts and written counts agree.

        Raises:
          AssertionError: naming the first broken invariant.
        """
        size = self.page_size
        holders: Counter[int] = Counter(self._reserved)
        for seq, record in self._seqs.items():
            if not 0 <= record.written <= record.length <= self.capacity:
                raise AssertionError(f"{seq!r}: written/length out of range")
            if len(record.pages) != -(-record.length // size):
                raise AssertionError(f"{seq!r}: {len(record.pages)} pages for {record.length}")
            if len(set(record.pages)) != len(record.pages):
                raise AssertionError(f"{seq!r}: holds a page twice")
            if len(record.tokens) > record.length:
                raise AssertionError(f"{seq!r}: more token ids than tokens")
            known = min(record.written, len(record.tokens)) // size
            if len(record.hashes) != known:
                raise AssertionError(f"{seq!r}: {len(record.hashes)} keys, expected {known}")
            parent = None
            for i, page in enumerate(record.pages):
                tokens = tuple(record.tokens[i * size : (i + 1) * size])
                if i < known:
                    key = hash_page(parent, tokens, record.salt)
                    if key != record.hashes[i]:
                        raise AssertionError(f"{seq!r}: key chain broken at page {i}")
                    parent = key
                entry = self._index.entry(page)
                if entry is None:
                    continue
                if (i + 1) * size > record.length:
                    raise AssertionError(f"{seq!r}: partial page {page} is keyed")
                if i < known and entry.key != record.hashes[i]:
                    raise AssertionError(f"{seq!r}: page {page} keyed for other contents")
                if len(tokens) == size and (entry.tokens != tokens or entry.salt != record.salt):
                    raise AssertionError(f"{seq!r}: page {page} cached tokens differ from its own")
            holders.update(record.pages)
        if holders.get(NULL_PAGE) or self._refcount[NULL_PAGE] or self._index.is_keyed(NULL_PAGE):
            raise AssertionError("the null page is held, counted or keyed")
        if NULL_PAGE in self._free:
            raise AssertionError("the null page is on the free list")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        evictable = set(self._index.evictable_pages())
        for page in range(1, self.num_pages):
            count = self._refcount[page]
            if count != holders.get(page, 0):
                raise AssertionError(f"page {page}: refcount {count}, holders {holders[page]}")
            states = (count > 0) + (page in free) + (page in evictable)
            if states != 1:
                raise AssertionError(f"page {page}: in {states} of used/free/cached")
            if count == 0 and self._index.is_keyed(page) != (page in evictable):
                raise AssertionError(f"page {page}: unreferenced keyed page not in the LRU")
        for page in self._reserved:
            if self._refcount[page] != 1:
                raise AssertionError(f"reserved page {page} is also held by a sequence")
        self._index.validate()

    # ------------------------------------------------------------------ internals

    def _get(self, seq, name: str) -> _Sequence:
        try:
            return self._seqs[seq]
        except KeyError:
            raise ValueError(f"{name}: unknown sequence {seq!r}") from None
        except TypeError:
            raise ValueError(f"{name}: expected a hashable id, got {seq!r}") from None

    def _check_new(self, seq, name: str) -> None:
        try:
            hash(seq)
        except TypeError:
            raise ValueError(f"{name}: expected a hashable id, got {seq!r}") from None
        if seq in self._seqs:
            raise ValueError(f"{name}: duplicate sequence {seq!r} is already live")

    def _batch(self, seqs) -> list[_Sequence]:
        seqs = list(seqs)
        records = [self._get(seq, f"seqs[{i}]") for i, seq in enumerate(seqs)]
        if len({id(r) for r in records}) != len(records):
            raise ValueError(f"seqs: expected distinct sequence ids, got {seqs!r}")
        return records

    def _check_length(self, length, name: str) -> int:
        if not _is_int(length) or length < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {length!r}")
        if length > self.capacity:
            raise ValueError(
                f"{name}: {length} tokens exceed the capacity M * C = "
                f"{self.max_pages_per_seq} * {self.page_size} = {self.capacity}"
            )
        return int(length)

    @staticmethod
    def _check_tokens(token_ids, name: str) -> list[int]:
        array = _int_array(token_ids, name, 1)
        if array.size and array.min() < 0:
            raise ValueError(f"{name}: expected non-negative token ids, got min {array.min()}")
        return array.tolist()

    def _check_appended(self, record, token_ids, new_length, seq, name: str) -> list[int]:
        tokens = self._check_tokens(token_ids, name)
        if len(tokens) != new_length - record.length:
            raise ValueError(
                f"{name}: expected {new_length - record.length} ids (new length minus current "
                f"length of {seq!r}), got {len(tokens)}"
            )
        if len(record.tokens) != record.length:
            raise ValueError(
                f"{name}: {seq!r} has untracked tokens (extended without token ids); "
                "its later token ids cannot be recorded"
            )
        return tokens

    def _needs_copy(self, record: _Sequence, new_length: int) -> bool:
        return (
            new_length > record.length
            and record.length % self.page_size != 0
            and self._refcount[record.pages[-1]] > 1
        )

    def _check_available(self, count: int, what: str, *, reviving: int = 0) -> None:
        evictable = self._index.num_evictable - reviving
        if count > len(self._free) + evictable:
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
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            if self._index.is_keyed(page):
                self._index.park(page)
            else:
                self._free.append(page)

    def _key_full_pages(self, record: _Sequence) -> None:
        size = self.page_size
        for i in range(len(record.hashes), min(record.written, len(record.tokens)) // size):
            parent = record.hashes[-1] if record.hashes else None
            tokens = tuple(record.tokens[i * size : (i + 1) * size])
            key = hash_page(parent, tokens, record.salt)
            record.hashes.append(key)
            page = record.pages[i]
            if not self._index.is_keyed(page):
                # False when an identical page is already cached: this one stays unkeyed.
                self._index.insert(page, CachedPage(key, parent, tokens, record.salt))
