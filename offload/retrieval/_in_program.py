"""The two-tier retrieval decode inside one jitted program: the selected host pages are read
from pinned host memory by the program itself, so a decode step needs no host round trip."""

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from offload.retrieval._decode import RetrievalDecode, _attend_tiers, _select_tiers, checked_walk
from paged import PageKeyBounds, QuantizedPages

__all__ = ["retrieval_decode_attention_jit"]


def _fetch(host_leaves, slots):
    """Pages ``slots [n]`` (``-1``: none) of host leaves ``[K, P_host, ...]`` as device staging
    leaves ``[K, 1 + n, ...]`` (index 0 the dummy page; entry ``i`` at ``1 + i``): one loop over
    the entries, each selected page of every leaf copied from host by the program (a slice,
    then a move to device memory); unselected entries copy nothing and stay zero."""

    def staging(leaf):
        out = jnp.zeros((leaf.shape[0], 1 + slots.shape[0], *leaf.shape[2:]), leaf.dtype)
        return jax.device_put(out, jax.memory.Space.Device)

    def body(i, outs):
        def copy(outs):
            new = []
            for leaf, out in zip(host_leaves, outs, strict=True):
                zeros = (0,) * (leaf.ndim - 2)
                page = lax.dynamic_slice(leaf, (0, slots[i], *zeros), (leaf.shape[0], 1, *leaf.shape[2:]))  # fmt: skip
                page = jax.device_put(page, jax.memory.Space.Device)
                new.append(lax.dynamic_update_slice(out, page, (0, 1 + i, *zeros)))
            return new

        return lax.cond(slots[i] >= 0, copy, list, outs)

    return lax.fori_loop(0, slots.shape[0], body, [staging(leaf) for leaf in host_leaves])


def _host_pages(pools, slots):
    """The staging ``(k, v)`` pools of ``slots`` (:func:`_fetch` over every stored array of
    both pools, in one loop; a host pool has no kivi2 residual)."""
    arrays, treedef = jax.tree.flatten(pools)
    return jax.tree.unflatten(treedef, _fetch(arrays, slots))


