"""Attention over a paged KV pool, walking each sequence's pages a block at a time.

Layout (heads-major, as JAX's TPU paged attention): ``k_pages, v_pages [K, P, C, H]``. Token
``i`` of sequence ``b`` and kv head ``h`` lives at ``k_pages[h, page_table[b, i // C], i % C]``.
Page 0 is the reserved *null page*: padding slots of ``page_table`` point to it and writes to it
are dropped.

Each sequence is processed on its own (a ``lax.map`` over the batch): a dynamic-trip-count loop
visits only the blocks of ``pages_per_block`` pages that hold keys some query can see (below the
sequence's length, not in any query's causal future, inside the sliding window). One step
gathers the block's pages for all kv heads (``[K, pages_per_block * C, H]``, a few MiB at
most, so the copy is consumed from cache; no sequence's whole KV is ever gathered), forms the
logits of the ``G`` query heads of each kv head against it as one batched matmul, and folds
them into the online softmax of :mod:`ringattn`. With ``return_page_mass`` it also keeps each
page's log-sum-exp per query, which the final ``lse`` turns into exact probability mass.

Safety by construction (nothing value-dependent can raise under ``jit``):

* a token is visible only if its position is ``< lengths[b]`` *and* its page id is a real page
  (``0 < id < P``); the null page and out-of-range ids (negative, ``>= P``) are masked, and the
  gather index is clamped into range first, so a corrupt table can never pull in another
  sequence's data or NaN from a freed page: masked values are zeroed before the ``p @ v``
  product, so even NaN/Inf garbage in unused page slots never reaches a result;
* a query with no visible key gets ``out = 0`` and ``lse = -inf``.

Use :func:`paged.validate_page_table` eagerly (tests, notebooks) to catch such tables loudly.

The loops are ``while`` loops with dynamic trip counts, so these functions are forward-only
(inference): reverse-mode differentiation raises.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from ringattn import (
    MaskSpec,
    finalize_online_softmax,
    init_online_softmax,
    update_online_softmax,
)

__all__ = ["DEFAULT_PAGES_PER_BLOCK", "paged_attention", "ragged_paged_attention"]

# Tuned on a 2-core CPU for C = 16, K = 8, H = 128 float32 (benchmarks/bench_paged.py): 16 to
# 64 pages per block were equally fast there (one block of K is 2 MiB at 32 pages, so the
# per-block gather still streams through cache), 8 or 128 slower (loop overhead, cache).
DEFAULT_PAGES_PER_BLOCK = 32


def _describe(x) -> str:
    return f"shape {tuple(x.shape)} dtype {x.dtype}"


def _check_array(fn: str, name: str, x, ndim: int, kind) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{fn}: {name} must be an array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{fn}: {name} must have rank {ndim}, got {_describe(x)}")
    if not jnp.issubdtype(x.dtype, kind):
        what = "floating point" if kind is jnp.floating else "an integer array"
        raise ValueError(f"{fn}: {name} must be {what}, got {_describe(x)}")


def check_pages(fn: str, k_pages, v_pages) -> tuple[int, int, int, int]:
    """Checks ``k_pages, v_pages [K, P, C, H]``; returns ``(K, P, C, H)``."""
    _check_array(fn, "k_pages", k_pages, 4, jnp.floating)
    _check_array(fn, "v_pages", v_pages, 4, jnp.floating)
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(
            f"{fn}: k_pages and v_pages must match, got k_pages {_describe(k_pages)} "
            f"and v_pages {_describe(v_pages)}"
        )
    K, P, C, H = k_pages.shape
    if min(K, P, C, H) < 1:
        raise ValueError(
            f"{fn}: k_pages must have non-empty dims [K, P, C, H], got {k_pages.shape}"
        )
    return K, P, C, H


def check_table(fn: str, page_table, lengths, B: int | None) -> tuple[int, int]:
    """Checks ``page_table [B, M]`` and ``lengths [B]`` (integers); returns ``(B, M)``."""
    _check_array(fn, "page_table", page_table, 2, jnp.integer)
    _check_array(fn, "lengths", lengths, 1, jnp.integer)
    Bt, M = page_table.shape
    if B is not None and Bt != B:
        raise ValueError(f"{fn}: page_table must have {B} rows (the batch), got {page_table.shape}")
    if lengths.shape != (Bt,):
        raise ValueError(f"{fn}: lengths must have shape ({Bt},), got {_describe(lengths)}")
    if M < 1:
        raise ValueError(f"{fn}: page_table must have at least one column, got {page_table.shape}")
    return Bt, M


def _check_pages_per_block(fn: str, pages_per_block) -> None:
    if (
        isinstance(pages_per_block, bool)
        or not isinstance(pages_per_block, (int, np.integer))
        or pages_per_block < 1
    ):
        raise ValueError(f"{fn}: pages_per_block must be a positive int, got {pages_per_block!r}")


def _check_heads(fn: str, q_heads: int, q_dim: int, q_dtype, K: int, H: int, pool_dtype) -> None:
    if q_dim != H:
        raise ValueError(f"{fn}: head dim of q ({q_dim}) must equal that of k_pages ({H})")
    if q_heads % K != 0:
        raise ValueError(
            f"{fn}: query heads N={q_heads} must be a multiple of kv heads K={K} (MHA, GQA, MQA)"
        )
    if q_dtype != pool_dtype:
        raise ValueError(f"{fn}: q dtype {q_dtype} must equal the pages' dtype {pool_dtype}")


def _vma(x) -> set:
    """The manual mesh axes ``x`` varies over (empty outside ``shard_map``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # current JAX: a ManualAxisType
    if mat is not None and hasattr(mat, "varying"):
        return set(mat.varying)
    return set(getattr(aval, "vma", ()) or ())


def _varying_like(tree, *refs):
    """Casts ``tree`` to vary over every manual mesh axis any of ``refs`` varies over.

    Inside ``shard_map`` with ``check_vma=True`` a loop carry must keep one type; an initial
    state built from constants is invariant while the loop body makes it device-varying.
    Outside ``shard_map`` this is the identity.
    """
    axes = set()
    for ref in refs:
        axes |= _vma(ref)
    if not axes:
        return tree
    axes = tuple(sorted(axes))

    def cast(x):
        missing = tuple(a for a in axes if a not in _vma(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def _kernel_options(H, scale, causal, window, softcap, pages_per_block, M, page_mass) -> tuple:
    """The hashable static options of the page-walking kernels."""
    return (
        float(scale) if scale is not None else 1.0 / float(np.sqrt(H)),
        bool(causal),
        None if window is None else int(window),
        None if softcap is None else float(softcap),
        min(int(pages_per_block), M),
        bool(page_mass),
    )


def _pad_table(page_table, pages_per_block: int):
    """Pads ``[B, M]`` with null-page columns to a multiple of ``pages_per_block``."""
    M = page_table.shape[1]
    extra = -M % pages_per_block
    page_table = page_table.astype(jnp.int32)
    if extra:
        page_table = jnp.pad(page_table, ((0, 0), (0, extra)))
    return page_table


def _attend_sequence(q_rows, q_pos, q_valid, table_row, length, k_pages, v_pages, *, opts):
    """Attention of ``R`` query rows of one sequence over its pages.

    Args:
      q_rows: ``[R, N, H]`` queries.
      q_pos: ``[R]`` int32 positions of the queries.
      q_valid: ``[R]`` bool; invalid rows see nothing.
      table_row: ``[M']`` int32 page ids, ``M'`` a multiple of ``pages_per_block``.
      length: scalar int32, number of valid tokens of the sequence.
      k_pages, v_pages: ``[K, P, C, H]`` pools.
      opts: ``(scale, causal, window, softcap, pages_per_block, want_page_lse)``.

    Returns:
      ``out [R, N, H]`` float32, ``lse [R, N]`` float32, and ``page_lse [N, R, M']`` (the
      log-sum-exp of each page's logits per query row; ``-inf`` where unseen) or None.
    """
    scale, causal, window, softcap, pages_per_block, want_page_lse = opts
    K, P, C, H = k_pages.shape
    R, N, _ = q_rows.shape
    G = N // K
    GR = G * R
    span = pages_per_block * C
    num_blocks = table_row.shape[0] // pages_per_block
    qh = q_rows.reshape(R, K, G, H).transpose(1, 2, 0, 3).reshape(K, GR, H)  # [K, G*R, H]
    row_pos = jnp.tile(q_pos, G)  # [G*R], row g*R + r holds query r
    row_valid = jnp.tile(q_valid, G)

    # The blocks holding keys some valid query can see: [j_lo, j_hi).
    length = jnp.asarray(length, jnp.int32)
    hi = length
    if causal:
        hi = jnp.minimum(hi, jnp.max(jnp.where(q_valid, q_pos, -1)) + 1)
    hi = jnp.maximum(hi, 0)
    lo = jnp.int32(0)
    if window is not None:
        lowest_q = jnp.min(jnp.where(q_valid, q_pos, jnp.iinfo(jnp.int32).max - window))
        lo = jnp.clip(lowest_q - window + 1, 0, hi)
    j_lo = lo // span
    j_hi = jnp.minimum((hi + span - 1) // span, num_blocks)
    j_hi = jnp.where(jnp.any(q_valid), jnp.maximum(j_hi, j_lo), j_lo)

    def body(j, carry):
        state, page_lse = carry
        ids = lax.dynamic_slice(table_row, (j * pages_per_block,), (pages_per_block,))
        page_ok = (ids > 0) & (ids < P)  # the null page and out-of-range ids are masked
        ids = jnp.where(page_ok, ids, 0)
        kb = jnp.take(k_pages, ids, axis=1, mode="clip").reshape(K, span, H)
        vb = jnp.take(v_pages, ids, axis=1, mode="clip").reshape(K, span, H)
        kv_pos = j * span + jnp.arange(span, dtype=jnp.int32)
        token_ok = jnp.repeat(page_ok, C) & (kv_pos < length)  # [span]
        vb = jnp.where(token_ok[None, :, None], vb, jnp.zeros((), vb.dtype))
        s = jnp.einsum("krh,ksh->krs", qh, kb, preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        visible = token_ok[None, :] & row_valid[:, None]  # [G*R, span]
        if causal:
            visible &= kv_pos[None, :] <= row_pos[:, None]
        if window is not None:
            visible &= kv_pos[None, :] > row_pos[:, None] - window
        s = jnp.where(visible[None], s, -jnp.inf)  # [K, G*R, span]
        state = update_online_softmax(state, s, vb)
        if want_page_lse:
            sp = s.reshape(K, GR, pages_per_block, C)
            m = jnp.max(sp, axis=-1)
            m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
            total = jnp.sum(jnp.exp(sp - m_safe[..., None]), axis=-1)
            blk = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
            page_lse = lax.dynamic_update_slice(page_lse, blk, (0, 0, j * pages_per_block))
        return state, page_lse

    state = init_online_softmax((K, GR), H)
    page_lse = (
        jnp.full((K, GR, table_row.shape[0]), -jnp.inf, jnp.float32) if want_page_lse else None
    )
    carry = _varying_like(
        (state, page_lse), q_rows, q_pos, q_valid, table_row, length, k_pages, v_pages
    )
    state, page_lse = lax.fori_loop(j_lo, j_hi, body, carry)
    out, lse = finalize_online_softmax(state, jnp.float32)  # [K, G*R, H], [K, G*R]
    out = out.reshape(K, G, R, H).transpose(2, 0, 1, 3).reshape(R, N, H)
    if want_page_lse:
        lse_rows = lse.reshape(K, G, R)
        weight = jnp.where(
            jnp.isneginf(lse_rows)[..., None],
            0.0,
            jnp.exp(page_lse.reshape(K, G, R, -1) - lse_rows[..., None]),
        )
        page_mass = weight.reshape(N, R, -1)  # [N, R, M']
    else:
        page_mass = None
    lse = lse.reshape(K, G, R).transpose(2, 0, 1).reshape(R, N)
    return out, lse, page_mass


@functools.partial(jax.jit, static_argnames=("opts",))
def _paged_attention_impl(q, k_pages, v_pages, page_table, lengths, q_positions, *, opts):
    M = page_table.shape[1]
    table = _pad_table(page_table, opts[4])
    lengths = lengths.astype(jnp.int32)
    q_valid = jnp.ones(q.shape[:2], bool)

    def one(args):
        q_b, pos_b, valid_b, row_b, len_b = args
        out, lse, mass = _attend_sequence(
            q_b, pos_b, valid_b, row_b, len_b, k_pages, v_pages, opts=opts
        )
        mass = jnp.sum(mass, axis=1)[:, :M] if mass is not None else None  # [N, M]
        return out, lse, mass

    out, lse, mass = lax.map(one, (q, q_positions, q_valid, table, lengths))
    return out.astype(q.dtype), lse, mass


def paged_attention(
    q: Float[Array, "B T N H"],
    k_pages: Float[Array, "K P C H"],
    v_pages: Float[Array, "K P C H"],
    page_table: Int[Array, "B M"],
    lengths: Int[Array, " B"],
    *,
    q_positions: Int[Array, "B T"] | None = None,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    pages_per_block: int = DEFAULT_PAGES_PER_BLOCK,
    return_lse: bool = False,
    return_page_mass: bool = False,
):
    """Decode attention of a few query tokens per sequence over a paged KV pool.

    Walks each sequence's pages ``pages_per_block`` at a time with an online softmax, skipping
    blocks beyond its length, in every query's causal future or outside the window. Jittable
    with static shapes; forward only.

    Args:
      q: ``[B, T, N, H]`` queries, ``T`` small (a decode step, speculative tokens).
      k_pages: ``[K, P, C, H]`` key pool (heads-major), same dtype as ``q``; page 0 is null.
      v_pages: ``[K, P, C, H]`` value pool.
      page_table: ``[B, M]`` int page ids; slot ``j`` of sequence ``b`` holds its tokens
        ``j * C ... j * C + C - 1``. Unused slots point to page 0.
      lengths: ``[B]`` int number of valid tokens of each sequence (``<= M * C``).
      q_positions: ``[B, T]`` int positions of the queries, default the last ``T`` positions
        ``lengths - T ... lengths - 1``.
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      window: hide keys at positions ``<= p - window``.
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      pages_per_block: pages per loop step (a speed knob; any positive int).
      return_lse: also return ``lse [B, T, N]`` float32.
      return_page_mass: also return ``page_mass [B, N, M]`` float32, the softmax probability
        each page-table slot received, summed over the ``T`` queries (for eviction/offload
        policies).

    Returns:
      ``out [B, T, N, H]`` in ``q.dtype``; or a tuple ``(out, lse?, page_mass?)`` in that order
      when any extra is requested. A query that sees no key gets ``out = 0``, ``lse = -inf``.

    Raises:
      ValueError: on inconsistent ranks, shapes, dtypes or options.

    Example:
      >>> import jax.numpy as jnp
      >>> k_pages = v_pages = jnp.ones((1, 3, 4, 8))
      >>> out = paged_attention(jnp.ones((1, 1, 2, 8)), k_pages, v_pages,
      ...                       jnp.array([[2, 1]]), jnp.array([6]))
      >>> out.shape, float(out[0, 0, 0, 0])
      ((1, 1, 2, 8), 1.0)
    """
    fn = "paged_attention"
    _check_array(fn, "q", q, 4, jnp.floating)
    B, T, N, Hq = q.shape
    K, P, C, H = check_pages(fn, k_pages, v_pages)
    _check_heads(fn, N, Hq, q.dtype, K, H, k_pages.dtype)
    check_table(fn, page_table, lengths, B)
    if T < 1:
        raise ValueError(f"{fn}: q must hold at least one query token, got {_describe(q)}")
    MaskSpec(causal=causal, window=window, softcap=softcap, scale=scale)
    _check_pages_per_block(fn, pages_per_block)
    if q_positions is None:
        q_positions = lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T, dtype=jnp.int32)
    else:
        _check_array(fn, "q_positions", q_positions, 2, jnp.integer)
        if q_positions.shape != (B, T):
            raise ValueError(
                f"{fn}: q_positions must have shape {(B, T)}, got {_describe(q_positions)}"
            )
    opts = _kernel_options(
        H, scale, causal, window, softcap, pages_per_block, page_table.shape[1], return_page_mass
    )
    out, lse, mass = _paged_attention_impl(
        q, k_pages, v_pages, page_table, lengths, q_positions.astype(jnp.int32), opts=opts
    )
    extras = []
    if return_lse:
        extras.append(lse)
    if return_page_mass:
        extras.append(mass)
    return (out, *extras) if extras else out


@functools.partial(jax.jit, static_argnames=("opts", "queries_per_block"))
def _ragged_impl(
    q, k_pages, v_pages, page_table, lengths, cu_q_lens, num_seqs, *, opts, queries_per_block
):
    total, N, H = q.shape
    B = page_table.shape[0]
    TQ = queries_per_block
    table = _pad_table(page_table, opts[4])
    lengths = lengths.astype(jnp.int32)
    cu = cu_q_lens.astype(jnp.int32)
    q_pad = jnp.pad(q, ((0, TQ), (0, 0), (0, 0)))
    out = jnp.zeros((total + TQ, N, H), jnp.float32)
    lse = jnp.full((total + TQ, N), -jnp.inf, jnp.float32)
    count = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(()), 0, B)
    rows = jnp.arange(TQ, dtype=jnp.int32)

    def sequence(b, carry):
        start = cu[b]
        q_len = jnp.maximum(cu[b + 1] - start, 0)
        length = lengths[b]
        row = table[b]

        def query_block(i, carry):
            out, lse = carry
            first = start + i * TQ
            local = i * TQ + rows
            # Rows past this sequence's queries, or outside [0, total) (a corrupt cu_q_lens
            # whose slice start dynamic_slice would clamp), are not written.
            valid = (local < q_len) & (first >= 0) & (first + rows < total)
            q_blk = lax.dynamic_slice(q_pad, (first, 0, 0), (TQ, N, H))
            pos = length - q_len + local
            o, s, _ = _attend_sequence(q_blk, pos, valid, row, length, k_pages, v_pages, opts=opts)
            old_o = lax.dynamic_slice(out, (first, 0, 0), (TQ, N, H))
            old_s = lax.dynamic_slice(lse, (first, 0), (TQ, N))
            out = lax.dynamic_update_slice(
                out, jnp.where(valid[:, None, None], o, old_o), (first, 0, 0)
            )
            lse = lax.dynamic_update_slice(lse, jnp.where(valid[:, None], s, old_s), (first, 0))
            return out, lse

        return lax.fori_loop(0, (q_len + TQ - 1) // TQ, query_block, carry)

    carry = _varying_like((out, lse), q, k_pages, v_pages, page_table, lengths, cu, count)
    out, lse = lax.fori_loop(0, count, sequence, carry)
    return out[:total].astype(q.dtype), lse[:total]


def ragged_paged_attention(
    q: Float[Array, "Q N H"],
    k_pages: Float[Array, "K P C H"],
    v_pages: Float[Array, "K P C H"],
    page_table: Int[Array, "B M"],
    lengths: Int[Array, " B"],
    cu_q_lens: Int[Array, " B+1"],
    num_seqs: Int[Array, ""] | int,
    *,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    pages_per_block: int = DEFAULT_PAGES_PER_BLOCK,
    queries_per_block: int = 16,
    return_lse: bool = False,
):
    """Attention for a flat batch that mixes prefill chunks and decode tokens.

    Sequence ``b < num_seqs`` owns the query rows ``cu_q_lens[b] ... cu_q_lens[b + 1] - 1`` of
    ``q``; they are its last ``q_len`` positions ``lengths[b] - q_len ... lengths[b] - 1``, so a
    prefill chunk attends to its cached past and causally to itself (its own KV must already be
    written to the pages). Sequences from ``num_seqs`` on are padding and skipped; rows owned by
    no sequence get zeros (``lse = -inf``). Queries are processed ``queries_per_block`` rows at
    a time, each block walking only the pages it can see.

    Args:
      q: ``[Q, N, H]`` queries of all sequences, concatenated (``Q`` = total tokens).
      k_pages: ``[K, P, C, H]`` key pool (heads-major), same dtype as ``q``; page 0 is null.
      v_pages: ``[K, P, C, H]`` value pool.
      page_table: ``[B, M]`` int page ids per sequence (unused slots: 0).
      lengths: ``[B]`` int tokens in each sequence's cache, including its new queries.
      cu_q_lens: ``[B + 1]`` int cumulative query counts, ``cu_q_lens[0] = 0``, non-decreasing.
      num_seqs: scalar int (or shape ``[1]``), number of real sequences.
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      window: hide keys at positions ``<= p - window``.
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      pages_per_block: pages per loop step.
      queries_per_block: query rows per step (clamped to ``Q``).
      return_lse: also return ``lse [Q, N]`` float32.

    Returns:
      ``out [Q, N, H]`` in ``q.dtype``, and ``lse [Q, N]`` if ``return_lse``.

    Raises:
      ValueError: on inconsistent ranks, shapes, dtypes or options.

    Example:
      >>> import jax.numpy as jnp
      >>> k_pages = v_pages = jnp.ones((1, 4, 4, 8))
      >>> out = ragged_paged_attention(jnp.ones((3, 2, 8)), k_pages, v_pages,
      ...                              jnp.array([[1, 2], [3, 0]]), jnp.array([6, 1]),
      ...                              jnp.array([0, 2, 3]), 2)
      >>> out.shape
      (3, 2, 8)
    """
    fn = "ragged_paged_attention"
    _check_array(fn, "q", q, 3, jnp.floating)
    total, N, Hq = q.shape
    K, P, C, H = check_pages(fn, k_pages, v_pages)
    _check_heads(fn, N, Hq, q.dtype, K, H, k_pages.dtype)
    B, _ = check_table(fn, page_table, lengths, None)
    if total < 1:
        raise ValueError(f"{fn}: q must hold at least one token row, got {_describe(q)}")
    _check_array(fn, "cu_q_lens", cu_q_lens, 1, jnp.integer)
    if cu_q_lens.shape != (B + 1,):
        raise ValueError(f"{fn}: cu_q_lens must have shape ({B + 1},), got {_describe(cu_q_lens)}")
    num_seqs = jnp.asarray(num_seqs)
    if num_seqs.size != 1 or not jnp.issubdtype(num_seqs.dtype, jnp.integer):
        raise ValueError(
            f"{fn}: num_seqs must be one integer (scalar or shape (1,)), got {_describe(num_seqs)}"
        )
    MaskSpec(causal=causal, window=window, softcap=softcap, scale=scale)
    _check_pages_per_block(fn, pages_per_block)
    if (
        isinstance(queries_per_block, bool)
        or not isinstance(queries_per_block, (int, np.integer))
        or queries_per_block < 1
    ):
        raise ValueError(
            f"{fn}: queries_per_block must be a positive int, got {queries_per_block!r}"
        )
    opts = _kernel_options(
        H, scale, causal, window, softcap, pages_per_block, page_table.shape[1], False
    )
    out, lse = _ragged_impl(
        q,
        k_pages,
        v_pages,
        page_table,
        lengths,
        cu_q_lens,
        num_seqs.reshape(()),
        opts=opts,
        queries_per_block=min(int(queries_per_block), total),
    )
    return (out, lse) if return_lse else out
