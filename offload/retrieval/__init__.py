"""Query-aware retrieval from pinned host memory (Quest over two tiers): pages paged out to
host keep their key bounds on the device, and each decode step fetches only the host pages its
query selects.

``offload.retrieval`` is a public subpackage of ``offload`` (as ``offload.planning`` and
``offload.monitoring`` are): ``import offload`` does not import it; ``import
offload.retrieval`` does. It builds on the core's host pool, transfers and mixed-residency
attention and on ``paged``'s page key bounds and selection
(``paged.select_pages_by_query``); a policy's evicted pages are marked for it by
``offload.select_keep(..., mode="retrieve")``.

Residency of a layer is two tables over the page-table slots ``[B, M]``: ``device_table``
(device page ids, 0 = not on the device) and ``host_table`` (slots of a
:class:`~offload.HostPagePool`, ``-1`` = not in host). The key bounds of every page stay on
the device wherever its data lives: ``paged.PageKeyBounds`` of the device pool (by device page
id) and *host bounds* of the host pool (by host slot), written when a page is paged out
(:func:`with_host_bounds`). One step of one layer (:func:`retrieval_decode_attention`):

1. the selection (``paged.select_pages_by_query``) runs on the device over both tiers at
   once, as one table over the concatenated bounds (host slot ``s`` is id ``P + s``), and is
   compacted (``paged.retrieval_table``) into ``budget`` slots in position order;
2. the host slots it selected come to the host (a ``[B, budget]`` int copy: the step's one
   synchronisation) and :func:`fetch_selected_pages` copies exactly those pages of the layer
   into a staging pool sized to them (``offload.prefetch_layer``: asynchronous, one compiled
   gather; sizes rounded up to a power of two so few shapes compile), counting the bytes in
   an :class:`~offload.OffloadStats`;
3. attention reads the selected device pages in place and the staged pages
   (``offload.mixed_residency_attention`` over the two compacted tables, merged exactly).

With ``budget`` at least the live pages every page is read and the result equals full
attention (``paged.paged_attention_reference``). The fetch of layer ``l`` needs layer ``l``'s
query, so it cannot start before layer ``l - 1`` is computed: it overlaps only with the
selection's own dispatch (ShadowKV and InfiniGen predict with an earlier layer's query to
overlap further; not done here).

Shape legend (as in ``ringattn``, ``paged`` and ``offload``):

====  ==========================================
B     sequences
M     page-table slots per sequence
K     key/value heads
P     device pages (``P_host`` host slots)
C     tokens per page
H     head dim
====  ==========================================
"""

from offload.retrieval._decode import (
    RetrievalDecode,
    StagedPages,
    fetch_selected_pages,
    retrieval_decode_attention,
    with_host_bounds,
)
from offload.retrieval._in_program import retrieval_decode_attention_jit

__all__: list[str] = [
    "RetrievalDecode",
    "StagedPages",
    "fetch_selected_pages",
    "retrieval_decode_attention",
    "retrieval_decode_attention_jit",
    "with_host_bounds",
]
