"""The ring's forward and backward passes with the XLA blockwise kernels: one ``custom_vjp``.

:func:`_ring` is the ring on validated, ring-varying inputs. Its forward folds every hop's
block into one float32 online-softmax state (:mod:`ringattn._kernels_forward`); its backward
sends the blocks round again with their float32 ``dK``/``dV`` accumulators, which a last shift
sends home (:mod:`ringattn._kernels_backward`). With ``plan.hop_format`` the travelling block
is quantized once per device and dequantized to float32 before each hop's compute. A plan
with ``pallas`` set dispatches both passes to :mod:`ringattn._ring_pallas`. The plan and the
hop loop live in :mod:`ringattn._ring_hops`.
"""

import functools

import jax
import jax.numpy as jnp

from ringattn._blocks import MaskIds, pad_ids
from ringattn._heads_major import (
    attention_delta,
    kv_from_heads_major,
    kv_to_heads_major,
    make_kernel_config,
    q_from_heads_major,
    q_to_groups,
    q_to_heads_major,
)
from ringattn._hop_format import dequantize_rows, quantize_rows
from ringattn._kernels_backward import (
    dq_from_blocks,
    query_blocks,
    update_backward_blocks,
)
from ringattn._kernels_forward import forward_q_rows, init_forward_state, update_forward_blocks
from ringattn._online_softmax import finalize_online_softmax
from ringattn._ring_hops import _RingPlan, _run_hops, _shift
from ringattn._ring_pallas import _ring_bwd_pallas, _ring_forward_pallas
from ringattn._varying import cast_varying, varying_axes


def _travelling_block(k, v, kv_pos, kv_seg, Sp: int, plan: _RingPlan):
    """The block as it travels: heads-major K/V (quantized with ``plan.hop_format``) and ids.

    ``(kh, vh, kv_pos, kv_seg)``, or ``(k data, k scale, v data, v scale, kv_pos, kv_seg)``
    with ``data [B, K, Sp, H]`` int8 / float8 and ``scale [B, K, Sp]`` float32. Padding rows
    are zero (scale 0). Quantized once per device, the local block included.
    """
    kh, vh = kv_to_heads_major(k, Sp), kv_to_heads_major(v, Sp)
    ids = (pad_ids(kv_pos, Sp), pad_ids(kv_seg, Sp))
    if plan.hop_format is None:
        return (kh, vh, *ids)
    return (*quantize_rows(kh, plan.hop_format), *quantize_rows(vh, plan.hop_format), *ids)


def _arrived_block(block, plan: _RingPlan):
    """``(kh, vh, kv_pos, kv_seg)`` for the kernels: quantized K/V dequantized to float32."""
    if plan.hop_format is None:
        return block
    k_data, k_scale, v_data, v_scale, kp, ks = block
    fmt = plan.hop_format
    return dequantize_rows(k_data, k_scale, fmt), dequantize_rows(v_data, v_scale, fmt), kp, ks


def _ring_forward(q, k, v, ids: MaskIds, plan: _RingPlan):
    if plan.pallas is not None:
        return _ring_forward_pallas(q, k, v, ids, plan)
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    cfg, Tp, Sp = make_kernel_config(plan.mask, H, T, S, *plan.block_sizes.forward)
    qg, q_ids = q_to_groups(q, K, Tp), ids.padded(Tp, Sp)  # the kv side arrives per hop
    block = _travelling_block(k, v, ids.kv_pos, ids.kv_seg, Sp, plan)
    q_rows = forward_q_rows(qg, cfg.block_q)  # block-major once, for every hop

    def compute(block, state, arriving):
        kh, vh, kp, ks = _arrived_block(block, plan)
        hop_ids = q_ids._replace(kv_pos=kp, kv_seg=ks)
        state = update_forward_blocks(state, q_rows, kh, vh, hop_ids, cfg)
        return state, None

    # Every hop folds into one float32 online-softmax state: no per-hop (out, lse) to merge.
    state = cast_varying(init_forward_state(qg), varying_axes(qg, *block))
    state, _ = _run_hops(plan, block, state, compute)
    out, lse = finalize_online_softmax(state)
    return q_from_heads_major(out, T).astype(q.dtype), q_from_heads_major(lse, T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring(q, k, v, ids: MaskIds, plan: _RingPlan):
    """The ring on validated, ring-varying inputs: ``(out in q.dtype, lse float32)``.

    ``ids``: :class:`ringattn._blocks.MaskIds` of the local shard, ``windows`` the ``[B, K,
    G]`` per-head window table or None; the key side travels with the keys.
    """
    return _ring_forward(q, k, v, ids, plan)


def _ring_fwd(q, k, v, ids, plan):
    out, lse = _ring_forward(q, k, v, ids, plan)
    return (out, lse), (q, k, v, ids, out, lse)


def _ring_bwd(plan: _RingPlan, residuals, cotangents):
    if plan.pallas is not None:
        return _ring_bwd_pallas(plan, residuals, cotangents)
    q, k, v, ids, out, lse = residuals
    dout, dlse = cotangents
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    cfg, Tp, Sp = make_kernel_config(plan.mask, H, T, S, *plan.block_sizes.backward)
    bq = cfg.block_q  # clamped to T
    qg, q_ids = q_to_groups(q, K, Tp), ids.padded(Tp, Sp)
    lse_h = q_to_heads_major(lse, K, Tp)  # [B, K, G, Tp]
    dout_g = q_to_groups(dout, K, Tp)  # [B, Tp, K, G, H]
    delta_h = q_to_heads_major(attention_delta(out, dout, dlse), K, Tp)
    # The same quantized K/V travel again; dK/dV accumulators travel in float32. Gradients are
    # those of attention over the dequantized K/V (straight-through for k, v).
    block = _travelling_block(k, v, ids.kv_pos, ids.kv_seg, Sp, plan)
    axes = varying_axes(qg, lse_h, dout_g, delta_h, *block)
    # The query side and dq (transposed) stay block-major over every hop, laid out once.
    qb = query_blocks(qg, lse_h, dout_g, delta_h, bq)

    def compute(block, dq_t, arriving):
        kh, vh, kp, ks = _arrived_block(block, plan)
        # dK/dV of the block held at this hop: [B, K, Sp, 2H] float32, travelling with it.
        dkv = cast_varying(jnp.zeros((B, K, Sp, 2 * H), jnp.float32), axes)
        dkv = dkv if arriving is None else arriving
        hop_ids = q_ids._replace(kv_pos=kp, kv_seg=ks)
        return update_backward_blocks((dq_t, dkv), qb, kh, vh, hop_ids, cfg)

    dq_t = jnp.zeros((Tp // bq, B, K, H, N // K * bq), jnp.float32)  # dq^T, block-major
    dq_t, dkv = _run_hops(plan, block, cast_varying(dq_t, axes), compute)
    dq = dq_from_blocks(dq_t, N // K)
    if plan.hops:
        dkv = _shift(dkv, plan, -plan.hops)  # block (i - hops)'s gradients go home
    dk = kv_from_heads_major(dkv[..., :H], S)
    dv = kv_from_heads_major(dkv[..., H:], S)
    dq = q_from_heads_major(dq, T)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)
