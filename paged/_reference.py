"""Oracles of the paged attention kernels: gather the pages densely, then dense attention.

Each reference gathers every sequence's KV with :func:`paged.gather_kv` (``[B, M * C, K, H]``,
tokens past ``lengths`` or on a null / out-of-range page zeroed) and calls
:func:`ringattn.attention_reference` with segment ids that hide those tokens, so a reference
has exactly the semantics of its kernel (mask, default query positions, sinks, per-head
windows, masked keys having no effect) and nothing of its block walking. They build the
``T x S`` logits: use small shapes. Jittable with options bound
(``jax.jit(functools.partial(paged_attention_reference, window=8))``).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

import ringattn
from paged._attention import (
    FloatScalar,
    PagedAttentionOutput,
    Window,
    check_sinks,
    default_q_positions,
    resolve_mask,
)
from paged._cache import PagedKVCache, gather_kv
from paged._checks import (
    check_array,
    check_heads,
    check_pages,
    check_residual_rows,
    check_table,
    check_table_values,
    describe,
    pool_dtype,
)
from paged._layers import LayerPools
from paged._quantized import QuantizedPages

__all__ = ["paged_attention_reference", "ragged_paged_attention_reference"]


def _dense(k_pages, v_pages, page_table, lengths):
    """``k, v [B, S, K, H]`` and the ``[B, S]`` validity of each slot (``S = M * C``)."""
    P, C = k_pages.shape[1], k_pages.shape[2]
    page_table = jnp.asarray(page_table, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    one = LayerPools((k_pages,)), LayerPools((v_pages,))  # float or quantized
    cache = PagedKVCache(*one, page_table, lengths)
    k, v = gather_kv(cache, 0)
    S = k.shape[1]
    page_ok = (page_table > 0) & (page_table < P)
    valid = jnp.repeat(page_ok, C, axis=1) & (jnp.arange(S)[None] < lengths[:, None])
    return k, v, valid


def _page_mass(qkv, rows, spec, lse_total, M: int, C: int):
    """``[B, N, M]``: ``sum_t exp(lse_slot - lse_total)``, one dense pass per table slot.

    ``qkv = (q, k, v)`` dense; ``rows = (valid [B, S] keys, q_pos [B, T], q_seg [B, T])``.
    """
    (q, k, v), (valid, q_pos, q_seg) = qkv, rows
    B, S = valid.shape
    kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    slot = jnp.arange(S) // C
    masses = []
    for m in range(M):
        seen = valid & (slot == m)[None]
        _, lse_m = ringattn.attention_reference(
            q,
            k,
            v,
            mask=spec,
            segment_ids=ringattn.SegmentIds(q_seg, seen.astype(jnp.int32)),
            positions=ringattn.Positions(q_pos, kv_pos),
        )
        share = jnp.where(jnp.isneginf(lse_m), 0.0, jnp.exp(lse_m - lse_total))  # [B, T, N]
        masses.append(share.sum(axis=1))  # [B, N]
    return jnp.stack(masses, axis=-1)


def paged_attention_reference(
    q: Float[Array, "B T N H"],
    k_pages: Float[Array, "K P C H"] | QuantizedPages,
    v_pages: Float[Array, "K P C H"] | QuantizedPages,
    page_table: Int[Array | np.ndarray, "B M"],
    lengths: Int[Array | np.ndarray, " B"],
    *,
    q_positions: Int[Array | np.ndarray, "B T"] | None = None,
    mask: ringattn.MaskSpec | None = None,
    causal: bool | np.bool_ | None = None,
    window: Window = None,
    softcap: FloatScalar | None = None,
    scale: FloatScalar | None = None,
    sinks: Float[Array, " N"] | None = None,
    return_page_mass: bool | np.bool_ = False,
) -> PagedAttentionOutput:
    """Dense float32 oracle of :func:`paged.paged_attention` (same arguments and defaults).

    Args:
      q: ``[B, T, N, H]`` queries.
      k_pages: ``[K, P, C, H]`` key pool; page 0 is null. A :class:`paged.QuantizedPages` is
        decoded to float32 first (through :func:`paged.gather_kv`).
      v_pages: ``[K, P, C, H]`` value pool.
      page_table: ``[B, M]`` int page ids.
      lengths: ``[B]`` int valid tokens per sequence.
      q_positions: ``[B, T]`` int, default the last ``T`` positions of the valid cache.
      mask: a :class:`ringattn.MaskSpec`, or the keywords below (``causal`` default True).
      causal: causal mask.
      window: one window, or a tuple of one per query head.
      softcap: logit soft cap.
      scale: logit scale, default ``1 / sqrt(H)``.
      sinks: ``[N]`` per-head sink logits, or None.
      return_page_mass: also compute ``page_mass [B, N, M]`` (one dense pass per slot).

    Returns:
      :class:`paged.PagedAttentionOutput` ``(out [B, T, N, H] in q.dtype, lse [B, T, N],
      page_mass or None)``.

    Raises:
      ValueError: on inconsistent shapes or options; on an eager call, a length past
        ``M * C`` or a slot inside a length without a real page (as the kernel).

    Example:
      >>> import jax.numpy as jnp
      >>> k_pages = v_pages = jnp.ones((1, 3, 4, 8))
      >>> ref = paged_attention_reference(jnp.ones((1, 1, 2, 8)), k_pages, v_pages,
      ...                                 jnp.array([[2, 1]]), jnp.array([6]))
      >>> float(ref.out[0, 0, 0, 0])
      1.0
    """
    fn = "paged_attention_reference"
    check_array(fn, "q", q, 4, jnp.floating)
    B, T, N, _ = q.shape
    K, P, C, H = check_pages(fn, k_pages, v_pages)
    check_heads(fn, q, K, H, pool_dtype(k_pages))
    _, M = check_table(fn, page_table, lengths, B)
    check_table_values(fn, page_table, lengths, num_pages=P, page_size=C)
    check_residual_rows(fn, k_pages, v_pages, B)
    spec = resolve_mask(fn, mask, causal=causal, window=window, softcap=softcap, scale=scale)
    check_sinks(fn, sinks, N)
    q_pos = default_q_positions(fn, q_positions, jnp.asarray(lengths), B, T)
    k, v, valid = _dense(k_pages, v_pages, page_table, lengths)
    S = k.shape[1]
    kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    segment_ids = ringattn.SegmentIds(jnp.ones((B, T), jnp.int32), valid.astype(jnp.int32))
    positions = ringattn.Positions(q_pos, kv_pos)
    q32 = q.astype(jnp.float32)
    out, lse = ringattn.attention_reference(
        q32,
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        mask=spec,
        segment_ids=segment_ids,
        positions=positions,
        sinks=sinks,
    )
    mass = None
    if return_page_mass:
        k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
        mass = _page_mass((q32, k32, v32), (valid, q_pos, segment_ids.q), spec, lse, M, C)
    return PagedAttentionOutput(out.astype(q.dtype), lse, mass)


def ragged_paged_attention_reference(
    q: Float[Array, "Q N H"],
    k_pages: Float[Array, "K P C H"] | QuantizedPages,
    v_pages: Float[Array, "K P C H"] | QuantizedPages,
    page_table: Int[Array | np.ndarray, "B M"],
    lengths: Int[Array | np.ndarray, " B"],
    cu_q_lens: Int[Array | np.ndarray, " B+1"],
    num_seqs: Int[Array | np.ndarray, ""] | Int[Array | np.ndarray, "1"] | int | np.integer,
    *,
    mask: ringattn.MaskSpec | None = None,
    causal: bool | np.bool_ | None = None,
    window: Window = None,
    softcap: FloatScalar | None = None,
    scale: FloatScalar | None = None,
    sinks: Float[Array, " N"] | None = None,
    return_page_mass: bool | np.bool_ = False,
) -> PagedAttentionOutput:
    """Dense float32 oracle of :func:`paged.ragged_paged_attention` (same arguments).

    Each query row becomes its own batch entry attending to its sequence's gathered KV at
    position ``lengths[b] - q_len + i``; rows owned by no real sequence see nothing.

    Args:
      q: ``[Q, N, H]`` queries of all sequences, concatenated.
      k_pages: ``[K, P, C, H]`` key pool; page 0 is null. A :class:`paged.QuantizedPages` is
        decoded to float32 first (through :func:`paged.gather_kv`).
      v_pages: ``[K, P, C, H]`` value pool.
      page_table: ``[B, M]`` int page ids.
      lengths: ``[B]`` int tokens per sequence including its new queries.
      cu_q_lens: ``[B + 1]`` int cumulative query counts.
      num_seqs: number of real sequences.
      mask: a :class:`ringattn.MaskSpec`, or the keywords below (``causal`` default True).
      causal: causal mask.
      window: one window, or a tuple of one per query head.
      softcap: logit soft cap.
      scale: logit scale.
      sinks: ``[N]`` per-head sink logits, or None.
      return_page_mass: also compute ``page_mass [B, N, M]`` (one dense pass per slot).

    Returns:
      :class:`paged.PagedAttentionOutput` ``(out [Q, N, H], lse [Q, N], page_mass or
      None)``.

    Raises:
      ValueError: on inconsistent shapes or options; on an eager call, a length past
        ``M * C`` or a slot inside a length without a real page (as the kernel).

    Example:
      >>> import jax.numpy as jnp
      >>> k_pages = v_pages = jnp.ones((1, 4, 4, 8))
      >>> ref = ragged_paged_attention_reference(
      ...     jnp.ones((3, 2, 8)), k_pages, v_pages, jnp.array([[1, 2], [3, 0]]),
      ...     jnp.array([6, 1]), jnp.array([0, 2, 3]), 2)
      >>> ref.out.shape
      (3, 2, 8)
    """
    fn = "ragged_paged_attention_reference"
    check_array(fn, "q", q, 3, jnp.floating)
    total, N, _ = q.shape
    K, P, C, H = check_pages(fn, k_pages, v_pages)
    check_heads(fn, q, K, H, pool_dtype(k_pages))
    B, M = check_table(fn, page_table, lengths, None)
    check_table_values(fn, page_table, lengths, num_pages=P, page_size=C)
    check_residual_rows(fn, k_pages, v_pages, B)
    check_array(fn, "cu_q_lens", cu_q_lens, 1, jnp.integer)
    if tuple(cu_q_lens.shape) != (B + 1,):
        raise ValueError(f"{fn}: cu_q_lens: expected shape ({B + 1},), got {describe(cu_q_lens)}")
    spec = resolve_mask(fn, mask, causal=causal, window=window, softcap=softcap, scale=scale)
    check_sinks(fn, sinks, N)
    k, v, valid = _dense(k_pages, v_pages, page_table, lengths)
    S = k.shape[1]
    cu = jnp.asarray(cu_q_lens, jnp.int32)
    lens = jnp.asarray(lengths, jnp.int32)
    count = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(()), 0, B)
    rows = jnp.arange(total, dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(cu, rows, side="right") - 1, 0, B - 1)  # [Q]
    owned = (owner < count) & (rows >= cu[owner]) & (rows < cu[owner + 1])
    q_len = cu[owner + 1] - cu[owner]
    q_pos = (lens[owner] - q_len + rows - cu[owner])[:, None]  # [Q, 1]
    kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (total, S))
    segment_ids = ringattn.SegmentIds(
        jnp.where(owned, 1, 2)[:, None].astype(jnp.int32), valid[owner].astype(jnp.int32)
    )
    q32 = q.astype(jnp.float32)[:, None]
    k32, v32 = k[owner].astype(jnp.float32), v[owner].astype(jnp.float32)
    positions = ringattn.Positions(q_pos, kv_pos)
    out, lse = ringattn.attention_reference(
        q32, k32, v32, mask=spec, segment_ids=segment_ids, positions=positions, sinks=sinks
    )
    mass = None
    if return_page_mass:
        rows = _page_mass((q32, k32, v32), (valid[owner], q_pos, segment_ids.q), spec, lse, M, C)
        rows = jnp.where(owned[:, None, None], rows, 0.0)  # [Q, N, M]
        mass = jax.ops.segment_sum(rows, owner, num_segments=B)
    return PagedAttentionOutput(out[:, 0].astype(q.dtype), lse[:, 0], mass)
