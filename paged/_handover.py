"""Device hand-over: pages reserved for a jitted decode loop, and settling its result.

A jitted multi-step decode loop cannot call the host allocator, so the host hands it pages
up front (:meth:`DeviceHandOver.reserve`, fed to :func:`paged.make_free_stack`) and takes
the loop's page table and lengths back afterwards (:meth:`DeviceHandOver.settle`), which
also counts every token up to the new lengths as written (a commit). See
:class:`paged.PageAllocator` for the protocol.
"""

from collections.abc import Hashable, Sequence

import numpy as np
from jaxtyping import Array, Int

from paged._checks import host_int_array, int_option
from paged._pool import PoolState

__all__ = ["DeviceHandOver"]

IntScalar = int | np.integer


class DeviceHandOver(PoolState):
    """``reserve`` / ``settle``: the allocator's half of a device decode loop."""

    def reserve(self, num: IntScalar) -> Int[np.ndarray, " n"]:
        """Hands ``num`` free pages to the device's free-page stack (see the class docstring).

        Args:
          num: pages to reserve, ``>= 0``.

        Returns:
          ``[num]`` int32 page ids, owned by the device reserve until :meth:`settle`.

        Raises:
          ValueError: ``num`` negative or not an int.
          OutOfPages: not enough free or evictable pages.

        Example:
          >>> from paged import PageAllocator
          >>> PageAllocator(8, 2, max_pages_per_seq=4).reserve(3).tolist()
          [1, 2, 3]
        """
        num = int_option("PageAllocator.reserve", "num", num, minimum=0)
        self._check_available(num, f"reserve({num})")
        pages = self._pop(num)
        self._reserved.update(pages)
        return np.asarray(pages, dtype=np.int32)

    def settle(
        self,
        seqs: Sequence[Hashable],
        page_table: Int[np.ndarray | Array, "B M"],
        lengths: Int[np.ndarray | Array, " B"] | Sequence[int],
        *,
        unused: Int[np.ndarray | Array, " U"] | Sequence[int] = (),
        token_ids: Sequence[Int[np.ndarray | Array, " n"] | Sequence[int] | None] | None = None,
    ) -> None:
        """Takes back the result of a device decode loop (see the class docstring).

        Args:
          seqs: ``B`` distinct live ids, the rows of ``page_table``; ``None`` for an empty row
            (as in :meth:`page_table`), whose table row must hold no page and length be 0.
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
          >>> from paged import PageAllocator
          >>> alloc = PageAllocator(8, 2, max_pages_per_seq=4)
          >>> _ = alloc.allocate(0, 2)
          >>> stack = alloc.reserve(2)
          >>> table = alloc.page_table([0])
          >>> table[0, 1] = stack[0]  # what a device loop would do, growing to 3 tokens
          >>> alloc.settle([0], table, [3], unused=stack[1:])
          >>> alloc.sequence_pages(0).tolist(), alloc.stats().pages_free
          ([1, 2], 5)
        """
        fn = "PageAllocator.settle"
        records = self._batch(fn, seqs)
        table = host_int_array(fn, "page_table", page_table, 2)
        if table.shape != (len(records), self.max_pages_per_seq):
            raise ValueError(
                f"{fn}: page_table: expected shape {(len(records), self.max_pages_per_seq)}, "
                f"got {table.shape}"
            )
        new_lengths = host_int_array(fn, "lengths", lengths, 1)
        if new_lengths.shape != (len(records),):
            raise ValueError(
                f"{fn}: lengths: expected shape {(len(records),)}, got {new_lengths.shape}"
            )
        returned = [int(p) for p in host_int_array(fn, "unused", unused, 1)]
        if token_ids is not None and len(token_ids) != len(records):
            raise ValueError(f"{fn}: token_ids: expected {len(records)} rows, got {len(token_ids)}")
        taken: set[int] = set()
        plan = []
        for row, (seq, record) in enumerate(zip(seqs, records, strict=True)):
            new_length = int(new_lengths[row])
            if record is None:  # an empty row stays empty
                if new_length != 0 or table[row].any():
                    raise ValueError(
                        f"{fn}: page_table[{row}]: expected an empty row (seqs[{row}] is None) "
                        f"with no page and length 0, got pages {sorted(set(table[row].tolist()) - {0})} "
                        f"and length {new_length}"
                    )
                continue
            if not record.length <= new_length <= self.capacity:
                raise ValueError(
                    f"{fn}: lengths[{row}]: expected in [{record.length}, {self.capacity}] "
                    f"(current length of {seq!r} .. capacity), got {new_length}"
                )
            old_count = len(record.pages)
            if table[row, :old_count].tolist() != record.pages:
                raise ValueError(
                    f"{fn}: page_table[{row}]: expected the first {old_count} entries to be "
                    f"the pages of {seq!r} {record.pages}, got {table[row, :old_count].tolist()}"
                )
            new_pages = table[row, old_count : -(-new_length // self.page_size)].tolist()
            for page in new_pages:
                if page not in self._reserved or page in taken:
                    raise ValueError(
                        f"{fn}: page_table[{row}]: expected reserved pages available to "
                        f"{seq!r} after its own, got page {page} (not reserved, or taken by "
                        "another row)"
                    )
                taken.add(page)
            if self._needs_copy(record, new_length):
                raise ValueError(
                    f"{fn}: lengths[{row}]: expected {seq!r} not to grow into its shared "
                    f"partial page {record.pages[-1]} (extend it on the host before a device "
                    f"loop), got {new_length}"
                )
            tokens = None
            if token_ids is not None and token_ids[row] is not None:
                tokens = self._check_appended(
                    fn, record, token_ids[row], new_length, seq, f"token_ids[{row}]"
                )
            plan.append((record, new_length, new_pages, tokens))
        if len(set(returned)) != len(returned) or any(
            page not in self._reserved or page in taken for page in returned
        ):
            raise ValueError(
                f"{fn}: unused: expected distinct reserved pages not used by any row, got {returned}"
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
