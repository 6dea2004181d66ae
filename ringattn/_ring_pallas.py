"""The ring with the Pallas kernels per hop, and the Pallas configuration inside ``shard_map``.

Forward: every hop's block is computed by the Pallas forward kernel of :mod:`ringattn._pallas`,
which returns the hop's ``(out, lse)``; the hops are merged in float32
(:func:`ringattn.merge_attention`). Backward: FlashAttention-2's ring backward, the Pallas
``dq`` and ``dk, dv`` kernels per hop from the GLOBAL ``lse`` and ``delta``, with the float32
dK/dV travelling with the block. :func:`shard_pallas_config` makes the kernels' configuration
(zigzag clamping, TPU interpret mode on CPU). Called from :mod:`ringattn._ring_xla`'s
``custom_vjp`` when the plan carries a Pallas configuration.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from ringattn._blocks import MaskIds
from ringattn._blockwise import make_pallas_config
from ringattn._heads_major import attention_delta
from ringattn._online_softmax import AttentionOutput, merge_attention
from ringattn._options import MaskSpec
from ringattn._pallas import kernel_calls
from ringattn._pallas_common import PallasConfig
from ringattn._ring_hops import _RingPlan, _run_hops, _shift
from ringattn._varying import cast_varying, varying_axes


def _ring_forward_pallas(q, k, v, ids: MaskIds, plan: _RingPlan):
    """The forward ring with the Pallas kernel per hop: ``(out in q.dtype, lse float32)``.

    ``ids.windows``: the ``[B, K, G]`` per-head window table or None. The block travels as
    ``(k, v, kv_pos, kv_seg)`` in the canonical layout (the kernel pads it itself); each
    hop's ``(out, lse)`` (``out`` in ``q.dtype``) is merged into a float32 running result.
    """
    B, T, N, H = q.shape
    block = (k, v, ids.kv_pos, ids.kv_seg)

    def compute(block, running: AttentionOutput, arriving):
        kb, vb, kp, ks = block
        hop_ids = ids._replace(kv_pos=kp, kv_seg=ks)
        out, lse = kernel_calls(plan.pallas)[0](q, kb, vb, hop_ids, plan.pallas)
        return merge_attention(running.out, running.lse, out, lse), None

    empty = AttentionOutput(
        jnp.zeros((B, T, N, H), jnp.float32), jnp.full((B, T, N), -jnp.inf, jnp.float32)
    )
    running = cast_varying(empty, varying_axes(q, ids, *block))
    (out, lse), _ = _run_hops(plan, block, running, compute)
    return out.astype(q.dtype), lse


def _ring_bwd_pallas(plan: _RingPlan, residuals, cotangents):
    """FlashAttention-2's ring backward with the Pallas ``dq`` and ``dk, dv`` kernels per hop.

    Every hop's probabilities are ``exp(s - lse)`` with the GLOBAL ``lse``, and
    ``delta = rowsum(dout * out) - dlse`` of the global output, so each hop's gradients are
    its exact share. The block's float32 ``concat([dk, dv], -1)`` ``[B, S, K, 2H]`` travels
    with it and a last shift sends it home, as in the XLA ring.
    """
    q, k, v, ids, out, lse = residuals
    dout, dlse = cotangents
    B, T, N, H = q.shape
    delta = attention_delta(out, dout, dlse)
    block = (k, v, ids.kv_pos, ids.kv_seg)
    axes = varying_axes(q, ids, lse, dout, delta, *block)

    def compute(block, dq, arriving):
        kb, vb, kp, ks = block
        hop_ids = ids._replace(kv_pos=kp, kv_seg=ks)
        dq_hop, dk, dv = kernel_calls(plan.pallas)[1](
            q, kb, vb, hop_ids, (lse, dout, delta), plan.pallas
        )
        dkv = jnp.concatenate([dk, dv], axis=-1)  # [B, S, K, 2H] float32
        return dq + dq_hop, dkv if arriving is None else arriving + dkv

    dq = cast_varying(jnp.zeros((B, T, N, H), jnp.float32), axes)
    dq, dkv = _run_hops(plan, block, dq, compute)
    if plan.hops:
        dkv = _shift(dkv, plan, -plan.hops)  # block (i - hops)'s gradients go home
    dk, dv = dkv[..., :H], dkv[..., H:]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


def shard_pallas_config(
    mask: MaskSpec, H: int, G: int, T: int, S: int, block_sizes, layout: str
) -> PallasConfig:
    """The :class:`ringattn._pallas_common.PallasConfig` of Pallas kernels run inside ``shard_map``.

    ``block_sizes``: the caller's :class:`BlockSizes` or None (the Pallas defaults, see
    :func:`ringattn._pallas_triton.pallas_blocks`). With ``"zigzag"`` the blocks are clamped to half
    the local lengths (compiled: rounded down to a power of two for Triton, kept as given
    for Mosaic unless the half is whole tiles), so causal chunk pairs can be skipped. The
    target follows the backend (:func:`ringattn._blockwise.pallas_target`: Mosaic on TPU,
    Triton elsewhere). On CPU the kernels run in Pallas's TPU interpret mode: the
    ``interpret=True`` HLO interpreter fails the ``check_vma`` type check on its grid loop.
    """
    cfg = make_pallas_config(mask, block_sizes, G, T, S, H, jax.default_backend())
    interpret = cfg.interpret
    if layout == "zigzag":

        def half(b: int, L: int, unit: int) -> int:
            h = min(b, L // 2)
            if interpret:
                return h
            if cfg.target == "triton":
                return 1 << (h.bit_length() - 1)  # Triton: a power of two
            return h if h == b or h % unit == 0 else b  # Mosaic: whole tiles, else as given

        rows, lanes = 8 // math.gcd(G, 8), 128  # Mosaic: rows (block_q * G) by 8, keys by 128
        cfg = dataclasses.replace(
            cfg,
            block_q=half(cfg.block_q, T, rows),
            block_q_bwd=half(cfg.block_q_bwd, T, rows),
            block_kv=half(cfg.block_kv, S, lanes),
            block_kv_bwd=half(cfg.block_kv_bwd, S, lanes),
        )
    if interpret:
        from jax.experimental.pallas import tpu as pltpu

        cfg = dataclasses.replace(cfg, interpret=pltpu.InterpretParams())
    return cfg
