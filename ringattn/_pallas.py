"""Pallas attention: the backend dispatch and the custom VJP.

:func:`kernel_calls` picks the kernels of ``PallasConfig.target`` (``"triton"``:
:mod:`ringattn._pallas_triton`, GPU; ``"mosaic"``: :mod:`ringattn._pallas_tpu`, TPU; both run
on CPU in interpret mode); :func:`pallas_attention` wraps them in one custom VJP
(``delta = rowsum(dout * out) - dlse`` precomputed in XLA, FlashAttention-2's split). The
backends import only :mod:`ringattn._pallas_common`; nothing imports this module back.
"""

import functools

import jax

from ringattn import _pallas_tpu, _pallas_triton
from ringattn._blocks import MaskIds
from ringattn._heads_major import attention_delta
from ringattn._pallas_common import PallasConfig

# ----------------------------------------------------------------------------- custom VJP


def kernel_calls(cfg: PallasConfig):
    """The ``(forward, backward)`` calls of ``cfg.target``, with the signatures of
    :func:`ringattn._pallas_triton.forward_call` and ``backward_call`` (for callers such as the ring that
    run the kernels per hop)."""
    if cfg.target == "mosaic":
        return _pallas_tpu.forward_call, _pallas_tpu.backward_call
    if cfg.target != "triton":
        raise ValueError(f"PallasConfig: target: expected 'triton' or 'mosaic', got {cfg.target!r}")
    return _pallas_triton.forward_call, _pallas_triton.backward_call


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def pallas_attention(q, k, v, ids: MaskIds, cfg: PallasConfig):
    """Blockwise ``(out [B, T, N, H] in q.dtype, lse [B, T, N] float32)`` by Pallas kernels.

    ``ids``: :class:`ringattn._blocks.MaskIds`: ``q_pos [B, T]``, ``kv_pos [B, S]`` int32
    positions, segment ids or None, ``windows`` the ``[B, K, G]`` per-head window table
    (``0``: none) or None. Differentiable in ``q``, ``k``, ``v`` and through ``lse``
    (``delta - dlse``). ``cfg.target`` picks the Triton kernels or the Mosaic ones (TPU).
    """
    return kernel_calls(cfg)[0](q, k, v, ids, cfg)


def _fwd(q, k, v, ids, cfg):
    out, lse = kernel_calls(cfg)[0](q, k, v, ids, cfg)
    return (out, lse), (q, k, v, ids, out, lse)


def _bwd(cfg, residuals, cotangents):
    q, k, v, ids, out, lse = residuals
    dout, dlse = cotangents
    delta = attention_delta(out, dout, dlse)
    dq, dk, dv = kernel_calls(cfg)[1](q, k, v, ids, (lse, dout, delta), cfg)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


pallas_attention.defvjp(_fwd, _bwd)
