"""The heads-major blockwise backward kernel (FlashAttention-2 style, accumulating in place).

The backward pass recomputes each block's probabilities from ``(q, k, v, lse)``, so memory
stays linear in ``T + S``. Only block-sized values pass through the per-pair ``switch``: a
conditional that carried the whole ``dq`` accumulator would copy it on every block pair.
In partial blocks hidden logits, keys and values are selected away (``where``) exactly as in
the forward, so NaN in a masked key reaches none of ``dq``, ``dk``, ``dv``.
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
    dslice,
    hide_keys,
    logits,
    q_block,
)
from ringattn._varying import cast_varying, varying_axes


def update_backward_heads_major(
    dq, dkv, qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows, lse, dout, delta, cfg
):
    """:func:`_update_backward`, with ``vmap`` folded into the batch axis."""
    kernel = fold_vmap(functools.partial(_update_backward, cfg=cfg))
    return kernel(dq, dkv, qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows, lse, dout, delta)


def _update_backward(
    dq, dkv, qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows, lse, dout, delta, cfg
):
    """Adds one key set's blockwise gradients to float32 accumulators, in place.

    Args:
      dq: ``[B, K, G, Tp, H]`` float32 accumulator of the query gradient.
      dkv: ``[B, K, Sp, 2H]`` float32 accumulator of ``concat([dk, dv], -1)`` for this key set.
      qg, kh, vh, positions, segments, windows: as in
        :func:`ringattn._kernels_forward.update_forward_heads_major`.
      lse: ``[B, K, G, Tp]`` float32 log-sum-exp of the *complete* attention the gradient is
        for (for a ring hop, the global one): probabilities are ``exp(s - lse)``.
      dout: ``[B, Tp, K, G, H]`` cotangent of the normalised output (row-major, like ``qg``).
      delta: ``[B, K, G, Tp]`` float32 ``sum(dout * out, -1) - dlse``.

    Returns:
      ``(dq, dkv)`` with this key set's contributions added.
    """
    B, Tp, K, G, H = qg.shape
    Sp = kh.shape[2]
    bq, bk = cfg.block_q, cfg.block_kv
    nq, nk = Tp // bq, Sp // bk
    summ = Summaries(q_pos, kv_pos, q_seg, kv_seg, bq, bk, windows, cfg.mask.dense)
    axes = varying_axes(
        dq, dkv, qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows, lse, dout, delta
    )
    lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    softcap = cfg.mask.softcap
    zero_dq_blk = cast_varying(jnp.zeros((B, K, G, bq, H), jnp.float32), axes)

    def kv_block(j, carry):
        dq, dkv = carry
        k_all = dslice(kh, j * bk, bk, 2)  # [B, K, bk, H]
        v_all = dslice(vh, j * bk, bk, 2)
        kp = dslice(kv_pos, j * bk, bk, 1)
        ks = None if kv_seg is None else dslice(kv_seg, j * bk, bk, 1)
        dkv_blk = dslice(dkv, j * bk, bk, 2)  # [B, K, bk, 2H]

        def visit(i, carry, masked: bool):
            dk, dv = carry
            q_blk = q_block(qg, i, bq)  # [B, K, G, bq, H]
            do_blk = q_block(dout, i, bq)
            k_blk, v_blk = k_all, v_all
            if masked:
                qp = dslice(q_pos, i * bq, bq, 1)
                qs = None if q_seg is None else dslice(q_seg, i * bq, bq, 1)
                mask = block_mask(cfg, summ, windows, qp, kp, qs, ks, i * bq, j * bk)
                k_blk, v_blk = hide_keys(mask, k_blk, v_blk)
            s, t = logits(cfg, q_blk, k_blk)  # [B, K, G, bq, bk]
            if masked:
                s = apply_mask(s, mask)
            p = jnp.exp(s - dslice(lse_safe, i * bq, bq, 3)[..., None])
            dv = dv + jnp.einsum(
                "bkgqs,bkgqh->bksh",
                p.astype(do_blk.dtype),
                do_blk,
                preferred_element_type=jnp.float32,
            )
            dp = jnp.einsum("bkgqh,bksh->bkgqs", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = p * (dp - dslice(delta, i * bq, bq, 3)[..., None])
            if softcap is not None:
                ds = ds * (1.0 - t * t)
            ds = ds * cfg.scale
            dq_blk = jnp.einsum(
                "bkgqs,bksh->bkgqh",
                ds.astype(k_blk.dtype),
                k_blk,
                preferred_element_type=jnp.float32,
            )
            dk = dk + jnp.einsum(
                "bkgqs,bkgqh->bksh",
                ds.astype(q_blk.dtype),
                q_blk,
                preferred_element_type=jnp.float32,
            )
            return dq_blk, dk, dv

        def step(i, carry):
            dq, dk, dv = carry
            dq_blk, dk, dv = lax.switch(
                summ.kind(cfg, i, j),
                [
                    lambda c: (zero_dq_blk, *c),
                    lambda c: visit(i, c, False),
                    lambda c: visit(i, c, True),
                ],
                (dk, dv),
            )
            dq = lax.dynamic_update_slice_in_dim(dq, dslice(dq, i * bq, bq, 3) + dq_blk, i * bq, 3)
            return dq, dk, dv

        dq, dk, dv = lax.fori_loop(0, nq, step, (dq, dkv_blk[..., :H], dkv_blk[..., H:]))
        dkv = lax.dynamic_update_slice_in_dim(dkv, jnp.concatenate([dk, dv], -1), j * bk, 2)
        return dq, dkv

    return lax.fori_loop(0, nk, kv_block, cast_varying((dq, dkv), axes))


def backward_heads_major(
    qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows, lse, dout, delta, cfg: KernelConfig
):
    """Blockwise backward on padded arrays (row-major queries, heads-major the rest).

    Returns:
      ``dq [B, K, G, Tp, H]``, ``dk, dv [B, K, Sp, H]``, all float32, for the key set given.
    """
    B, Tp, K, G, H = qg.shape
    Sp = kh.shape[2]
    dq = jnp.zeros((B, K, G, Tp, H), jnp.float32)
    dkv = jnp.zeros((B, K, Sp, 2 * H), jnp.float32)
    dq, dkv = update_backward_heads_major(
        dq, dkv, qg, kh, vh, q_pos, kv_pos, q_seg, kv_seg, windows, lse, dout, delta, cfg
    )
    return dq, dkv[..., :H], dkv[..., H:]
