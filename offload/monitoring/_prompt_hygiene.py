"""Prompt hygiene for prefix caching: find the spans that make prompts stop sharing pages.

Incident A of the article "The engineering truth of long-context inference, 2026"
(``offload.planning.ARTICLE``): a base64 blob entered a prompt template early, every prompt
became unique from that point on, and the prefix-cache hit rate fell from 78% to 12%. The symptom is
in the metrics (``prefix_hit_rate_low``); the cause is in the token ids, and
:func:`find_high_cardinality_spans` finds it from a batch of prompts alone:

1. *Shared* tokens are those covered by an ``ngram``-token window that occurs in at least
   ``max(2, ceil(min_share * B))`` of the ``B`` prompts (anywhere, so a span of a different
   length in each prompt does not misalign the rest of the template).
2. A *high-cardinality span* is a maximal run of unshared tokens (a blob, a random id, a
   timestamp) followed, later in the same prompt, by at least one page (``page_size``) of
   shared tokens: content that the prefix cache could have served had the span not come
   before it. Unshared text at the end of a prompt (the user's own turn) is not reported: it
   defeats nothing.
3. The prompts are then replayed, in order, through a fresh :class:`paged.PageAllocator`
   (admit, commit, free; a pool large enough that nothing is evicted) three times: as given,
   with the spans removed, and with each prompt's spans moved to its end, after the shared
   part. The three hit rates are measured by the allocator, not estimated.
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from jaxtyping import Int

from offload._checks import check_float, check_int
from paged import PageAllocator

__all__ = ["PromptHygiene", "PromptSpan", "find_high_cardinality_spans", "replay_hit_rate"]


class PromptSpan(NamedTuple):
    """Tokens ``[start, end)`` of prompt number ``prompt``."""

    prompt: int
    start: int
    end: int


class PromptHygiene(NamedTuple):
    """Result of :func:`find_high_cardinality_spans`.

    Attributes:
      spans: the high-cardinality spans, by prompt then position.
      hit_rate: prefix-cache hit rate of the prompts as given (replayed in order).
      hit_rate_without_spans: the same with every span removed.
      hit_rate_spans_moved: the same with each prompt's spans moved to its end.
      tokens_in_spans: tokens inside the spans.
      tokens_admitted: tokens of all prompts.
    """

    spans: tuple[PromptSpan, ...]
    hit_rate: float
    hit_rate_without_spans: float
    hit_rate_spans_moved: float
    tokens_in_spans: int
    tokens_admitted: int


def _check_prompts(fn: str, prompts) -> list[np.ndarray]:
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
        raise ValueError(
            f"{fn}: prompts: expected a sequence of 1-D token-id sequences or a [B, T] int "
            f"array, got {type(prompts).__name__}"
        )
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)):
            raise ValueError(f"{fn}: prompts[{i}]: expected token ids, got {prompt!r}")
        array = np.asarray(prompt)
        if array.size == 0:
            out.append(np.zeros((0,), dtype=np.int64))
            continue
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(
                f"{fn}: prompts[{i}]: expected a 1-D sequence of integer token ids, got "
                f"{array.dtype} {array.shape}"
            )
        if array.min() < 0:
            raise ValueError(
                f"{fn}: prompts[{i}]: expected non-negative token ids, got min {array.min()}"
            )
        out.append(array.astype(np.int64))
    return out


def replay_hit_rate(
    prompts: Sequence[Int[np.ndarray, " T"] | Sequence[int]] | Int[np.ndarray, "B T"],
    *,
    page_size: int = 16,
) -> float:
    """Prefix-cache hit rate of replaying prompts in order through a fresh ``PageAllocator``.

    Each prompt is admitted, committed and freed before the next; the pool holds every page
    (nothing is evicted), so this is the best hit rate the prompts allow at this page size.

    Args:
      prompts: ``B`` prompts of token ids (lists, 1-D int arrays, or one ``[B, T]`` array).
      page_size: ``C``, tokens per page (an int >= 1).

    Returns:
      ``tokens_hit / tokens_admitted`` (0.0 when no tokens).

    Raises:
      ValueError: on prompts that are not 1-D non-negative integer ids, or a bad page size.

    Example:
      >>> replay_hit_rate([list(range(40)), list(range(40))], page_size=16)
      0.4
    """
    fn = "replay_hit_rate"
    page_size = check_int(fn, "page_size", page_size, low=1)
    return _replay(_check_prompts(fn, prompts), page_size)


def _replay(prompts: list[np.ndarray], page_size: int) -> float:
    pages = [-(-len(p) // page_size) for p in prompts]
    if not sum(pages):
        return 0.0
    alloc = PageAllocator(sum(pages) + 1, page_size, max_pages_per_seq=max(pages))
    for i, prompt in enumerate(prompts):
        alloc.admit(i, prompt)
        alloc.commit(i)
        alloc.free(i)
    return alloc.stats().prefix_hit_rate


def _shared_mask(prompts: list[np.ndarray], ngram: int, min_prompts: int) -> list[np.ndarray]:
    grams = []
    frequency: dict[tuple[int, ...], int] = {}
    for prompt in prompts:
        tokens = prompt.tolist()
        mine = [tuple(tokens[i : i + ngram]) for i in range(len(tokens) - ngram + 1)]
        grams.append(mine)
        for gram in set(mine):
            frequency[gram] = frequency.get(gram, 0) + 1
    masks = []
    for prompt, mine in zip(prompts, grams, strict=True):
        mask = np.zeros(len(prompt), dtype=bool)
        for i, gram in enumerate(mine):
            if frequency[gram] >= min_prompts:
                mask[i : i + ngram] = True
        masks.append(mask)
    return masks


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``[start, end)`` where ``mask`` is False."""
    edges = np.flatnonzero(np.diff(np.concatenate([[True], mask, [True]]).astype(np.int8)))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def find_high_cardinality_spans(
    prompts: Sequence[Int[np.ndarray, " T"] | Sequence[int]] | Int[np.ndarray, "B T"],
    *,
    page_size: int = 16,
    ngram: int = 4,
    min_share: float = 0.5,
) -> PromptHygiene:
    """Finds spans (blobs, random ids) that keep prompts from sharing prefix-cache pages.

    See the module docstring for the method. With a single prompt nothing can be shared, so
    no span is reported; empty prompts contribute nothing.

    Args:
      prompts: ``B`` prompts of token ids (lists, 1-D int arrays of any lengths, or one
        ``[B, T]`` array), in arrival order.
      page_size: ``C`` of the allocator the replay uses (an int >= 1); also the least
        shared content after a span for it to count.
      ngram: window length that decides shared tokens, ``>= 1`` (longer: fewer chance
        matches between unrelated prompts).
      min_share: fraction of the prompts a window must occur in to be shared, in ``(0, 1]``
        (at least two prompts always).

    Returns:
      A :class:`PromptHygiene`: the spans and the hit rates as given, without the spans and
      with them moved after the shared part.

    Raises:
      ValueError: on prompts that are not 1-D non-negative integer ids, or a bad option.

    Example:
      >>> import numpy as np
      >>> rng = np.random.default_rng(0)
      >>> head, tail = list(range(100, 132)), list(range(200, 264))
      >>> prompts = [head + rng.integers(1000, 9999, 20).tolist() + tail for _ in range(4)]
      >>> out = find_high_cardinality_spans(prompts, page_size=16)
      >>> out.spans[0], round(out.hit_rate, 3), out.hit_rate_without_spans
      (PromptSpan(prompt=0, start=32, end=52), 0.207, 0.625)
    """
    fn = "find_high_cardinality_spans"
    page_size = check_int(fn, "page_size", page_size, low=1)
    ngram = check_int(fn, "ngram", ngram, low=1)
    min_share = check_float(fn, "min_share", min_share, low=0.0, high=1.0, low_open=True)
    arrays = _check_prompts(fn, prompts)
    min_prompts = max(2, math.ceil(min_share * len(arrays)))
    masks = _shared_mask(arrays, ngram, min_prompts)
    spans = []
    for index, mask in enumerate(masks):
        shared_after = np.cumsum(mask[::-1])[::-1]  # shared tokens at or after each position
        for start, end in _runs(mask):
            if end < len(mask) and shared_after[end] >= page_size:
                spans.append(PromptSpan(index, start, end))
    removed, moved = [], []
    for index, prompt in enumerate(arrays):
        keep = np.ones(len(prompt), dtype=bool)
        for span in spans:
            if span.prompt == index:
                keep[span.start : span.end] = False
        removed.append(prompt[keep])
        moved.append(np.concatenate([prompt[keep], prompt[~keep]]))
    return PromptHygiene(
        spans=tuple(spans),
        hit_rate=_replay(arrays, page_size),
        hit_rate_without_spans=_replay(removed, page_size),
        hit_rate_spans_moved=_replay(moved, page_size),
        tokens_in_spans=sum(s.end - s.start for s in spans),
        tokens_admitted=sum(len(p) for p in arrays),
    )
