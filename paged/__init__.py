"""KV storage and attention over pages (docs: concepts/paged.md).

Shape legend (shared with ``ringattn``):

====  ==========================================
B     batch
T     query length (per sequence)
Q     query rows of a ragged batch (all sequences' tokens, concatenated)
S     key/value length, ``M * C`` for a gathered sequence
N     query heads
K     key/value heads
H     head dim
P     pages in a pool (page 0 is the reserved null page)
C     tokens per page (any positive int; Pallas GPU decode: a power of two >= 16)
M     pages per sequence (page-table width)
L     layers
D     devices along ``seq_axis`` (sharded pools)
====  ==========================================

Host side: ``PageAllocator`` (free list, reference counts, prefix caching, copy-on-write
forks, metrics) produces the ``page_table [B, M] int32`` and ``lengths [B] int32`` that the
device side consumes through :func:`with_page_table`, and the :class:`CopyPlan` that
:func:`copy_pages` runs (empty plans included). A sequence's life cycle is
admit -> write -> commit -> extend/fork -> free; ``commit`` is what lets its pages serve
prefix-cache hits, and ``stats()`` shows what still waits for one.

Device side: :func:`paged_attention`, :func:`ragged_paged_attention` and
:func:`sharded_paged_attention` return :class:`PagedAttentionOutput` ``(out, lse, page_mass)``;
their oracles are :func:`paged_attention_reference` and :func:`ragged_paged_attention_reference`.
Keys no query may see (past ``lengths``, on the null page or a bad id, causal future, outside
the window) have no effect on any output, even if they hold NaN or inf. Eager calls (concrete
``page_table`` / ``lengths``) raise ``ValueError`` on what would change an answer in silence:
a length past ``M * C``, a slot inside a length without a real page, a write whose token has
no page (``append`` before a page was reserved); under ``jit`` such tokens are masked or
dropped, and :func:`validate` reports them.
``paged_attention(impl="pallas")`` runs a Pallas decode kernel with the same semantics
(Triton on GPU, Mosaic on TPU, interpret mode on CPU); ``impl="auto"`` is the XLA page walk
for now.

Quantized KV: ``init_paged_cache(..., kv_format=KVFormat("int8" | "fp8"))`` stores pools as
:class:`QuantizedPages` (int8 / float8_e4m3fn values plus one float32 absmax scale per token
per kv head, ``scale [L, K, P, C]`` beside ``data [L, K, P, C, H]``); ``KVFormat("int4",
group_size=32)`` packs two symmetric 4-bit levels (-7..7) per byte, ``data [L, K, P, C, H //
2]`` uint8, with one bfloat16 scale per group of ``group_size`` values along ``H``, ``scale
[L, K, P, C, H // group_size]`` (``H / 2 + 2 H / group_size`` bytes per token per kv head,
0.281 of bf16 at ``H = 128``; per element ``|x - x'| <= group_absmax / 14 * (1 + 2**-8)``).
``QuantizedPages.shape`` is always the float pool's. Writes quantize, the attention functions
decode one page block at a time in float32, :func:`gather_kv` decodes. :func:`quantize_pages`
turns a float pool into one. ``KVFormat("kivi2")`` (KIVI-style 2-bit: keys per channel over a
page, values per token, bfloat16 scale and zero-point) keeps each sequence's most recent
tokens in a float32 window (``KVFormat("kivi2", residual=R)``: the open page and the
``ceil(R / C)`` pages before it, ``QuantizedPages.residual [L, K, B, W * C, H]``,
``residual_len [L, K, B]``) and stores a page whole when it fills; :func:`select_rows` narrows the residual for a table
whose rows are another order of the cache's.

Query-aware retrieval (Quest): :class:`PageKeyBounds` holds each page's elementwise key
minimum and maximum per kv head (:func:`page_key_bounds`, kept current by
:func:`refresh_key_bounds` and :func:`copy_key_bounds`); :func:`select_pages_by_query` picks
the ``budget`` pages whose logit upper bound is largest for a step's queries (sink and recent
pages always), :func:`retrieval_table` compacts them into a page table that
:func:`paged_attention` reads exactly, and :func:`retrieval_attention` does the three; a
budget of every live page equals full attention.

Page 0 is our reserved null page; JAX's and vLLM's page tables use page 0 as an ordinary
page: :func:`from_zero_based_table` converts (``table + 1`` over pools of ``P + 1`` pages),
:func:`to_zero_based_table` back. ``from_jax_*`` / ``to_jax_*`` convert quantized pools to and
from JAX's kernels' conventions (ragged ``k_scale`` / ``v_scale``, TPU int8
``QuantizedTensor``, GPU scale pages).
"""

