"""The page-walking kernel behind every paged attention function.

One sequence at a time: a dynamic-trip-count loop visits only the blocks of
``pages_per_block`` pages that hold keys some query can see (below the sequence's length, not
in every query's causal future, inside the widest sliding window). One step gathers the
block's pages for all kv heads (``[K, pages_per_block * C, H]``), forms the logits of the
``G`` query heads of each kv head against it as one batched matmul, and folds them into the
online softmax of :mod:`ringattn`. With ``want_page_lse`` it also keeps each page's
log-sum-exp per query row, which the final ``lse`` turns into exact probability mass.

Masked keys have no effect: a key that no query may see (past the length, on the null page
or an out-of-range id, causal future, outside its head's window) is removed by ``where`` on
the logits (``-inf``) and on the values (zeros) before ``p @ v``, so NaN or inf stored there
never reaches a result.

Quantized pools (:class:`paged.QuantizedPages`) are decoded one block at a time: the step
gathers the block's stored values and scales and multiplies them out in float32
(``[K, pages_per_block * C, H]``; int4 unpacks its nibbles and applies its group scales here), so no decoded copy of the pool ever exists; queries are
then taken in float32 too. A NaN scale in a slot nobody may see is removed by the same
selects.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

import ringattn
from paged import _kivi
from paged._quantized import decode_pages, is_quantized
from ringattn import finalize_online_softmax, init_online_softmax, update_online_softmax

__all__ = ["KernelOptions", "attend_sequence", "kernel_options", "pad_table"]

# Stands in for "no window" in a per-head window vector: any position minus it stays far
# below 0 without int32 overflow for sequences up to 2**30 tokens.
_NO_WINDOW = 1 << 30


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Hashable static options of the kernel (built by :func:`kernel_options`).

    Attributes:
      scale: logit scale.
      causal: causal mask.
      window: ``None``, one int for every head, or a tuple of ``N`` per-query-head windows
        (``None`` entries: no window) when they differ.
      softcap: logit soft cap or None.
      pages_per_block: pages per loop step (already clamped to ``M``).
      want_page_lse: also return each page's log-sum-exp.
    """

    scale: float
    causal: bool
    window: int | tuple[int | None, ...] | None
    softcap: float | None
    pages_per_block: int
    want_page_lse: bool

    @property
    def widest_window(self) -> int | None:
        if isinstance(self.window, tuple):
            return None if None in self.window else max(self.window)
        return self.window


def kernel_options(
    fn: str, spec: ringattn.MaskSpec, N: int, H: int, pages_per_block: int, M: int, page_mass
) -> KernelOptions:
    """Static kernel options from a validated :class:`ringattn.MaskSpec`."""
    window = spec.window
    if isinstance(window, tuple):
        if len(window) != N:
            raise ValueError(
                f"{fn}: window: expected a tuple of one window per query head (length "
                f"N={N}), got length {len(window)}"
            )
        if len(set(window)) == 1:
            window = window[0]  # every head alike: the cheaper shared mask
    return KernelOptions(
        scale=float(spec.scale) if spec.scale is not None else 1.0 / float(H) ** 0.5,
        causal=bool(spec.causal),
        window=window,
        softcap=spec.softcap,
        pages_per_block=min(int(pages_per_block), M),
        want_page_lse=bool(page_mass),
    )


def pad_table(page_table, pages_per_block: int):
    """Pads ``[B, M]`` with null-page columns to a multiple of ``pages_per_block``."""
    M = page_table.shape[1]
    extra = -M % pages_per_block
    page_table = page_table.astype(jnp.int32)
    if extra:
        page_table = jnp.pad(page_table, ((0, 0), (0, extra)))
    return page_table


def take_block(pool, ids, span: int, heads=None):
    """Pages ``ids [n]`` of a ``[K, P, C, H]`` pool as ``[K, n * C, H]`` (decoded to float32
    if quantized; ids already clamped into range). With ``heads [K]``, the pool is a stack of
    layers' heads ``[L * K, P, C, H]`` and rows ``heads`` are read: one gather from the
    stack, never a copy of a layer's whole pool."""
    H = pool.shape[-1]
    if heads is None:
        K = pool.shape[0]
        pick = lambda x: jnp.take(x, ids, axis=1, mode="clip")
    else:
        K = heads.shape[0]
        pick = lambda x: x.at[heads[:, None], ids[None, :]].get(mode="clip")
    if is_quantized(pool):
        part = jax.tree.map(pick, pool[:, :])
        return decode_pages(part).reshape(K, span, H)  # [K, n, C, H] decoded
    return pick(pool).reshape(K, span, H)


