"""A device-resident free-page stack, so a jitted decode loop can take pages itself.

Inside a ``lax.fori_loop`` / ``lax.scan`` of decode steps, a sequence that crosses a page
boundary needs a fresh page without a host round trip. :class:`FreePageStack` holds page ids
in ``pages[:top]``; :func:`pop_pages` hands them out in batch order; :func:`ensure_next_page`
does it for every sequence whose next token starts a new page.

Exhaustion is safe by construction: a sequence that needs a page when none is left (or whose
table is full) is *not granted*: its table slot stays on the null page, ``ok[b]`` is False,
writes of its token are dropped (the null page swallows them) and the caller advances only
the ``ok`` sequences (``advance(cache, ok)``), so it stops growing. Nothing is ever written to
page 0 or to a page another sequence holds, and no page is handed out twice.

Hand-over with the host allocator (``paged.PageAllocator``):

1. before the loop, the host takes ``n`` free page ids out of its free list (``reserve(n)``)
   and builds ``make_free_stack(ids)``;
2. the jitted loop pops from the stack and writes the ids into ``page_table``;
3. after the loop, :func:`taken_pages` gives the ids that were popped and the ids still
   unused; the host records which sequence owns each taken page (they are in the returned
   ``page_table``) and gives the unused ones back (``settle``).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from paged._cache import PagedKVCache
from paged._checks import int_option

__all__ = [
    "FreePageStack",
    "ensure_next_page",
    "make_free_stack",
    "pop_pages",
    "push_pages",
    "taken_pages",
]


class FreePageStack(NamedTuple):
    """Free page ids on device.

    Attributes:
      pages: ``[F]`` int32; ``pages[:top]`` are free, popped from the end.
      top: ``[]`` int32 number of free ids.
    """

    pages: Int[Array, " F"]
    top: Int[Array, ""]


def make_free_stack(
    free_ids: Int[np.ndarray | Array, " n"] | list[int] | tuple[int, ...],
    *,
    capacity: int | np.integer | None = None,
) -> FreePageStack:
    """A stack holding ``free_ids`` (popped last-first), in an array of ``capacity`` slots.

    Host side (checks the ids eagerly); the stack it returns is a pytree for jitted loops.

    Args:
      free_ids: 1-D ints, distinct real page ids (``>= 1``).
      capacity: array size ``F`` (default ``len(free_ids)``); room for :func:`push_pages`.

    Returns:
      A :class:`FreePageStack`.

    Raises:
      ValueError: if ``free_ids`` is not 1-D ints, holds an id < 1 or a duplicate (checked
        eagerly), or ``capacity`` is smaller than ``len(free_ids)``.

    Example:
      >>> make_free_stack([3, 4, 7]).top
      Array(3, dtype=int32)
    """
    fn = "make_free_stack"
    ids = np.asarray(free_ids)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(
            f"{fn}: free_ids: expected 1-D ints (free_ids must be 1-D ints), got shape "
            f"{ids.shape} dtype {ids.dtype}"
        )
    if np.any(ids < 1):
        raise ValueError(
            f"{fn}: free_ids: expected real pages (>= 1; 0 is the null page), got min {ids.min()}"
        )
    if np.unique(ids).size != ids.size:
        raise ValueError(f"{fn}: free_ids: expected distinct ids, got {ids.tolist()}")
    F = ids.size if capacity is None else capacity
    F = int_option(fn, "capacity", F, minimum=ids.size)
    pages = np.zeros(max(int(F), 1), np.int32)
    pages[: ids.size] = ids
    return FreePageStack(jnp.asarray(pages), jnp.asarray(ids.size, jnp.int32))


@jax.jit
def pop_pages(
    stack: FreePageStack, need: Bool[Array, " B"]
) -> tuple[FreePageStack, Int[Array, " B"], Bool[Array, " B"]]:
    """Pops one page for each ``need[b]``, in batch order, while pages last (jittable).

    Already jitted (no options to bind).

    Returns:
      ``(stack, ids [B], granted [B])``; ``ids[b]`` is 0 (the null page) where not granted.

    Example:
      >>> stack, ids, granted = pop_pages(make_free_stack([5, 6]), jnp.array([True, True, True]))
      >>> ids, granted
      (Array([6, 5, 0], dtype=int32), Array([ True,  True, False], dtype=bool))
    """
    need = jnp.asarray(need, bool)
    rank = jnp.cumsum(need.astype(jnp.int32)) - 1  # [B] position in the request queue
    granted = need & (rank < stack.top)
    index = jnp.clip(stack.top - 1 - rank, 0, stack.pages.shape[0] - 1)
    ids = jnp.where(granted, stack.pages[index], 0)
    top = stack.top - jnp.sum(granted.astype(jnp.int32))
    return FreePageStack(stack.pages, top), ids, granted


@jax.jit
def push_pages(
    stack: FreePageStack, ids: Int[Array, " n"], mask: Bool[Array, " n"]
) -> FreePageStack:
    """Returns pages ``ids[mask]`` to the stack (jittable); ids that do not fit are dropped.

    Already jitted (no options to bind).

    The caller must only push pages it owns (never the null page: 0 is ignored).

    Example:
      >>> stack = push_pages(make_free_stack([5], capacity=3), jnp.array([7, 0]),
      ...                    jnp.array([True, True]))
      >>> int(stack.top)
      2
    """
    ids = jnp.asarray(ids, jnp.int32)
    mask = jnp.asarray(mask, bool) & (ids > 0)
    rank = jnp.cumsum(mask.astype(jnp.int32)) - 1
    F = stack.pages.shape[0]
    target = jnp.where(mask & (stack.top + rank < F), stack.top + rank, F)
    pages = stack.pages.at[target].set(ids, mode="drop")
    top = jnp.minimum(stack.top + jnp.sum(mask.astype(jnp.int32)), F)
    return FreePageStack(pages, top)


@jax.jit
def ensure_next_page(
    cache: PagedKVCache,
    stack: FreePageStack,
    *,
    active: Bool[Array, " B"] | None = None,
) -> tuple[PagedKVCache, FreePageStack, Bool[Array, " B"]]:
    """Makes sure each active sequence has a page for its next token (jittable).

    Already jitted; ``active`` is an array argument, not a static option.

    A sequence whose next position ``lengths[b]`` falls on a table slot holding the null page
    pops a page from ``stack`` into that slot.

    Args:
      cache: the paged cache.
      stack: the free stack.
      active: ``[B]`` bool, sequences that will write a token (default all).

    Returns:
      ``(cache, stack, ok)``; ``ok[b]`` is True iff sequence ``b`` is active and its next
      token has a real page. Write the token with ``count=ok.astype(jnp.int32)`` (an eager
      write of a token without a page raises; a traced one drops it) and
      ``advance(cache, ok.astype(jnp.int32))`` so exhausted sequences stop growing.

    Example:
      >>> from paged import init_paged_cache
      >>> cache = init_paged_cache(1, 1, 8, 2, 4, batch=2, max_pages_per_seq=2)
      >>> cache, stack, ok = ensure_next_page(cache, make_free_stack([3]))
      >>> cache.page_table[:, 0], ok
      (Array([3, 0], dtype=int32), Array([ True, False], dtype=bool))
    """
    B, M = cache.page_table.shape
    P, C = cache.k_pages.shape[2], cache.k_pages.shape[3]
    active = jnp.ones((B,), bool) if active is None else jnp.asarray(active, bool)
    slot = cache.lengths // C
    in_table = slot < M
    current = jnp.take_along_axis(cache.page_table, jnp.clip(slot, 0, M - 1)[:, None], axis=1)[:, 0]
    has_page = in_table & (current > 0) & (current < P)
    need = active & in_table & ~has_page
    stack, ids, granted = pop_pages(stack, need)
    rows = jnp.where(granted, jnp.arange(B), B)  # not granted: dropped
    table = cache.page_table.at[rows, slot].set(ids, mode="drop")
    ok = active & (has_page | granted)
    return cache._replace(page_table=table), stack, ok


def taken_pages(
    stack: FreePageStack, initial_top: int | np.integer
) -> tuple[np.ndarray, np.ndarray]:
    """Host side, after a loop: ``(taken, unused)`` page ids of a stack that only popped.

    Reads values, so it runs outside ``jit``.

    Args:
      stack: the stack returned by the loop.
      initial_top: ``top`` when the stack was made (``len(free_ids)``).

    Returns:
      Two numpy int32 arrays: ids popped during the loop and ids still free.

    Raises:
      ValueError: if ``stack.top`` exceeds ``initial_top`` (pages were pushed, so popped ids
        cannot be read off the stack).

    Example:
      >>> stack, _, _ = pop_pages(make_free_stack([5, 6, 7]), jnp.array([True]))
      >>> taken_pages(stack, 3)
      (array([7], dtype=int32), array([5, 6], dtype=int32))
    """
    initial_top = int_option("taken_pages", "initial_top", initial_top, minimum=0)
    top = int(stack.top)
    if top > initial_top:
        raise ValueError(
            f"taken_pages: initial_top: expected >= the stack top {top} (pages were pushed; "
            f"stack top {top} exceeds initial_top {initial_top}), got {initial_top}"
        )
    pages = np.asarray(stack.pages)
    return pages[top:initial_top].copy(), pages[:top].copy()
