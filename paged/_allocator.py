"""Host-side page allocator: free list, reference counts, prefix caching, forks and metrics.

This is bookkeeping that cannot be static-shaped, so it is a small plain-Python class (not
jitted). Its outputs are what the device-side ``PagedKVCache`` consumes: a page table
``[B, M] int32`` padded with the null page 0 and lengths ``[B] int32`` (hand them over with
:func:`paged.with_page_table`), and :class:`paged.CopyPlan` copy plans (run them with
:func:`paged.copy_pages`, empty ones included).

Life cycle of a sequence: **admit -> write -> commit -> extend/fork -> free**::

    adm = alloc.admit(seq, prompt_ids)            # 1. pages; the cached prefix is reused
    cache = paged.with_page_table(cache, alloc.page_table(seqs), alloc.lengths(seqs))
    # 2. write: prefill tokens adm.num_cached_tokens: into the cache on the device
    alloc.commit(seq)                             # 3. their full pages join the prefix cache
    plan = alloc.extend(seq, n + 1, token_ids=[t])  # 4. room for one more token
    cache = paged.copy_pages(cache, plan)         #    copy-on-write first (plan may be empty)
    # write token t, then alloc.commit(seq) again; alloc.fork(seq, child) for beams
    alloc.free(seq)                               # 5. committed pages stay cached

``commit`` is what makes prefix caching hit: a page becomes reusable only once the host has
said its KV is on the device. A missed commit is not an error (the KV may legitimately still
be in flight), but it is visible: :meth:`PageAllocator.stats` reports ``tokens_uncommitted``
and ``pages_uncommitted`` for live sequences and ``pages_freed_uncommitted`` for cacheable
pages that were freed without ever being committed (prefix cache hits lost).

The implementation is split by concept: :mod:`paged._pool` (state and page moves),
:mod:`paged._handover` (``reserve`` / ``settle`` for device loops), :mod:`paged._metrics`
(``stats`` / ``validate``), :mod:`paged._prefix` (chained keys and the LRU index),
:mod:`paged._sharing` (``fork`` / ``release_pages``: pages with more than one holder).
"""

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np
from jaxtyping import Array, Int

from paged._checks import is_int
from paged._copy import CopyPlan
from paged._handover import DeviceHandOver
from paged._metrics import PoolMetrics
from paged._pool import _Sequence
from paged._prefix import hash_page, normalize_salt
from paged._sharing import PageSharing

__all__ = ["Admission", "PageAllocator"]

IntScalar = int | np.integer


