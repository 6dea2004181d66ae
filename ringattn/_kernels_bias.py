"""The blockwise kernels with traced logit terms: an additive bias and a boolean mask.

:func:`ringattn.blockwise_attention` takes ``bias [B or 1, N or 1, T or 1, S or 1]``
(added to the logits after scaling and soft-capping) and
:func:`ringattn.dot_product_attention` also a traced boolean ``mask`` of such a shape (True:
the query may see the key). Both are :class:`LogitTerms`, laid out heads-major
``[Bb, K or 1, G or 1, Tp or 1, Sp or 1]`` (:mod:`ringattn._bias`), and each kernel slices the
block it needs, ``[Bb, K or 1, G or 1, bq or 1, bk or 1]``, inside its loop: neither is ever
broadcast to ``[B, N, T, S]``.

The loops are those of :mod:`ringattn._kernels_forward` and :mod:`ringattn._kernels_backward`
with every live block pair visited masked (a bias makes no block "full"; the terms' values
are traced, so their zeros cannot skip blocks: the static mask, windows, positions and
segments still do). The mask is ANDed into the block's visibility before the keys no query
of the block sees are selected away, so NaN under a False of the mask (in the bias, a key or
a value) reaches neither the output nor any gradient, as for the library's own masks.

Batch: the terms' leading axis ``Bb`` divides the kernels' batch ``B``, and batch row ``b``
reads the terms' row ``b // (B // Bb)``: ``Bb = 1`` (shared) and ``Bb = B`` as given, and under
``jax.vmap`` (:func:`ringattn._batching.fold_vmap` folds the mapped axis ``V`` in front of
``B``) a term of ``V * 1`` rows is shared within each mapped member.

The backward also returns ``dbias``, the gradient of the logits (the bias is added after the
softcap, so that is ``p * (dp - delta)``), summed over the axes the bias broadcasts along,
block by block into a float32 array of the bias's (padded) shape.
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
from ringattn._kernels_backward import dq_from_blocks, query_blocks, recompute_logits
from ringattn._kernels_forward import init_forward_state
from ringattn._online_softmax import finalize_online_softmax, update_online_softmax
from ringattn._varying import cast_varying, varying_axes


class LogitTerms(NamedTuple):
    """Traced terms of the logits, heads-major: ``[Bb, K or 1, G or 1, Tp or 1, Sp or 1]``.

    ``bias``: a float array added to the (scaled, soft-capped) logits, or None. ``allowed``:
    a bool array, False hides the pair, or None.
    """

    bias: jax.Array | None
    allowed: jax.Array | None


def term_block(x, i, j, bq: int, bk: int):
    """Block ``(i, j)`` of a term ``[Bb, Kb, Gb, Tb, Sb]``: ``[Bb, Kb, Gb, bq or 1, bk or 1]``
    (an axis of size 1 is broadcast: always its index 0)."""
    Bb, Kb, Gb, Tb, Sb = x.shape
    sq, sk = (bq, i * bq) if Tb > 1 else (1, 0), (bk, j * bk) if Sb > 1 else (1, 0)
    return lax.dynamic_slice(x, (0, 0, 0, sq[1], sk[1]), (Bb, Kb, Gb, sq[0], sk[0]))


def batch_rows(x, B: int):
    """A term's block ``[Bb, ...]`` broadcastable against ``[B, ...]``: row ``b`` of the
    result is row ``b // (B // Bb)`` of ``x`` (see the module docs on batching)."""
    Bb = x.shape[0]
    return x if Bb in (1, B) else jnp.repeat(x, B // Bb, axis=0)


def reduce_to(ds, shape):
    """``ds [B, K, G, bq, bk]`` summed to a term block's ``shape`` ``[Bb, Kb, Gb, sq, sk]``."""
    B = ds.shape[0]
    Bb = shape[0]
    ds = ds.reshape(Bb, B // Bb, *ds.shape[1:]).sum(axis=1)
    axes = tuple(a for a in range(1, 5) if shape[a] == 1 and ds.shape[a] != 1)
    return ds.sum(axis=axes, keepdims=True)


def _visibility(cfg: KernelConfig, summ: Summaries, ids: MaskIds, terms: LogitTerms, i, j):
    """The block's mask ``[B, K or 1, G or 1, bq, bk]``, the mask term ANDed in."""
    bq, bk = cfg.block_q, cfg.block_kv
    mask = block_mask(cfg, summ, ids.q_block(i * bq, bq).kv_block(j * bk, bk), i * bq, j * bk)
    if terms.allowed is not None:
        mask = mask & batch_rows(term_block(terms.allowed, i, j, bq, bk), ids.q_pos.shape[0])
    return mask


def _add_bias(s, terms: LogitTerms, i, j, cfg):
    """Logits ``s [B, K, G, bq, bk]`` plus the bias block (float32), if any."""
    if terms.bias is None:
        return s
    blk = term_block(terms.bias, i, j, cfg.block_q, cfg.block_kv)
    return s + batch_rows(blk, s.shape[0]).astype(jnp.float32)


def biased_forward_heads_major(qg, kh, vh, ids: MaskIds, terms: LogitTerms, cfg: KernelConfig):
    """Blockwise forward with logit terms on padded arrays.

    Args:
      qg: ``[B, Tp, K, G, H]`` queries; ``kh, vh``: ``[B, K, Sp, H]``.
      ids: :class:`ringattn._blocks.MaskIds` (``[B, Tp]`` / ``[B, Sp]`` int32, ``windows``
        the ``[B, K, G]`` per-head window table or None).
      terms: :class:`LogitTerms`, heads-major and padded.
      cfg: the call's :class:`ringattn._blocks.KernelConfig`.

    Returns:
      ``out [B, K, G, Tp, H]`` and ``lse [B, K, G, Tp]``, float32.
    """
    kernel = fold_vmap(functools.partial(_forward, cfg=cfg))
    state = kernel(init_forward_state(qg), qg, kh, vh, ids, terms)
    return finalize_online_softmax(state)


def _forward(state, qg, kh, vh, ids: MaskIds, terms: LogitTerms, cfg: KernelConfig):
    B, K, G, Tp = state.m.shape
    H = qg.shape[-1]
    bq, bk = cfg.block_q, cfg.block_kv
    nq, nk = Tp // bq, kh.shape[2] // bk
    R = G * bq
    summ = Summaries(ids, bq, bk, cfg.mask.dense)
    orders, _, n_lives = visit_orders(summ.kinds(cfg, nq, nk))
    q_rows = rows_blocks(qg, bq)  # [nq, B, K, G * bq, H]
    k_cols = kv_cols_blocks(kh, bk)  # [nk, B, K, H, bk]
    v_rows = kv_rows_blocks(vh, bk)  # [nk, B, K, bk, H]
    mm = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)

    def visit(i, t, st):
        j = orders[i, t]
        mask = _visibility(cfg, summ, ids, terms, i, j)
        seen = visible_keys(mask)  # [B, 1, bk, 1]
        k_blk = jnp.where(jnp.swapaxes(seen, 2, 3), k_cols[j], 0)
        v_blk = jnp.where(seen, v_rows[j], 0)
        s = cap_logits(cfg, mm(q_rows[i], k_blk))[0].reshape(B, K, G, bq, bk)
        s = apply_mask(_add_bias(s, terms, i, j, cfg), mask).reshape(B, K, R, bk)
        return update_online_softmax(st, s, v_blk)

    def q_block(i, state):
        def read(x, *tail):  # [B, K, G, Tp, *tail] -> [B, K, G * bq, *tail]
            return dslice(x, i * bq, bq, 3).reshape(B, K, R, *tail)

        def write(x, blk, *tail):
            return lax.dynamic_update_slice_in_dim(x, blk.reshape(B, K, G, bq, *tail), i * bq, 3)

        blk = type(state)(read(state.acc, H), read(state.m), read(state.l))
        blk = lax.fori_loop(0, n_lives[i], functools.partial(visit, i), blk)
        return type(state)(
            write(state.acc, blk.acc, H), write(state.m, blk.m), write(state.l, blk.l)
        )

    axes = varying_axes(state, qg, kh, vh, ids, terms)
    return lax.fori_loop(0, nq, q_block, cast_varying(state, axes))


def biased_backward_heads_major(
    qg, kh, vh, ids: MaskIds, terms: LogitTerms, cotangents, cfg: KernelConfig
):
    """Blockwise backward with logit terms on padded arrays.

    ``cotangents = (lse, dout, delta)``: ``lse, delta [B, K, G, Tp]``, ``dout [B, Tp, K, G,
    H]``; the rest as in :func:`biased_forward_heads_major`.

    Returns:
      ``dq [B, K, G, Tp, H]``, ``dk, dv [B, K, Sp, H]`` and ``dbias`` (the bias's padded shape)
      or None, all float32.
    """
    B, Tp, K, G, H = qg.shape
    Sp = kh.shape[2]
    bq = cfg.block_q
    dq_t = jnp.zeros((Tp // bq, B, K, H, G * bq), jnp.float32)
    dkv = jnp.zeros((B, K, Sp, 2 * H), jnp.float32)
    dbias = None if terms.bias is None else jnp.zeros(terms.bias.shape, jnp.float32)
    qb = query_blocks(qg, *cotangents, bq)
    kernel = fold_vmap(
        functools.partial(_backward, cfg=cfg),
        in_axes=((1, 0, 0), 1, 0, 0, 0, 0),
        out_axes=(1, 0, 0),
    )
    dq_t, dkv, dbias = kernel((dq_t, dkv, dbias), qb, kh, vh, ids, terms)
    return dq_from_blocks(dq_t, G), dkv[..., :H], dkv[..., H:], dbias


def _backward(grads, qb, kh, vh, ids: MaskIds, terms: LogitTerms, cfg: KernelConfig):
    """Adds the key set's gradients to ``grads = (dq_t, dkv, dbias)`` (as
    :func:`ringattn._kernels_backward._update_backward`, plus ``dbias``: its padded shape
    float32, or None)."""
    dq_t, dkv, dbias = grads
    nq, B, K, H, R = dq_t.shape
    G = qb.lse.shape[4]
    bq, bk = cfg.block_q, cfg.block_kv
    nk = kh.shape[2] // bk
    summ = Summaries(ids, bq, bk, cfg.mask.dense)
    orders, _, n_lives = visit_orders(summ.kinds(cfg, nq, nk).T)  # [nk, nq], [nk]
    axes = varying_axes(dq_t, dkv, dbias, qb, kh, vh, ids, terms)
    q_rows, do_rows, do_cols, lse_b, delta_b = qb
    k_cols = kv_cols_blocks(kh, bk)  # [nk, B, K, H, bk]
    mm = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)

    def visit(j, t, carry):
        dq_t, dk, dv, dbias = carry
        i = orders[j, t]
        mask = _visibility(cfg, summ, ids, terms, i, j)
        seen = visible_keys(mask)  # [B, 1, bk, 1]
        v_blk = jnp.where(seen, dslice(vh, j * bk, bk, 2), 0)
        k_blk_t = jnp.where(jnp.swapaxes(seen, 2, 3), k_cols[j], 0)
        # The forward's logits, bit for bit (recompute_logits), then back to [B, K, G, bq, bk].
        s_t, tanh = cap_logits(cfg, recompute_logits(q_rows[i], k_blk_t, G))
        s = _add_bias(jnp.moveaxis(s_t, 2, 4), terms, i, j, cfg)
        s_t = jnp.moveaxis(apply_mask(s, mask), 4, 2)  # [B, K, bk, G, bq]
        p_t = jnp.exp(s_t - lse_b[i])
        dv = dv + mm(p_t.reshape(B, K, bk, R).astype(do_rows.dtype), do_rows[i])
        dp_t = mm(v_blk, do_cols[i]).reshape(B, K, bk, G, bq)
        ds_t = p_t * (dp_t - delta_b[i])  # the gradient of the logits, bias included
        if dbias is not None:
            blk = term_block(dbias, i, j, bq, bk)
            blk = blk + reduce_to(jnp.moveaxis(ds_t, 2, 4), blk.shape)
            starts = (
                0,
                0,
                0,
                i * bq if dbias.shape[3] > 1 else 0,
                j * bk if dbias.shape[4] > 1 else 0,
            )
            dbias = lax.dynamic_update_slice(dbias, blk, starts)
        if tanh is not None:
            ds_t = ds_t * (1.0 - tanh * tanh)
        ds_t = (ds_t * cfg.scale).reshape(B, K, bk, R)
        dk = dk + mm(ds_t.astype(q_rows.dtype), q_rows[i])
        dq_t = lax.dynamic_update_index_in_dim(
            dq_t, dq_t[i] + mm(k_blk_t, ds_t.astype(kh.dtype)), i, 0
        )
        return dq_t, dk, dv, dbias

    def kv_block(j, carry):
        dq_t, dkv, dbias = carry
        dkv_blk = dslice(dkv, j * bk, bk, 2)  # [B, K, bk, 2H]
        carry = (dq_t, dkv_blk[..., :H], dkv_blk[..., H:], dbias)
        dq_t, dk, dv, dbias = lax.fori_loop(0, n_lives[j], functools.partial(visit, j), carry)
        dkv = lax.dynamic_update_slice_in_dim(dkv, jnp.concatenate([dk, dv], -1), j * bk, 2)
        return dq_t, dkv, dbias

    return lax.fori_loop(0, nk, kv_block, cast_varying((dq_t, dkv, dbias), axes))
