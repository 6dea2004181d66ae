"""Pages with more than one holder: :meth:`PageSharing.fork` and :meth:`PageSharing.release_pages`.

A fork shares every full page of its parent (reference count + 1) and copies, now or at the
first ``extend``, the partial last one; ``release_pages`` gives back a sequence's pages at some
page-table slots (demoted or dropped KV), freeing only the pages nobody else holds. Both are
methods of :class:`paged.PageAllocator` (this is one of its base classes, over the state of
:mod:`paged._pool`).
"""

from collections.abc import Hashable, Sequence

import numpy as np

from paged._copy import CopyPlan
from paged._pool import NULL_PAGE, PoolState, _Sequence

__all__ = ["PageSharing"]

IntScalar = int | np.integer


class PageSharing(PoolState):
    """``fork`` / ``release_pages``: the allocator's shared and given-back pages."""

    def fork(self, parent: Hashable, child: Hashable, *, lazy: bool = False) -> CopyPlan:
        """Creates ``child`` as a copy of ``parent`` (beam search, parallel sampling).

        The child shares every full page (reference count + 1). The partial last page, if
        any, is copied to a fresh page (returned as a :class:`paged.CopyPlan` to run with
        :func:`paged.copy_pages`); with ``lazy=True`` it is shared too and copied only when either holder first
        extends into it.

        Args:
          parent: a live id.
          child: a new id.
          lazy: defer the partial-page copy to the first ``extend``.

        Returns:
          A :class:`paged.CopyPlan` of zero or one copy.

        Raises:
          ValueError: unknown ``parent`` or duplicate ``child``.
          OutOfPages: no page for the copy.

        Example:
          >>> alloc = PageAllocator(8, 2, max_pages_per_seq=4)
          >>> _ = alloc.allocate("p", 3)
          >>> alloc.fork("p", "c").pairs(), alloc.page_table(["p", "c"]).tolist()
          ([(2, 3)], [[1, 2, 0, 0], [1, 3, 0, 0]])
        """
        fn = "PageAllocator.fork"
        record = self._get(fn, parent, "parent")
        self._check_new(fn, child, "child")
        copy = int(not lazy and record.length % self.page_size != 0)
        self._check_available(copy, f"fork({parent!r}, {child!r})", length=record.length)
        pages = list(record.pages)
        for page in pages[: len(pages) - copy]:
            if page != NULL_PAGE:  # a slot emptied by release_pages stays empty
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
        return CopyPlan.from_pairs(plan)

    def release_pages(self, seq: Hashable, slots: Sequence[IntScalar] | np.ndarray) -> np.ndarray:
        """Gives back the pages at page-table ``slots`` of ``seq`` (demoted or dropped KV).

        Each slot becomes the null page in ``seq``'s page table (``page_table`` shows 0 there;
        attention skips it) while the sequence keeps its length. A page nobody else holds
        (no other sequence, no device reserve) returns to the free list, and leaves the prefix
        cache if it was cached there: its device copy may be overwritten from now on (scrub
        it, push it to a device free-page stack, page something else in). A page another
        sequence still holds (a shared prefix, a fork) stays allocated and cached for them:
        only this sequence's reference goes. Later commits, forks and ``free`` skip the
        emptied slots; the sequence's last page cannot be released while it is partial (the
        next token is written into it).

        Args:
          seq: a live id.
          slots: distinct slot indices in ``[0, ceil(length / C))`` whose page is not yet
            released.

        Returns:
          ``[n]`` int32: the pages that became free (a subset of the released ones, in slot
          order); only these may be overwritten on the device.

        Raises:
          ValueError: unknown ``seq``; a slot out of range, repeated, already released, or
            the partial last page.

        Example:
          >>> alloc = PageAllocator(8, 2, max_pages_per_seq=4)
          >>> _ = alloc.admit("a", [1, 2, 3, 4, 5]); alloc.commit("a")
          >>> _ = alloc.admit("b", [1, 2, 3, 4, 9])  # shares pages 1 and 2 with "a"
          >>> alloc.release_pages("b", [0, 1]).tolist(), alloc.page_table(["b"]).tolist()
          ([], [[0, 0, 4, 0]])
          >>> alloc.release_pages("a", [1]).tolist()
          [2]
        """
        fn = "PageAllocator.release_pages"
        record = self._get(fn, seq, "seq")
        count = len(record.pages)
        raw = np.asarray(slots)
        if raw.ndim != 1 or (raw.size and not np.issubdtype(raw.dtype, np.integer)):
            raise ValueError(
                f"{fn}: slots: expected a 1-D list of ints, got {raw.dtype} {raw.shape}"
            )
        picked = [int(s) for s in raw.tolist()]
        partial = record.length % self.page_size != 0
        for s in picked:
            if not 0 <= s < count:
                raise ValueError(
                    f"{fn}: slots: expected slots in [0, {count}) (the pages of {seq!r}), got {s}"
                )
            if record.pages[s] == NULL_PAGE:
                raise ValueError(f"{fn}: slots: expected slots still holding a page, got {s}")
            if partial and s == count - 1:
                raise ValueError(
                    f"{fn}: slots: expected no partial last page (slot {s} of {seq!r} is written "
                    "next), got it"
                )
        if len(set(picked)) != len(picked):
            raise ValueError(f"{fn}: slots: expected distinct slots, got {picked}")
        freed = []
        for s in picked:
            page = record.pages[s]
            record.pages[s] = NULL_PAGE
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if self._index.is_keyed(page):
                    self._index.forget(page)
                self._free.append(page)
                freed.append(page)
        return np.asarray(freed, dtype=np.int32)