@dataclasses.dataclass(frozen=True)
class Admission:
    """Result of :meth:`PageAllocator.admit`.

    Attributes:
      seq: the new sequence's id.
      page_ids: its pages, in order (the first ``num_cached_pages`` came from the cache).
      num_tokens: prompt length.
      num_cached_tokens: leading tokens whose KV is already in the cache (page-aligned, and
        always ``< num_tokens`` when ``num_tokens > 0``): the prefill computes only the rest,
        then calls :meth:`PageAllocator.commit`.
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


class PageAllocator(DeviceHandOver, PoolMetrics, PageSharing):
    """Host-side allocator of KV pages with prefix caching, copy-on-write forks and metrics.

    Page ``0`` (:data:`NULL_PAGE`) is reserved: it is never handed out, and page-table padding
    points to it (device writes to it are dropped). JAX's and vLLM's page tables use page 0
    as an ordinary page: see :func:`paged.from_zero_based_table` for the conversion. Every
    other page is in exactly one state: *free* (on the free list), *used* (referenced by
    sequences and/or the device reserve; the reference count equals the number of holders)
    or *cached* (a keyed full page nobody references, kept in an LRU and evicted only when
    the free list is empty).

    Sequence life cycle (``seq`` is any hashable id): admit -> write -> commit ->
    extend/fork -> free::

        adm = alloc.admit(seq, prompt_ids, salt=tenant)   # reuse cached prefix, allocate rest
        cache = paged.with_page_table(cache, alloc.page_table(seqs), alloc.lengths(seqs))
        # device: write (prefill) tokens adm.num_cached_tokens: into the cache
        alloc.commit(seq)                 # KV written: full pages become cached (keyed)
        plan = alloc.extend(seq, n + 1, token_ids=[t])  # room for one more token
        cache = paged.copy_pages(cache, plan)  # then write token t's KV; alloc.commit(seq)
        plan = alloc.fork(seq, child)     # child shares full pages; partial page copied
        alloc.free(seq)                   # keyed pages stay cached, others return to free

    Without ``commit`` nothing is ever cached; ``stats()`` shows the tokens and pages still
    waiting for one (``tokens_uncommitted``, ``pages_uncommitted``) and the cacheable pages
    freed before any commit (``pages_freed_uncommitted``).

    ``allocate(seq, length)`` creates a sequence without token ids (nothing cached). Keys
    need token ids: a sequence extended once without ``token_ids`` stops being cacheable
    from that point on.

    Copy-on-write: an operation that would write into a page someone else also holds
    returns the :class:`paged.CopyPlan` the caller must run on the device (``copy_pages``)
    *before* writing. A full page is never written again, so sharing full pages is free;
    ``fork(lazy=True)`` also shares the partial last page and defers its copy to the first
    ``extend`` of either holder.

    Device hand-over for a jitted multi-step decode loop:

    1. ``pages = alloc.reserve(n)``: n free pages go to the device's free-page stack; they
       count as used, owned by the reserve.
    2. The loop pops pages from that stack and appends them to page-table rows as sequences
       cross page boundaries, writing each step's KV. A sequence entering the loop must own
       its last partial page (true unless it came from ``fork(lazy=True)`` and was not
       extended since).
    3. ``alloc.settle(seqs, page_table, lengths, unused=rest, token_ids=new_ids)``: for each
       row the pages past the sequence's old ones (up to ``ceil(length / C)``) must come from
       the reserve and join the sequence; every token up to ``lengths`` counts as written
       (settle commits); ``unused`` reserved pages return to the free list. Reserved pages
       that are neither used nor returned stay reserved for a later loop.

    Every bad argument raises ``ValueError`` (``"PageAllocator.<method>: <arg>: expected ...,
    got ..."``); a pool too small raises :class:`OutOfPages`. Both leave the pool state
    untouched; an ``OutOfPages`` from ``allocate``, ``admit``, ``extend`` or ``fork`` is counted,
    by the sequence length it asked for, in ``stats().out_of_pages_lengths`` (the article's
    rule 12: review the lengths of the requests that ran out of memory).
    Integer arguments accept Python and numpy integers and reject bools and floats.
    :meth:`validate` checks every invariant eagerly.

    Args:
      num_pages: ``P``, pages in the pool including the null page; ``>= 2``.
      page_size: ``C``, tokens per page; any int >= 1 (the rule of
        :func:`paged.init_paged_cache`).
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

    def __init__(self, num_pages: IntScalar, page_size: IntScalar, *, max_pages_per_seq: IntScalar):
        super().__init__(num_pages, page_size, max_pages_per_seq=max_pages_per_seq)

    # ------------------------------------------------------------------ lifecycle

    def allocate(
        self, seq: Hashable, length: IntScalar, *, salt: str | bytes | None = None
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
        fn = "PageAllocator.allocate"
        self._check_new(fn, seq, "seq")
        length = self._check_length(fn, length, "length")
        salt_bytes = normalize_salt(salt, fn=fn)
        count = -(-length // self.page_size)
        self._check_available(count, f"allocate({seq!r})", length=length)
        pages = self._pop(count)
        self._seqs[seq] = _Sequence(pages, length, [], 0, [], salt_bytes)
        return np.asarray(pages, dtype=np.int32)

    def admit(
        self,
        seq: Hashable,
        token_ids: Int[np.ndarray | Array, " T"] | Sequence[int],
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
        fn = "PageAllocator.admit"
        self._check_new(fn, seq, "seq")
        tokens = self._check_tokens(fn, token_ids, "token_ids")
        self._check_length(fn, len(tokens), "len(token_ids)")
        salt_bytes = normalize_salt(salt, fn=fn)
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
        self._check_available(
            count - len(hits), f"admit({seq!r})", reviving=reviving, length=len(tokens)
        )
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

    def commit(self, seq: Hashable, num_tokens: IntScalar | None = None) -> None:
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
        fn = "PageAllocator.commit"
        record = self._get(fn, seq, "seq")
        if num_tokens is None:
            num_tokens = record.length
        if not is_int(num_tokens) or not record.written <= num_tokens <= record.length:
            raise ValueError(
                f"{fn}: num_tokens: expected an int in [{record.written}, {record.length}] "
                f"(already written .. length of {seq!r}), got {num_tokens!r}"
            )
        record.written = int(num_tokens)
        self._key_full_pages(record)

    def extend(
        self,
        seq: Hashable,
        new_length: IntScalar,
        *,
        token_ids: Int[np.ndarray | Array, " n"] | Sequence[int] | None = None,
    ) -> CopyPlan:
        """Grows a sequence to ``new_length`` tokens, allocating pages as needed.

        If the partial last page that will receive the new tokens is shared (a lazy fork), it
        is first replaced by a private copy: the returned plan must be run on the device
        (:func:`paged.copy_pages`) before writing. After writing, :meth:`commit`.

        Args:
          seq: a live id.
          new_length: ``length <= new_length <= M * C``.
          token_ids: the ``new_length - length`` appended token ids (keeps the sequence
            cacheable); ``None`` makes the new tokens, and all later ones, uncacheable.

        Returns:
          A :class:`paged.CopyPlan` of zero or one copy.

        Raises:
          ValueError: unknown ``seq``; ``new_length`` shrinks or exceeds capacity;
            ``token_ids`` of the wrong count or given for a sequence already untracked.
          OutOfPages: the pool cannot provide the pages.

        Example:
          >>> alloc = PageAllocator(8, 2, max_pages_per_seq=4)
          >>> _ = alloc.allocate(0, 1)
          >>> alloc.extend(0, 4).pairs(), alloc.sequence_pages(0).tolist()
          ([], [1, 2])
        """
        fn = "PageAllocator.extend"
        record = self._get(fn, seq, "seq")
        new_length = self._check_length(fn, new_length, "new_length")
        if new_length < record.length:
            raise ValueError(
                f"{fn}: new_length: expected >= current length {record.length} of {seq!r}, "
                f"got {new_length}"
            )
        tokens = None
        if token_ids is not None:
            tokens = self._check_appended(fn, record, token_ids, new_length, seq, "token_ids")
        grow = -(-new_length // self.page_size) - len(record.pages)
        copy = self._needs_copy(record, new_length)
        self._check_available(grow + copy, f"extend({seq!r})", length=new_length)
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
        return CopyPlan.from_pairs(plan)

    def free(self, seq: Hashable) -> None:
        """Drops a sequence: keyed pages nobody else holds become cached, others free.

        Full pages with known token ids that were never committed are counted in
        ``stats().pages_freed_uncommitted`` (their prefix could have been cached).

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
        record = self._get("PageAllocator.free", seq, "seq")
        self._pages_freed_uncommitted += self._uncommitted_pages(record)
        del self._seqs[seq]
        for page in reversed(record.pages):
            self._release(page)
