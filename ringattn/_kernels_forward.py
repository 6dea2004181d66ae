"""The heads-major blockwise forward kernel (an online softmax over key blocks, in place).

The kernels read queries as ``q [B, Tp, K, G, H]`` (a free reshape of ``[B, T, N, H]``) and
keys and values heads-major, ``k, v [B, K, Sp, H]``. Once per call the queries are laid out
block-major as ``[nq, B, K, G * bq, H]`` (the ``G`` query heads of a group stacked as rows)
and the keys as ``k^T`` blocks ``[nk, B, K, H, bk]``, so each block product is a plain
row-major batched matmul over ``(B, K)``, with no transposed copy inside the loop. An
unmasked block takes its row max from the raw products and forms the scaled logits only
inside the ``exp``. Per query block, two loops with no branch visit only the live key blocks:
the full ones (unmasked), then the partial ones (masked; the order comes from
:func:`ringattn._blocks.visit_orders`, once per call). Results accumulate in place in
preallocated float32 arrays (``dynamic_update_slice`` in a loop), and
:func:`update_forward_blocks` folds further key sets (ring hops, with ``q`` laid out once for
all of them) into the same state. Block pairs are classified by :mod:`ringattn._blocks`.
"""

import functools

import jax.numpy as jnp
from jax import lax

from ringattn._batching import fold_vmap
from ringattn._blocks import (
    KernelConfig,
    Summaries,
    apply_mask,
    block_mask,
    cap_logits,
    dslice,
    kv_cols_blocks,
    kv_rows_blocks,
    rows_blocks,
    visible_keys,
    visit_orders,
)
from ringattn._online_softmax import (
    OnlineSoftmax,
    finalize_online_softmax,
    init_online_softmax,
    update_online_softmax,
)
from ringattn._varying import cast_varying, varying_axes


def init_forward_state(qg) -> OnlineSoftmax:
    """An empty float32 online-softmax state for ``qg [B, Tp, K, G, H]``, varying like ``qg``.

    Fields (heads-major): ``acc [B, K, G, Tp, H]``, ``m`` and ``l`` ``[B, K, G, Tp]``.
    """
    B, Tp, K, G, H = qg.shape
    state = init_online_softmax((B, K, G, Tp), H)
    return cast_varying(state, varying_axes(qg))


def update_forward_heads_major(
    state: OnlineSoftmax, qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows, cfg: KernelConfig
) -> OnlineSoftmax:
    """Folds one key/value set into ``state``: :func:`update_forward_blocks` of ``qg`` laid out
    block-major (``qg [B, Tp, K, G, H]``)."""
    q_rows = rows_blocks(qg, cfg.block_q)
    return update_forward_blocks(state, q_rows, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows, cfg)


def update_forward_blocks(
    state: OnlineSoftmax, q_rows, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows, cfg: KernelConfig
) -> OnlineSoftmax:
    """:func:`_update_forward`, with ``vmap`` folded into the batch axis (so it still skips).

    ``q_rows [nq, B, K, G * bq, H]`` is :func:`ringattn._blocks.rows_blocks` of the queries,
    laid out once for all key sets (a ring lays it out once for all its hops).
    """
    kernel = fold_vmap(
        functools.partial(_update_forward, cfg=cfg), in_axes=(0, 1, 0, 0, 0, 0, 0, 0, 0)
    )
    return kernel(state, q_rows, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows)