def attend_sequence(rows, table_row, length, pools, *, opts, heads=None):
    """Attention of ``R`` query rows of one sequence over its pages.

    Args:
      rows: ``(q_rows [R, N, H], q_pos [R] int32, q_valid [R] bool)``: the queries, their
        positions, and which are valid (invalid rows see nothing).
      table_row: ``[M']`` int32 page ids, ``M'`` a multiple of ``pages_per_block``.
      length: scalar int32, number of valid tokens of the sequence.
      pools: ``(k_pages, v_pages)``: ``[K, P, C, H]`` pools (float arrays or
        ``QuantizedPages``), or with ``heads``, stacks ``[L * K, P, C, H]`` of every layer's
        heads.
      opts: :class:`KernelOptions`.
      heads: ``[K]`` int32 rows of the stacks to read (one layer's heads), or None.

    Returns:
      ``out [R, N, H]`` float32, ``lse [R, N]`` float32, and ``page_mass [N, R, M']`` (the
      probability each page received per query row) or None.
    """
    (q_rows, q_pos, q_valid), (k_pages, v_pages) = rows, pools
    _, P, C, H = k_pages.shape
    K = k_pages.shape[0] if heads is None else heads.shape[0]
    R, N, _ = q_rows.shape
    residual_k = getattr(k_pages, "residual", None)
    residual_v = getattr(v_pages, "residual", None)
    G = N // K
    GR = G * R
    ppb = opts.pages_per_block
    span = ppb * C
    num_blocks = table_row.shape[0] // ppb
    qh = q_rows.reshape(R, K, G, H).transpose(1, 2, 0, 3).reshape(K, GR, H)  # [K, G*R, H]
    if is_quantized(k_pages):
        qh = qh.astype(jnp.float32)  # against float32 decoded keys
    row_pos = jnp.tile(q_pos, G)  # [G*R], row g*R + r holds query r
    row_valid = jnp.tile(q_valid, G)
    if isinstance(opts.window, tuple):  # query head n = k * G + g
        head_window = jnp.asarray(
            [_NO_WINDOW if w is None else w for w in opts.window], jnp.int32
        ).reshape(K, G)
        row_window = jnp.repeat(head_window, R, axis=1)  # [K, G*R]
    else:
        row_window = None

    # The blocks holding keys some valid query can see: [j_lo, j_hi).
    length = jnp.asarray(length, jnp.int32)
    hi = length
    if opts.causal:
        hi = jnp.minimum(hi, jnp.max(jnp.where(q_valid, q_pos, -1)) + 1)
    hi = jnp.maximum(hi, 0)
    lo = jnp.int32(0)
    widest = opts.widest_window
    if widest is not None:
        lowest_q = jnp.min(jnp.where(q_valid, q_pos, jnp.iinfo(jnp.int32).max - widest))
        lo = jnp.clip(lowest_q - widest + 1, 0, hi)
    j_lo = lo // span
    j_hi = jnp.minimum((hi + span - 1) // span, num_blocks)
    j_hi = jnp.where(jnp.any(q_valid), jnp.maximum(j_hi, j_lo), j_lo)

    def body(j, carry):
        state, page_lse = carry
        ids = lax.dynamic_slice(table_row, (j * ppb,), (ppb,))
        page_ok = (ids > 0) & (ids < P)  # the null page and out-of-range ids are masked
        ids = jnp.where(page_ok, ids, 0)
        kb = take_block(k_pages, ids, span, heads)
        vb = take_block(v_pages, ids, span, heads)
        kv_pos = j * span + jnp.arange(span, dtype=jnp.int32)
        if residual_k is not None:  # kivi2: window pages are read from the residual
            kb = _kivi.substitute_residual(kb, residual_k, kv_pos, k_pages.residual_len, C)
            vb = _kivi.substitute_residual(vb, residual_v, kv_pos, v_pages.residual_len, C)
        token_ok = jnp.repeat(page_ok, C) & (kv_pos < length)  # [span]
        s = jnp.einsum("krh,ksh->krs", qh, kb, preferred_element_type=jnp.float32)
        s = s * opts.scale
        if opts.softcap is not None:
            s = opts.softcap * jnp.tanh(s / opts.softcap)
        visible = (token_ok[None, :] & row_valid[:, None])[None]  # [1, G*R, span]
        if opts.causal:
            visible &= (kv_pos[None, :] <= row_pos[:, None])[None]
        if row_window is not None:
            visible &= kv_pos[None, None, :] > row_pos[None, :, None] - row_window[:, :, None]
        elif opts.window is not None:
            visible &= (kv_pos[None, :] > row_pos[:, None] - opts.window)[None]
        s = jnp.where(visible, s, -jnp.inf)  # [K, G*R, span]
        # A value no row of this block may see is zeroed (a select, not a product), so NaN or
        # inf stored there cannot reach p @ v through a zero probability.
        seen = jnp.any(visible, axis=(0, 1))  # [span]
        vb = jnp.where(seen[None, :, None], vb, jnp.zeros((), vb.dtype))
        state = update_online_softmax(state, s, vb)
        if opts.want_page_lse:
            sp = s.reshape(K, GR, ppb, C)
            m = jnp.max(sp, axis=-1)
            m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
            total = jnp.sum(jnp.exp(sp - m_safe[..., None]), axis=-1)
            blk = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
            page_lse = lax.dynamic_update_slice(page_lse, blk, (0, 0, j * ppb))
        return state, page_lse

    state = init_online_softmax((K, GR), H)
    page_lse = (
        jnp.full((K, GR, table_row.shape[0]), -jnp.inf, jnp.float32) if opts.want_page_lse else None
    )
    # Inside shard_map (check_vma=True) a loop carry keeps one type: vary it like the inputs.
    carry, *_ = ringattn.match_varying(
        (state, page_lse), q_rows, q_pos, q_valid, table_row, length, k_pages, v_pages
    )
    state, page_lse = lax.fori_loop(j_lo, j_hi, body, carry)
    out, lse = finalize_online_softmax(state, jnp.float32)  # [K, G*R, H], [K, G*R]
    out = out.reshape(K, G, R, H).transpose(2, 0, 1, 3).reshape(R, N, H)
    if opts.want_page_lse:
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
