"""Query-aware retrieval from pinned host memory for the example server (Quest over two tiers).

``Retention(policy, mode="retrieve", host=True)`` frees the device of the prompt: every
prompt page but the sink pages and the page the decode writes into is copied to pinned host
memory (``offload.page_out``; a page shared by several rows once) and given back to the
allocator, while its key bounds stay on the device (``offload.retrieval.with_host_bounds``). Each
decode step, in every layer, selects the ``budget`` pages its own query can attend to most
over both tiers, fetches only the selected host pages into a staging pool and attends over
the selected device and staged pages (``offload.retrieval.retrieval_decode_attention``: exact over the
selection). A budget of every page equals no retention; a smaller one gives the tokens of the
device-only ``mode="retrieve"`` (the same selection, read from another tier).

The decode itself is the server's jitted loop (``generate._decode`` with ``host=``): each
layer's selection needs that layer's query, so the selected host pages are read by the program
(``offload.retrieval.retrieval_decode_attention_jit``: a slice of the layer's pinned host pool
per selected page, moved to device memory), and the whole loop of steps runs with no host
round trip. (Before, it was a Python loop over steps and layers with one synchronisation per
layer and step: 61 host round trips and about 182 dispatched programs a token on SmolLM2.)

Shapes: ``B`` rows, ``M`` page-table slots, ``L`` layers, ``P_host`` host slots.
"""

from typing import NamedTuple

import numpy as np

import offload
import offload.retrieval
import paged


class HostTier(NamedTuple):
    """The prompt pages moved to pinned host memory, as the decode reads them.

    Attributes:
      pool: the ``offload.HostPagePool`` ``[L, K, P_host, C, H]`` holding them.
      bounds: ``paged.PageKeyBounds`` ``[L, K, P_host, H]`` of the host slots, on the device.
      table: ``[B, M]`` int32 host slot of each page-table slot (``-1``: not in host).
      num_pages: distinct pages in host.
      moved_bytes: bytes copied to host (``offload.page_out``'s).
    """

    pool: offload.HostPagePool
    bounds: paged.PageKeyBounds
    table: np.ndarray
    num_pages: int
    moved_bytes: int


def move_to_host(cache: paged.PagedKVCache, bounds: paged.PageKeyBounds, table: np.ndarray,
                 evict: np.ndarray) -> HostTier:  # fmt: skip
    """Copies the pages of ``table [B, M]`` where ``evict [B, M]`` (bool) to a new pinned host
    pool, each distinct page once, with their key bounds. The device pages are only read:
    the caller releases them."""
    # The distinct pages, each numbered 1..n where evicted (0 elsewhere): slot = number - 1.
    ids, numbered = offload.staging_table(np.where(evict, table, paged.NULL_PAGE))
    if ids.size == 0:
        raise ValueError("move_to_host: evict: expected at least one real page to move, got none")
    slots = np.arange(ids.size, dtype=np.int32)
    host = offload.make_host_page_pool(cache.k_pages, cache.v_pages, ids.size)
    handle = offload.page_out(cache.k_pages, cache.v_pages, ids, host, slots)
    host = offload.wait(handle)
    host_bounds = offload.retrieval.with_host_bounds(bounds, ids, slots, num_slots=ids.size)
    return HostTier(host, host_bounds, numbered - 1, int(ids.size), int(handle.nbytes))
