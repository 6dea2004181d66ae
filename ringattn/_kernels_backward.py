"""The heads-major blockwise backward kernel (FlashAttention-2 style, accumulating in place).

The backward pass recomputes each block's probabilities from ``(q, k, v, lse)``, so memory
stays linear in ``T + S``. It works *transposed*, with keys along the rows of every block
(``p^T``, ``[bk, G * bq]`` per ``(B, K)``), so four of its block products are plain row-major
batched matmuls (``[b, m, k] x [b, k, n]``): ``dv += p^T do``, ``dp^T = v do^T``,
``dk += ds^T q`` and ``dq^T += k^T ds^T``. The row-major copies of ``q`` and ``dout`` and the
transposed one of ``dout`` are laid out once per call, block-major.

The logits are the exception: they are recomputed as the forward computes them, ``s = q k^T``
(``[G * bq, bk]``, the same operands in the same orientation, :func:`recompute_logits`), and
transposed. ``exp(s - lse)`` is only right where ``s`` is the forward's ``s`` to the last bit:
with logits of size ``|s|``, a recomputation that rounds differently (``k q^T`` sums in
another order on XLA:CPU when ``G * bq != bk``) is off by a few ulps of ``|s|``, and so is
every probability, relatively: ``2e-2`` in ``dv`` at ``|s| ~ 2e4``, with grouped queries.

Per key block, two loops with no branch visit only the live query blocks: the full ones
(unmasked), then the partial ones (masked; :func:`ringattn._blocks.visit_orders`); a
``lax.switch`` per block pair, as before, cost XLA:CPU a conditional in every iteration. In
partial blocks hidden logits, keys and values are selected away (``where``) exactly as in the
forward, so NaN in a masked key reaches none of ``dq``, ``dk``, ``dv``.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ringattn._batching import fold_vmap
from ringattn._blocks import (
    KernelConfig,
    MaskIds,
    Summaries,
    block_mask,
    cap_logits,
    cols_blocks,
    dslice,
    kv_cols_blocks,
    rows_blocks,
    visible_keys,
    visit_orders,
)
from ringattn._varying import cast_varying, varying_axes


class QueryBlocks(NamedTuple):
    """The query side of the backward, block-major, laid out once for all key sets.

    ``q_rows, do_rows [nq, B, K, G * bq, H]``, the transpose ``do_cols [nq, B, K, H,
    G * bq]``, and ``lse, delta [nq, B, K, 1, G, bq]`` float32 (``lse`` with ``-inf``
    replaced by 0: such a row's probabilities are 0 anyway, from its masked logits).
    """

    q_rows: jax.Array
    do_rows: jax.Array
    do_cols: jax.Array
    lse: jax.Array
    delta: jax.Array


def query_blocks(qg, lse, dout, delta, bq: int) -> QueryBlocks:
    """:class:`QueryBlocks` of ``qg, dout [B, Tp, K, G, H]``, ``lse, delta [B, K, G, Tp]``."""
    return QueryBlocks(
        q_rows=rows_blocks(qg, bq),
        do_rows=rows_blocks(dout, bq),
        do_cols=cols_blocks(dout, bq),
        lse=_stat_blocks(jnp.where(jnp.isneginf(lse), 0.0, lse), bq),
        delta=_stat_blocks(delta, bq),
    )


def dq_from_blocks(dq_t, G: int):
    """``dq^T`` block-major, ``[nq, B, K, H, G * bq]`` → ``dq [B, K, G, Tp, H]``."""
    nq, B, K, H, R = dq_t.shape
    bq = R // G
    return dq_t.reshape(nq, B, K, H, G, bq).transpose(1, 2, 4, 0, 5, 3).reshape(B, K, G, nq * bq, H)


def update_backward_blocks(grads, qb: QueryBlocks, kh, vh, ids: MaskIds, cfg: KernelConfig):
    """:func:`_update_backward`, with ``vmap`` folded into the batch axis.

    ``grads = (dq_t [nq, B, K, H, G * bq], dkv)``: ``dq_t`` and ``qb`` (:func:`query_blocks`)
    are block-major, laid out once for all key sets: a ring keeps them so over all its hops.
    """
    kernel = fold_vmap(
        functools.partial(_update_backward, cfg=cfg), in_axes=((1, 0), 1, 0, 0, 0), out_axes=(1, 0)
    )
    return kernel(grads, qb, kh, vh, ids)


def recompute_logits(q_blk, k_blk_t, G: int):
    """The forward's unscaled block products, transposed: ``[B, K, bk, G, bq]`` float32.

    ``q_blk [B, K, G * bq, H]`` times ``k_blk_t [B, K, H, bk]``, exactly the product the
    forward takes (:mod:`ringattn._kernels_forward`), then transposed, so the probabilities
    ``exp(s - lse)`` see the logits ``lse`` was computed from. Computing ``k q^T`` directly
    instead rounds differently on XLA:CPU for some shapes (``G * bq != bk``), which large
    logits turn into errors of the gradients (see the module docs).
    """
    B, K, R, _ = q_blk.shape
    s = jnp.matmul(q_blk, k_blk_t, preferred_element_type=jnp.float32)  # [B, K, G * bq, bk]
    # The barrier keeps XLA from folding the transpose into the product (as k q^T, which is
    # what must not happen; for bfloat16 XLA:CPU cannot even run that dot: "Unsupported
    # element type for DotThunk").
    s = lax.optimization_barrier(s)
    return jnp.swapaxes(s, 2, 3).reshape(B, K, k_blk_t.shape[-1], G, R // G)


def _stat_blocks(x, bq: int):
    """``[B, K, G, Tp]`` → ``[nq, B, K, 1, G, bq]`` (a row of the transposed ``[bk, G, bq]``)."""
    B, K, G, Tp = x.shape
    x = x.reshape(B, K, G, Tp // bq, bq).transpose(3, 0, 1, 2, 4)
    return x[:, :, :, None]


def _update_backward(grads, qb: QueryBlocks, kh, vh, ids: MaskIds, cfg: KernelConfig):
    """Adds one key set's blockwise gradients to float32 accumulators, in place.

    Args:
      grads: ``(dq_t, dkv)``: ``dq_t [nq, B, K, H, G * bq]`` float32 accumulator of the query
        gradient, transposed and block-major (:func:`dq_from_blocks` turns it into ``dq``);
        ``dkv [B, K, Sp, 2H]`` float32 accumulator of ``concat([dk, dv], -1)`` for this key
        set.
      qb: the query side (:func:`query_blocks`): queries, output cotangent ``dout``, the
        log-sum-exp of the *complete* attention the gradient is for (for a ring hop, the
        global one; probabilities are ``exp(s - lse)``) and ``delta = sum(dout * out, -1) -
        dlse``.
      kh, vh, ids: as in :func:`ringattn._kernels_forward.update_forward_heads_major`.

    Returns:
      ``(dq_t, dkv)`` with this key set's contributions added.
    """
    dq_t, dkv = grads
    nq, B, K, H, R = dq_t.shape
    G = qb.lse.shape[4]
    Sp = kh.shape[2]
    bq, bk = cfg.block_q, cfg.block_kv
    nk = Sp // bk
    summ = Summaries(ids, bq, bk, cfg.mask.dense)
    kinds = summ.kinds(cfg, nq, nk)  # [nq, nk]
    axes = varying_axes(dq_t, dkv, qb, kh, vh, ids)
    softcap = cfg.mask.softcap
    q_rows, do_rows, do_cols, lse_b, delta_b = qb

    # k^T blocks laid out once (as the forward's): transposing each key block inside the loop
    # lets XLA fold the transpose into the dq product, and XLA:CPU cannot run the folded
    # (contracting-dim-2) bfloat16 x bfloat16 -> float32 dot ("Unsupported element type for
    # DotThunk").
    k_cols = kv_cols_blocks(kh, bk)  # [nk, B, K, H, bk]
    orders, n_fulls, n_lives = visit_orders(kinds.T)  # [nk, nq], [nk], [nk]

    def kv_block(j, carry):
        dq_t, dkv = carry
        k_all = dslice(kh, j * bk, bk, 2)  # [B, K, bk, H]
        v_all = dslice(vh, j * bk, bk, 2)
        kv_ids = ids.kv_block(j * bk, bk)  # the key side once per key block
        k_all_t = k_cols[j]  # [B, K, H, bk]
        dkv_blk = dslice(dkv, j * bk, bk, 2)  # [B, K, bk, 2H]

        def visit(i, dq_blk, dk, dv, masked: bool):
            k_blk, v_blk, k_blk_t = k_all, v_all, k_all_t
            if masked:
                mask = block_mask(cfg, summ, kv_ids.q_block(i * bq, bq), i * bq, j * bk)
                seen = visible_keys(mask)  # [B, 1, bk, 1]
                k_blk, v_blk = jnp.where(seen, k_blk, 0), jnp.where(seen, v_blk, 0)
                k_blk_t = jnp.where(jnp.swapaxes(seen, 2, 3), k_blk_t, 0)
                mask_t = jnp.moveaxis(mask, 4, 2)  # [B, K or 1, bk, G or 1, bq]
            mm = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)
            s_t, t = cap_logits(cfg, recompute_logits(q_rows[i], k_blk_t, G))
            if masked:
                s_t = jnp.where(mask_t, s_t, -jnp.inf)
            p_t = jnp.exp(s_t - lse_b[i])  # [B, K, bk, G, bq]
            dv = dv + mm(p_t.reshape(B, K, bk, R).astype(do_rows.dtype), do_rows[i])
            dp_t = mm(v_blk, do_cols[i]).reshape(B, K, bk, G, bq)
            ds_t = p_t * (dp_t - delta_b[i])
            if softcap is not None:
                ds_t = ds_t * (1.0 - t * t)
            ds_t = (ds_t * cfg.scale).reshape(B, K, bk, R)
            dk = dk + mm(ds_t.astype(q_rows.dtype), q_rows[i])
            dq_blk = dq_blk + mm(k_blk_t, ds_t.astype(kh.dtype))
            return dq_blk, dk, dv

        def step(t, carry, masked: bool):
            dq_t, dk, dv = carry
            i = order[t]
            dq_blk, dk, dv = visit(i, dq_t[i], dk, dv, masked)
            dq_t = lax.dynamic_update_index_in_dim(dq_t, dq_blk, i, 0)
            return dq_t, dk, dv

        order, n_full, n_live = orders[j], n_fulls[j], n_lives[j]
        carry = (dq_t, dkv_blk[..., :H], dkv_blk[..., H:])
        carry = lax.fori_loop(0, n_full, lambda t, c: step(t, c, False), carry)
        dq_t, dk, dv = lax.fori_loop(n_full, n_live, lambda t, c: step(t, c, True), carry)
        dkv = lax.dynamic_update_slice_in_dim(dkv, jnp.concatenate([dk, dv], -1), j * bk, 2)
        return dq_t, dkv

    return lax.fori_loop(0, nk, kv_block, cast_varying((dq_t, dkv), axes))


def backward_heads_major(qg, kh, vh, ids: MaskIds, cotangents, cfg: KernelConfig):
    """Blockwise backward on padded arrays (row-major queries, heads-major the rest).

    ``cotangents = (lse, dout, delta)``: ``lse, delta [B, K, G, Tp]`` float32 and ``dout
    [B, Tp, K, G, H]`` (:func:`query_blocks`).

    Returns:
      ``dq [B, K, G, Tp, H]``, ``dk, dv [B, K, Sp, H]``, all float32, for the key set given.
    """
    B, Tp, K, G, H = qg.shape
    Sp = kh.shape[2]
    bq = cfg.block_q
    dq_t = jnp.zeros((Tp // bq, B, K, H, G * bq), jnp.float32)
    dkv = jnp.zeros((B, K, Sp, 2 * H), jnp.float32)
    lse, dout, delta = cotangents
    qb = query_blocks(qg, lse, dout, delta, bq)
    dq_t, dkv = update_backward_blocks((dq_t, dkv), qb, kh, vh, ids, cfg)
    return dq_from_blocks(dq_t, G), dkv[..., :H], dkv[..., H:]
