"""Mixed prefill / decode batches over a paged KV pool: :func:`ragged_paged_attention`.

Queries of every sequence are packed along one axis, ``q [Q, N, H]`` with ``cu_q_lens [B + 1]``
marking where each sequence's rows start (see :func:`paged.make_cu_q_lens`), as in JAX's TPU
ragged paged attention. Layout, masking, sinks, the null page and the safety under ``jit`` are
those of :func:`paged.paged_attention` (described in :mod:`paged._attention`, whose helpers this
module uses). Forward-only; oracle: :func:`paged.ragged_paged_attention_reference`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

import ringattn
from paged._attention import (
    DEFAULT_PAGES_PER_BLOCK,
    FloatScalar,
    IntScalar,
    PagedAttentionOutput,
    Window,
    check_sinks,
    checked_pools,
    forward_only,
    resolve_mask,
    sequence_view,
)
from paged._checks import (
    check_array,
    check_heads,
    check_residual_rows,
    check_table,
    check_table_values,
    describe,
    int_option,
    pool_dtype,
    refuse_bias,
)
from paged._layers import LayerPools, read_layer
from paged._page_walk import attend_sequence, kernel_options, pad_table
from paged._quantized import QuantizedPages

__all__ = ["ragged_paged_attention"]


@functools.partial(jax.jit, static_argnames=("opts", "queries_per_block"))
def _ragged_impl(q, pools, batch, sinks, heads=None, *, opts, queries_per_block):
    """``pools = (k_pages, v_pages)``; ``batch = (page_table [B, M], lengths [B], cu_q_lens
    [B + 1], num_seqs [])``: where each sequence's query rows are and what they see."""
    (k_pages, v_pages), (page_table, lengths, cu_q_lens, num_seqs) = pools, batch
    total, N, H = q.shape
    B = page_table.shape[0]
    TQ = queries_per_block
    table = pad_table(page_table, opts.pages_per_block)
    lengths = lengths.astype(jnp.int32)
    cu = cu_q_lens.astype(jnp.int32)
    q_pad = jnp.pad(q, ((0, TQ), (0, 0), (0, 0)))
    out = jnp.zeros((total + TQ, N, H), jnp.float32)
    lse = jnp.full((total + TQ, N), -jnp.inf, jnp.float32)
    count = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(()), 0, B)
    rows = jnp.arange(TQ, dtype=jnp.int32)
    M = page_table.shape[1]
    mass = jnp.zeros((B, N, table.shape[1]), jnp.float32) if opts.want_page_lse else None
    sinks32 = None if sinks is None else sinks.astype(jnp.float32)

    def sequence(b, carry):
        start = cu[b]
        q_len = jnp.maximum(cu[b + 1] - start, 0)
        length = lengths[b]
        row = table[b]
        k_view, v_view = sequence_view(k_pages, b), sequence_view(v_pages, b)

        def query_block(i, carry):
            out, lse, mass = carry
            first = start + i * TQ
            local = i * TQ + rows
            # Rows past this sequence's queries, or outside [0, total) (a corrupt cu_q_lens
            # whose slice start dynamic_slice would clamp), are not written.
            valid = (local < q_len) & (first >= 0) & (first + rows < total)
            q_blk = lax.dynamic_slice(q_pad, (first, 0, 0), (TQ, N, H))
            pos = length - q_len + local
            o, s, m = attend_sequence(
                (q_blk, pos, valid), row, length, (k_view, v_view), opts=opts, heads=heads
            )
            old_o = lax.dynamic_slice(out, (first, 0, 0), (TQ, N, H))
            old_s = lax.dynamic_slice(lse, (first, 0), (TQ, N))
            out = lax.dynamic_update_slice(
                out, jnp.where(valid[:, None, None], o, old_o), (first, 0, 0)
            )
            lse = lax.dynamic_update_slice(lse, jnp.where(valid[:, None], s, old_s), (first, 0))
            if mass is not None:  # m [N, TQ, M']: rows relative to their own lse
                share = valid[:, None].astype(jnp.float32)  # [TQ, 1]
                if sinks32 is not None:  # the sink's share of each row goes to no page
                    with_sink = jnp.logaddexp(s, sinks32)
                    share = share * jnp.where(jnp.isneginf(s), 0.0, jnp.exp(s - with_sink))
                m = jnp.where(valid[None, :, None], m, 0.0) * share.T[:, :, None]
                mass = mass.at[b].add(jnp.sum(m, axis=1))
            return out, lse, mass

        return lax.fori_loop(0, (q_len + TQ - 1) // TQ, query_block, carry)

    carry, *_ = ringattn.match_varying(
        (out, lse, mass), q, k_pages, v_pages, page_table, lengths, cu, count
    )
    out, lse, mass = lax.fori_loop(0, count, sequence, carry)
    out, lse = ringattn.apply_sinks(out[:total], lse[:total], sinks)
    mass = None if mass is None else mass[:, :, :M]
    return PagedAttentionOutput(out.astype(q.dtype), lse, mass)


def ragged_paged_attention(
    q: Float[Array, "Q N H"],
    k_pages: Float[Array, "K P C H"] | QuantizedPages | LayerPools | Float[Array, "L K P C H"],
    v_pages: Float[Array, "K P C H"] | QuantizedPages | LayerPools | Float[Array, "L K P C H"],
    page_table: Int[Array | np.ndarray, "B M"],
    lengths: Int[Array | np.ndarray, " B"],
    cu_q_lens: Int[Array | np.ndarray, " B+1"],
    num_seqs: Int[Array | np.ndarray, ""] | Int[Array | np.ndarray, "1"] | IntScalar,
    *,
    mask: ringattn.MaskSpec | None = None,
    causal: bool | np.bool_ | None = None,
    window: Window = None,
    softcap: FloatScalar | None = None,
    scale: FloatScalar | None = None,
    sinks: Float[Array, " N"] | None = None,
    pages_per_block: IntScalar = DEFAULT_PAGES_PER_BLOCK,
    queries_per_block: IntScalar = 16,
    return_page_mass: bool | np.bool_ = False,
    layer: IntScalar | Int[Array, ""] | None = None,
    bias: Float[Array, "..."] | None = None,
) -> PagedAttentionOutput:
    """Attention for a flat batch that mixes prefill chunks and decode tokens.

    Sequence ``b < num_seqs`` owns the query rows ``cu_q_lens[b] ... cu_q_lens[b + 1] - 1`` of
    ``q``; they are its last ``q_len`` positions ``lengths[b] - q_len ... lengths[b] - 1``, so a
    prefill chunk attends to its cached past and causally to itself (its own KV must already be
    written to the pages). Sequences from ``num_seqs`` on are padding and skipped; rows owned by
    no sequence get zeros (``lse = -inf``, or ``sink``). Queries are processed
    ``queries_per_block`` rows at a time, each block walking only the pages it can see. Jit
    with options bound: ``jax.jit(functools.partial(ragged_paged_attention, window=128))``.

    Args:
      q: ``[Q, N, H]`` queries of all sequences, concatenated (``Q`` = total tokens).
      k_pages: ``[K, P, C, H]`` key pool (heads-major), same dtype as ``q``; page 0 is null.
        Or a :class:`paged.QuantizedPages` (int8 / fp8 per-token or int4 group scales, any float
        ``q``): decoded block by block in float32 inside the page walk.
      v_pages: ``[K, P, C, H]`` value pool, of the same kind (and format) as ``k_pages``.
      page_table: ``[B, M]`` int page ids per sequence (unused slots: 0).
      lengths: ``[B]`` int tokens in each sequence's cache, including its new queries.
      cu_q_lens: ``[B + 1]`` int cumulative query counts, ``cu_q_lens[0] = 0``, non-decreasing.
      num_seqs: scalar int (or shape ``[1]``), number of real sequences.
      mask: a :class:`ringattn.MaskSpec` (then none of the four keywords below).
      causal: a query at position ``p`` sees keys at positions ``<= p`` (default True).
      window: hide keys at positions ``<= p - window``; a tuple: one per query head.
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      sinks: ``[N]`` float per-query-head sink logit, or None.
      pages_per_block: pages per loop step.
      queries_per_block: query rows per step (clamped to ``Q``).
      return_page_mass: also compute ``page_mass [B, N, M]``, the probability each
        page-table slot received, summed over each sequence's query rows.
      layer: with a cache's per-layer pools (a :class:`paged.LayerPools`), the layer to
        read, as in :func:`paged_attention`: an int (that layer's own buffer) or a traced
        integer scalar (``lax.switch`` over the layers). A stacked ``[L, K, P, C, H]`` array
        is still read, at the cost of XLA copying the stack when a step also writes it.
      bias: must be None: this path takes no logit bias (ValueError, naming the
        single-device functions that take one: ringattn.blockwise_attention,
        ringattn.attention_reference, ringattn.dot_product_attention).

    Returns:
      :class:`PagedAttentionOutput` ``(out [Q, N, H] in q.dtype, lse [Q, N] float32,
      page_mass [B, N, M] or None)``.

    Raises:
      ValueError: on inconsistent ranks, shapes, dtypes or options; on an eager call, a
        length past ``M * C`` or a slot inside a length without a real page.
      NotImplementedError: any derivative through it (``jax.grad``, ``vjp``, ``jvp``,
        ``jacfwd``): forward only, as :func:`paged_attention`.

    Example:
      >>> import jax.numpy as jnp
      >>> k_pages = v_pages = jnp.ones((1, 4, 4, 8))
      >>> res = ragged_paged_attention(jnp.ones((3, 2, 8)), k_pages, v_pages,
      ...                              jnp.array([[1, 2], [3, 0]]), jnp.array([6, 1]),
      ...                              jnp.array([0, 2, 3]), 2)
      >>> res.out.shape, res.lse.shape
      ((3, 2, 8), (3, 2))
    """
    fn = "ragged_paged_attention"
    if isinstance(k_pages, LayerPools) or isinstance(v_pages, LayerPools):
        options = dict(
            mask=mask, causal=causal, window=window, softcap=softcap, scale=scale, sinks=sinks,
            pages_per_block=pages_per_block, queries_per_block=queries_per_block,
            return_page_mass=return_page_mass, bias=bias,
        )  # fmt: skip

        def call(k, v):
            return ragged_paged_attention(
                q, k, v, page_table, lengths, cu_q_lens, num_seqs, **options
            )

        return read_layer(fn, k_pages, v_pages, layer, call)
    refuse_bias(fn, bias)
    check_array(fn, "q", q, 3, jnp.floating)
    total, N, _ = q.shape
    k_pages, v_pages, heads, (K, P, C, H) = checked_pools(fn, k_pages, v_pages, layer)
    check_heads(fn, q, K, H, pool_dtype(k_pages))
    B, _ = check_table(fn, page_table, lengths, None)
    check_table_values(fn, page_table, lengths, num_pages=P, page_size=C)
    check_residual_rows(fn, k_pages, v_pages, B)
    if total < 1:
        raise ValueError(f"{fn}: q: expected at least one token row (Q >= 1), got {describe(q)}")
    check_array(fn, "cu_q_lens", cu_q_lens, 1, jnp.integer)
    if tuple(cu_q_lens.shape) != (B + 1,):
        raise ValueError(f"{fn}: cu_q_lens: expected shape ({B + 1},), got {describe(cu_q_lens)}")
    if isinstance(num_seqs, (bool, np.bool_)) or not (
        isinstance(num_seqs, (int, np.integer)) or hasattr(num_seqs, "dtype")
    ):
        raise ValueError(f"{fn}: num_seqs: expected one integer, got {num_seqs!r}")
    num_seqs = jnp.asarray(num_seqs)
    if num_seqs.size != 1 or not jnp.issubdtype(num_seqs.dtype, jnp.integer):
        raise ValueError(
            f"{fn}: num_seqs: expected one integer (scalar or shape (1,)), got {describe(num_seqs)}"
        )
    spec = resolve_mask(fn, mask, causal=causal, window=window, softcap=softcap, scale=scale)
    check_sinks(fn, sinks, N)
    pages_per_block = int_option(fn, "pages_per_block", pages_per_block, minimum=1)
    queries_per_block = int_option(fn, "queries_per_block", queries_per_block, minimum=1)
    opts = kernel_options(
        fn, spec, N, H, pages_per_block, page_table.shape[1], bool(return_page_mass)
    )
    batch = (*map(jnp.asarray, (page_table, lengths, cu_q_lens)), num_seqs.reshape(()))
    return forward_only(
        fn,
        _ragged_impl,
        q,
        (k_pages, v_pages),
        batch,
        sinks,
        heads,
        opts=opts,
        queries_per_block=min(queries_per_block, total),
    )
