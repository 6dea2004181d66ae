"""Pages shared between rows of a batch (prefix caching, copy-on-write forks).

A retention selection is made per row, but a page id may sit in several rows' page tables
(``paged.PageAllocator`` shares a cached prefix and forked pages). Evicting a shared page for
one row while another keeps it would make the keeping row read a scrubbed or reused page.
The rule of this library: **a page kept by any row that holds it is kept by every row that
holds it** (:func:`keep_shared_pages`); :func:`offload.select_keep` (with a ``page_table``)
and :func:`offload.split_residency` apply it, so a page is evicted (demoted or dropped) only
when every row of the batch that holds it evicts it. Holders outside the batch (other
sequences, the prefix cache) are the allocator's business: free a demoted page there with
``paged.PageAllocator.release_pages``, which frees only pages nobody else holds.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from offload._checks import check_table

__all__ = ["keep_shared_pages"]


def keep_shared_pages(
    page_table: Int[Array | np.ndarray, "B M"], keep: Bool[Array | np.ndarray, "B M"]
) -> Bool[Array, "B M"]:
    """Extends ``keep`` so that a page kept in any row is kept in every slot that holds it.

    Jittable as is (``jax.jit(keep_shared_pages)``); ``O(B M log(B M))`` (one sort). The null
    page 0 is never kept by sharing (a slot holding it keeps only what ``keep`` says).

    Args:
      page_table: ``[B, M]`` int page ids (0 = null page).
      keep: ``[B, M]`` bool, the slots each row keeps.

    Returns:
      ``[B, M]`` bool: ``keep`` or'ed with "this slot's page is kept by some slot of the batch".
      A row may then keep more pages than its policy's budget.

    Raises:
      ValueError: on a ``page_table`` that is not an int ``[B, M]`` array or a ``keep`` that is
        not a bool array of its shape.

    Example:
      >>> pt = jnp.array([[3, 5, 0], [3, 5, 7]])
      >>> keep = jnp.array([[False, True, False], [False, False, True]])
      >>> keep_shared_pages(pt, keep).astype(int).tolist()
      [[0, 1, 0], [0, 1, 1]]
    """
    fn = "keep_shared_pages"
    check_table(fn, "page_table", page_table)
    if tuple(keep.shape) != tuple(page_table.shape) or keep.dtype != jnp.bool_:
        raise ValueError(
            f"{fn}: keep: expected bool {tuple(page_table.shape)} (the page table's shape), got "
            f"{keep.dtype} {tuple(keep.shape)}"
        )
    return _keep_shared(jnp.asarray(page_table), jnp.asarray(keep))


@jax.jit
def _keep_shared(page_table, keep):
    ids = page_table.reshape(-1)
    kept = keep.reshape(-1)
    order = jnp.argsort(ids, stable=True)
    sorted_ids = ids[order]
    starts = jnp.concatenate([jnp.zeros(1, bool), sorted_ids[1:] != sorted_ids[:-1]])
    group = jnp.cumsum(starts)  # one group per distinct page id, in sorted order
    any_kept = jax.ops.segment_max(
        kept[order].astype(jnp.int32), group, num_segments=ids.size, indices_are_sorted=True
    )
    shared = jnp.zeros_like(kept).at[order].set(any_kept[group] > 0)
    return keep | (shared & (ids != 0)).reshape(keep.shape)