from paged._allocator import Admission, PageAllocator
from paged._attention import DEFAULT_PAGES_PER_BLOCK, PagedAttentionOutput, paged_attention
from paged._batching import make_cu_q_lens, pages_to_reserve
from paged._cache import PagedKVCache, gather_kv, init_paged_cache, with_page_table
from paged._cache_write import advance, append, write, write_layer
from paged._copy import CopyPlan, copy_pages
from paged._device_alloc import (
    FreePageStack,
    ensure_next_page,
    make_free_stack,
    pop_pages,
    push_pages,
    taken_pages,
)
from paged._interop import (
    JAX_TPU_MAX_INT8,
    JaxScalePages,
    KVPoolPair,
    from_jax_gpu_scale_pages,
    from_jax_tpu_quantized,
    to_jax_gpu_scale_pages,
    to_jax_tpu_quantized,
    to_zero_based_table,
)
from paged._interop_ragged import JaxRaggedKV, from_jax_ragged_kv_pages, to_jax_ragged_kv_pages
from paged._layers import LayerPools
from paged._metrics import AllocatorStats
from paged._pool import NULL_PAGE, OutOfPages
from paged._quantized import KVFormat, QuantizedPages, quantize_pages, select_rows
from paged._ragged import ragged_paged_attention
from paged._reference import paged_attention_reference, ragged_paged_attention_reference
from paged._retrieval import (
    PageSelection,
    RetrievalTable,
    page_logit_bounds,
    retrieval_pool,
    retrieval_table,
    select_pages_by_query,
)
from paged._retrieval_attention import retrieval_attention
from paged._sharded import sharded_paged_attention
from paged._summaries import PageKeyBounds, copy_key_bounds, page_key_bounds, refresh_key_bounds
from paged._validate import from_zero_based_table, validate, validate_page_table

__all__ = [
    "JAX_TPU_MAX_INT8",
    "NULL_PAGE",
    "Admission",
    "AllocatorStats",
    "CopyPlan",
    "JaxRaggedKV",
    "JaxScalePages",
    "KVFormat",
    "KVPoolPair",
    "LayerPools",
    "OutOfPages",
    "PageAllocator",
    "DEFAULT_PAGES_PER_BLOCK",
    "FreePageStack",
    "PagedAttentionOutput",
    "PagedKVCache",
    "PageKeyBounds",
    "PageSelection",
    "RetrievalTable",
    "QuantizedPages",
    "advance",
    "append",
    "copy_key_bounds",
    "copy_pages",
    "ensure_next_page",
    "from_jax_gpu_scale_pages",
    "from_jax_ragged_kv_pages",
    "from_jax_tpu_quantized",
    "from_zero_based_table",
    "gather_kv",
    "init_paged_cache",
    "make_cu_q_lens",
    "make_free_stack",
    "paged_attention",
    "paged_attention_reference",
    "page_key_bounds",
    "page_logit_bounds",
    "pages_to_reserve",
    "pop_pages",
    "push_pages",
    "quantize_pages",
    "select_rows",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "refresh_key_bounds",
    "retrieval_attention",
    "retrieval_pool",
    "retrieval_table",
    "select_pages_by_query",
    "sharded_paged_attention",
    "taken_pages",
    "to_jax_gpu_scale_pages",
    "to_jax_ragged_kv_pages",
    "to_jax_tpu_quantized",
    "to_zero_based_table",
    "validate",
    "validate_page_table",
    "with_page_table",
    "write",
    "write_layer",
]