def _update_forward(
    state: OnlineSoftmax, q_rows, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows, cfg: KernelConfig
) -> OnlineSoftmax:
    """Folds one key/value set into a running online-softmax state, block by block, in place.

    Args:
      state: from :func:`init_forward_state` or a previous update (earlier key sets).
      q_rows: ``[nq, B, K, G * bq, H]`` queries, block-major (:func:`rows_blocks` of
        ``[B, Tp, K, G, H]``, ``Tp = nq * cfg.block_q``).
      kh, vh: ``[B, K, Sp, H]``; ``Sp % cfg.block_kv == 0``.
      q_pos, q_seg: ``[B, Tp]`` int32 (``q_seg`` may be None).
      kv_pos, kv_seg: ``[B, Sp]`` int32 (``kv_seg`` may be None).
      windows: ``[B, K, G]`` int32 per-query-head windows (``0``: none), or None.

    Returns:
      The state over all key sets so far. Each query block's rows are read, updated over the
      key blocks and written back with ``dynamic_update_slice`` (no stacked per-block output).
    """
    B, K, G, Tp = state.m.shape
    H = q_rows.shape[-1]
    Sp = kh.shape[2]
    bq, bk = cfg.block_q, cfg.block_kv
    nq, nk = Tp // bq, Sp // bk
    R = G * bq  # rows of one query block, all heads of a group: [G, bq] flattened
    summ = Summaries(q_pos, kv_pos, q_seg, kv_seg, bq, bk, windows, cfg.mask.dense)
    kinds = summ.kinds(cfg, nq, nk)  # [nq, nk]
    # Laid out once, block-major, so each block product is a plain row-major batched matmul:
    # s = q k^T is [B, K, R, H] x [B, K, H, bk], p v is [B, K, R, bk] x [B, K, bk, H].
    k_cols = kv_cols_blocks(kh, bk)  # [nk, B, K, H, bk]
    v_rows = kv_rows_blocks(vh, bk)  # [nk, B, K, bk, H]
    orders, n_fulls, n_lives = visit_orders(kinds)  # [nq, nk], [nq], [nq]
    mm = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)

    def one_q_block(i, state: OnlineSoftmax):
        q_blk = q_rows[i]  # [B, K, R, H]
        qp = dslice(q_pos, i * bq, bq, 1)
        qs = None if q_seg is None else dslice(q_seg, i * bq, bq, 1)

        def visit(j, st: OnlineSoftmax, masked: bool):
            k_blk, v_blk = k_cols[j], v_rows[j]  # [B, K, H, bk], [B, K, bk, H]
            if masked:
                kp = dslice(kv_pos, j * bk, bk, 1)
                ks = None if kv_seg is None else dslice(kv_seg, j * bk, bk, 1)
                mask = block_mask(cfg, summ, windows, qp, kp, qs, ks, i * bq, j * bk)
                seen = visible_keys(mask)  # [B, 1, bk, 1]
                k_blk = jnp.where(jnp.swapaxes(seen, 2, 3), k_blk, 0)
                v_blk = jnp.where(seen, v_blk, 0)
            products = mm(q_blk, k_blk)  # [B, K, R, bk] float32, unscaled
            if not masked:
                return _update_unmasked(st, products, v_blk, cfg)
            s = cap_logits(cfg, products)[0].reshape(B, K, G, bq, bk)
            s = apply_mask(s, mask).reshape(B, K, R, bk)
            return update_online_softmax(st, s, v_blk)

        block = OnlineSoftmax(
            acc=dslice(state.acc, i * bq, bq, 3).reshape(B, K, R, H),
            m=dslice(state.m, i * bq, bq, 3).reshape(B, K, R),
            l=dslice(state.l, i * bq, bq, 3).reshape(B, K, R),
        )
        order, n_full, n_live = orders[i], n_fulls[i], n_lives[i]
        block = lax.fori_loop(0, n_full, lambda t, st: visit(order[t], st, False), block)
        block = lax.fori_loop(n_full, n_live, lambda t, st: visit(order[t], st, True), block)
        return OnlineSoftmax(
            acc=lax.dynamic_update_slice_in_dim(
                state.acc, block.acc.reshape(B, K, G, bq, H), i * bq, 3
            ),
            m=lax.dynamic_update_slice_in_dim(state.m, block.m.reshape(B, K, G, bq), i * bq, 3),
            l=lax.dynamic_update_slice_in_dim(state.l, block.l.reshape(B, K, G, bq), i * bq, 3),
        )

    axes = varying_axes(state, q_rows, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows)
    return lax.fori_loop(0, nq, one_q_block, cast_varying(state, axes))


def _update_unmasked(st: OnlineSoftmax, products, v_blk, cfg: KernelConfig) -> OnlineSoftmax:
    """:func:`update_online_softmax` for a block with no mask, from unscaled products.

    Scaling and soft-capping are monotone (increasing for ``scale >= 0``), so the row max of
    the logits is taken from the raw products (of their min for a negative scale) and only
    that ``[..., R]`` vector is scaled: the logits themselves are formed inside the ``exp``,
    never stored as a separate ``[R, bk]`` array before the reduction.
    """
    extreme = jnp.max(products, axis=-1) if cfg.scale >= 0 else jnp.min(products, axis=-1)
    m_new = jnp.maximum(st.m, cap_logits(cfg, extreme)[0])
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    p = jnp.exp(cap_logits(cfg, products)[0] - m_safe[..., None])
    alpha = jnp.exp(st.m - m_safe)
    pv = jnp.matmul(p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    return OnlineSoftmax(
        acc=st.acc * alpha[..., None] + pv, m=m_new, l=st.l * alpha + jnp.sum(p, axis=-1)
    )


def forward_heads_major(qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows, cfg: KernelConfig):
    """Blockwise forward on padded arrays (heads-major keys, values and results).

    Returns:
      ``out [B, K, G, Tp, H]`` float32 and ``lse [B, K, G, Tp]`` float32.
    """
    state = update_forward_heads_major(
        init_forward_state(qg), qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows, cfg
    )
    return finalize_online_softmax(state)
