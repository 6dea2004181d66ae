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

The selection of a layer needs that layer's query, and the fetch needs the selection on the
host, so this decode is a Python loop over steps and layers around jitted pieces (the
embedding, each layer's projection and write, its output and MLP, the logits), one
synchronisation per layer and step: the price of reading the host tier a query at a time.

Shapes: ``B`` rows, ``M`` page-table slots, ``L`` layers, ``P_host`` host slots.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

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


@functools.partial(jax.jit, static_argnums=0)
def _embed(graphdef, state, cache, stack, token, prev, active):
    model = nnx.merge(graphdef, state)
    cache, stack, ok = paged.ensure_next_page(cache, stack, active=active)
    return cache, stack, ok, model.embed_inputs(token[:, None], prev[:, None])


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2, 3))
def _project(graphdef, state, cache, bounds, x, layer: int):
    """Layer ``layer``'s query, with the step's K/V written and the written page's bounds
    refreshed (that page is always read: its new bound only matters from the next step).
    The cache and bounds are donated: the layer's pools are written in place (an undonated
    cache made XLA copy the layer's pools on every call). The caller reads the layer's pools
    as ``cache.k_pages[layer]`` (its buffer): returned beside the cache they would be a second
    output of the same buffer, which XLA copies."""
    block = nnx.merge(graphdef, state).blocks[layer]
    positions = cache.lengths[:, None]
    q, k, v = block.attn.project(block.attn_norm(x), positions)
    cache = paged.write_layer(cache, layer, k, v, positions[:, 0])
    bounds = paged.refresh_key_bounds(bounds, cache, cache.lengths, 1, layer=layer, lengths=cache.lengths + 1)  # fmt: skip
    return q, cache, bounds


@functools.partial(jax.jit, static_argnums=(0, 4))
def _finish_layer(graphdef, state, x, out, layer: int):
    block = nnx.merge(graphdef, state).blocks[layer]
    x = x + block.attn.output(out)
    return x + block.mlp(block.mlp_norm(x))


@functools.partial(jax.jit, static_argnums=0)
def _next_token(graphdef, state, cache, x, ok):
    logits = nnx.merge(graphdef, state).logits(x)
    return paged.advance(cache, ok.astype(jnp.int32)), jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)  # fmt: skip


class HostDecode(NamedTuple):
    """What :func:`decode` returns.

    Attributes:
      tokens: ``[B, steps]`` int32 greedy tokens.
      cache: the cache after the steps.
      stack: the free-page stack after the steps.
      read_pages: ``[B, steps]`` pages each step read, summed over layers (device + fetched).
      fetched_bytes: bytes copied from host over all steps and layers (staging padding
        included).
      peak_staging_bytes: the largest staging pool one layer's step fetched into.
    """

    tokens: np.ndarray
    cache: paged.PagedKVCache
    stack: object
    read_pages: np.ndarray
    fetched_bytes: int
    peak_staging_bytes: int


def decode(graphdef, state, cache: paged.PagedKVCache, stack, token, prev, steps: int, active,
           bounds: paged.PageKeyBounds, host: HostTier, *, budget: int, sink: int,
           recent: int, stats: offload.OffloadStats | None = None) -> HostDecode:  # fmt: skip
    """``steps`` greedy tokens for the ``active [B]`` rows, every layer reading the
    ``budget`` pages its query selects over the device pages (``cache.page_table``) and the
    host tier (``host.table``). ``bounds`` are the device pool's key bounds."""
    num_layers = len(nnx.merge(graphdef, state).blocks)
    B = token.shape[0]
    tokens = np.zeros((B, steps), np.int32)
    read = np.zeros((B, steps), np.int32)
    fetched = peak = 0
    host_table = jnp.asarray(host.table)
    host_bounds = [host.bounds.layer(layer) for layer in range(num_layers)]  # sliced once
    for i in range(steps):
        cache, stack, ok, x = _embed(graphdef, state, cache, stack, token, prev, active)
        lengths = cache.lengths + 1  # the step's token is written at position lengths
        for layer in range(num_layers):
            q, cache, bounds = _project(graphdef, state, cache, bounds, x, layer)
            res = offload.retrieval.retrieval_decode_attention(
                q, cache.k_pages[layer], cache.v_pages[layer], bounds.layer(layer),
                cache.page_table, host.pool,
                host_bounds[layer], host_table, lengths, layer=layer, budget=budget,
                sink_pages=sink, recent_pages=recent, stats=stats,
            )  # fmt: skip
            read[:, i] += np.asarray(res.read_pages)
            fetched += res.fetched_bytes
            peak = max(peak, res.fetched_bytes)
            x = _finish_layer(graphdef, state, x, res.out, layer)
        cache, nxt = _next_token(graphdef, state, cache, x, ok)
        tokens[:, i] = np.asarray(nxt)
        token, prev = nxt, token
    read = np.where(np.asarray(active)[:, None], read, 0)
    return HostDecode(tokens, cache, stack, read, int(fetched), int(peak))