def _page_bytes(pools) -> int:
    """Bytes of one page of a layer's ``(k, v)`` pools (page axis 1 of every stored array)."""
    return sum(x.nbytes // x.shape[1] for x in jax.tree.leaves(pools))


def retrieval_decode_attention_jit(
    q: Float[Array, "B T N H"],
    k_pages: Float[Array, "K P C H"] | QuantizedPages,
    v_pages: Float[Array, "K P C H"] | QuantizedPages,
    bounds: PageKeyBounds,
    device_table: Int[Array, "B M"],
    host_k_pages: Float[Array, "K S C H"] | QuantizedPages,
    host_v_pages: Float[Array, "K S C H"] | QuantizedPages,
    host_bounds: PageKeyBounds,
    host_table: Int[Array, "B M"],
    lengths: Int[Array, " B"],
    *,
    budget: int,
    sink_pages: int = 1,
    recent_pages: int = 1,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: Float[Array, " N"] | None = None,
) -> RetrievalDecode:
    """:func:`retrieval_decode_attention` as a pure function, for inside ``jax.jit``: the same
    selection and the same attention, but the selected host pages are read by the program
    (a slice of the layer's host pool per selected page, moved to device memory), so a whole
    decode step, or a loop of steps, runs with no host round trip.

    Each of the ``B * budget`` selected entries that lives in host is copied on its own (a page
    two rows select is copied twice; unselected entries copy nothing), into a staging pool
    ``[K, 1 + B * budget, C, H]`` on the device.

    Args:
      q: ``[B, T, N, H]`` queries, as in :func:`retrieval_decode_attention`.
      k_pages: the layer's device key pool ``[K, P, C, H]`` (float or quantized).
      v_pages: the layer's device value pool.
      bounds: the layer's device ``paged.PageKeyBounds`` ``[K, P, H]``.
      device_table: ``[B, M]`` int device page per slot (0 = not on the device).
      host_k_pages: the layer's host key pool ``[K, P_host, C, H]`` in pinned host memory
        (float or ``paged.QuantizedPages``): one layer of a per-layer host pool,
        ``host_pool.k_pages[layer]`` (a host pool made from a cache's ``paged.LayerPools``).
      host_v_pages: the layer's host value pool.
      host_bounds: the layer's host bounds ``[K, P_host, H]``.
      host_table: ``[B, M]`` int host slot per slot (``-1`` = not in host).
      lengths: ``[B]`` int tokens per sequence (the queries' included).
      budget: pages read per sequence (static).
      sink_pages: leading pages always read.
      recent_pages: trailing pages always read.
      softcap: as in ``paged.paged_attention``.
      scale: as in ``paged.paged_attention``.
      sinks: ``[N]`` sink logits.

    Returns:
      :class:`RetrievalDecode`; ``fetched_pages`` and ``fetched_bytes`` are int32 scalars
      (arrays: the program counts them), the entries copied from host and their bytes.

    Raises:
      ValueError: on shapes that disagree or a bad option (checked while tracing).

    Example:
      >>> import paged
      >>> from offload import make_host_page_pool, page_out, wait
      >>> k = paged.LayerPools([jnp.ones((1, 4, 2, 8))])
      >>> host = wait(page_out(k, k, [2], make_host_page_pool(k, k, 4), [0]))
      >>> hb = with_host_bounds(paged.PageKeyBounds(jnp.ones((1, 1, 4, 8)), jnp.ones((1, 1, 4, 8))), [2], [0], num_slots=4)
      >>> step = jax.jit(functools.partial(retrieval_decode_attention_jit, budget=2))
      >>> res = step(jnp.ones((1, 1, 1, 8)), k[0], k[0],
      ...     paged.PageKeyBounds(jnp.ones((1, 4, 8)), jnp.ones((1, 4, 8))), jnp.array([[1, 0]]),
      ...     host.k_pages[0], host.v_pages[0], hb.layer(0), jnp.array([[-1, 0]]), jnp.array([4]))
      >>> res.read_pages.tolist(), int(res.fetched_pages)
      ([2], 1)
    """
    fn = "retrieval_decode_attention_jit"
    K, _, C, H = k_pages.shape
    for name, pool in (("host_k_pages", host_k_pages), ("host_v_pages", host_v_pages)):
        shape = tuple(pool.shape)
        if len(shape) != 4 or (shape[0], *shape[2:]) != (K, C, H):
            raise ValueError(
                f"{fn}: {name}: expected one layer's host pool [K={K}, P_host, C={C}, H={H}] "
                f"(host_pool.k_pages[layer] of a per-layer host pool), got {shape}"
            )
        if isinstance(pool, QuantizedPages) != isinstance(k_pages, QuantizedPages):
            raise ValueError(f"{fn}: {name}: expected the device pool's kind (float or quantized)")  # fmt: skip
    tables = (device_table, jnp.asarray(host_table, jnp.int32))
    walk = checked_walk(fn, k_pages, bounds, host_bounds, host_k_pages.shape[1], tables,
                        (budget, sink_pages, recent_pages))  # fmt: skip
    on_device, in_host, lengths_c, offset, count = _select_tiers(q, (bounds, host_bounds), tables, lengths, walk)  # fmt: skip
    B, W = in_host.shape
    slots = in_host.reshape(-1).astype(jnp.int32)
    stage_k, stage_v = _host_pages((host_k_pages, host_v_pages), slots)
    entry = 1 + jnp.arange(B * W, dtype=jnp.int32).reshape(B, W)
    stage_table = jnp.where(in_host >= 0, entry, 0)
    compacted = (on_device, lengths, lengths_c, offset)
    stage = (stage_table, stage_k, stage_v)
    res = _attend_tiers(q, (k_pages, v_pages), compacted, stage, sinks, (softcap, scale))
    fetched = jnp.sum(in_host >= 0).astype(jnp.int32)
    page_bytes = _page_bytes((host_k_pages, host_v_pages))
    return RetrievalDecode(res.out, res.lse, count, fetched, fetched * page_bytes)
