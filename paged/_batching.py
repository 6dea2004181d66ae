"""Batch bookkeeping for a serving loop: ragged query offsets and the pages a loop reserves.

Two small helpers a decode/prefill loop needs around :func:`paged.ragged_paged_attention` and
:func:`paged.ensure_next_page`; the batch's page table (empty rows included) comes from
``PageAllocator.page_table(seqs)`` with ``None`` for a row with no sequence.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from paged._checks import check_array, host_int_array, int_option

__all__ = ["make_cu_q_lens", "pages_to_reserve"]


def make_cu_q_lens(counts: Int[Array | np.ndarray, " B"]) -> Int[Array, " B+1"]:
    """The ``cu_q_lens`` of :func:`paged.ragged_paged_attention` from queries per row.

    Row ``b`` owns the flat query rows ``cu[b] .. cu[b + 1] - 1``. A row with no query this
    step (count 0: a row not admitted yet, finished, or waiting while others prefill) owns
    none and is skipped; it may stay below ``num_seqs`` (pass ``num_seqs = B`` when every row
    is in the batch's page table). Jittable as is; the counts are checked ``>= 0`` eagerly
    when concrete (under ``jit`` a negative count is not caught: it makes ``cu`` decrease).

    Args:
      counts: ``[B]`` int queries per row (``>= 0``).

    Returns:
      ``[B + 1]`` int32, ``cu[0] = 0``, ``cu[b + 1] = cu[b] + counts[b]``.

    Raises:
      ValueError: on counts that are not a 1-D int array, or a concrete negative count.

    Example:
      >>> make_cu_q_lens(np.array([3, 0, 1])).tolist()
      [0, 3, 3, 4]
    """
    fn = "make_cu_q_lens"
    check_array(fn, "counts", counts, 1, jnp.integer)
    if not isinstance(counts, jax.core.Tracer) and (np.asarray(counts) < 0).any():
        raise ValueError(
            f"{fn}: counts: expected queries per row >= 0, got {np.asarray(counts).tolist()}"
        )
    counts = jnp.asarray(counts, jnp.int32)
    return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])


def pages_to_reserve(
    lengths: Int[Array | np.ndarray, " B"] | list[int],
    num_tokens: Int[Array | np.ndarray, " B"] | list[int] | int | np.integer,
    *,
    page_size: int | np.integer,
    max_pages_per_seq: int | np.integer | None = None,
) -> int:
    """Pages a device loop pops from its free-page stack to write ``num_tokens`` per row.

    Row ``b`` writes tokens at positions ``lengths[b] .. lengths[b] + num_tokens[b] - 1``;
    :func:`paged.ensure_next_page` pops a page whenever one falls on a new slot, so the row
    needs ``ceil((lengths[b] + num_tokens[b]) / C) - ceil(lengths[b] / C)`` pages (capped by
    ``max_pages_per_seq`` when given). Reserve that many with ``PageAllocator.reserve`` before
    the loop: with fewer, some rows stop growing (``ensure_next_page`` returns ``ok=False``);
    ``settle`` returns what the loop did not use. A decode loop of ``s`` steps that starts by
    writing the prompt's last token writes ``s`` tokens per row (the last generated one is not
    written). Host-side (numpy), not jittable.

    Args:
      lengths: ``[B]`` int tokens already in each row (0 for an empty row).
      num_tokens: ``[B]`` int (or one int for every row) tokens the loop writes, ``>= 0``
        (0 for an empty row).
      page_size: ``C >= 1``.
      max_pages_per_seq: optional ``M``: a row never holds more than ``M`` pages.

    Returns:
      The page count (an int).

    Raises:
      ValueError: on non-integer or negative lengths or counts, shapes that disagree, or a
        bad ``page_size`` / ``max_pages_per_seq``.

    Example:
      >>> pages_to_reserve([4, 5, 0], [1, 4, 0], page_size=4)  # 1 + 1 + 0
      2
    """
    fn = "pages_to_reserve"
    C = int_option(fn, "page_size", page_size, minimum=1)
    lengths = host_int_array(fn, "lengths", lengths, 1).astype(np.int64)
    if isinstance(num_tokens, (int, np.integer)) and not isinstance(num_tokens, bool):
        num_tokens = np.full(lengths.shape, int(num_tokens), np.int64)
    num_tokens = host_int_array(fn, "num_tokens", num_tokens, 1).astype(np.int64)
    if num_tokens.shape != lengths.shape:
        raise ValueError(
            f"{fn}: num_tokens: expected shape {lengths.shape} (one count per row of lengths), "
            f"got {num_tokens.shape}"
        )
    for name, x in (("lengths", lengths), ("num_tokens", num_tokens)):
        if (x < 0).any():
            raise ValueError(f"{fn}: {name}: expected ints >= 0, got {x.tolist()}")
    before = -(-lengths // C)
    after = -(-(lengths + num_tokens) // C)
    if max_pages_per_seq is not None:
        M = int_option(fn, "max_pages_per_seq", max_pages_per_seq, minimum=1)
        before, after = np.minimum(before, M), np.minimum(after, M)
    return int((after - before).sum())
