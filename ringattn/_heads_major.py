"""Canonical ``[B, T, N, H]`` arrays to and from the kernels' heads-major layout.

Queries become ``[B, Tp, K, G, H]`` (a free reshape, zero-padded to a multiple of the query
block), keys and values ``[B, K, Sp, H]``, ids are edge-padded so padding never widens a
block's range. :func:`attention_forward` / :func:`attention_backward` run the kernels of
:mod:`ringattn._kernels_forward` and :mod:`ringattn._kernels_backward` on canonical arrays;
the blockwise custom VJP and the ring's local hop are built from them.
"""

import jax.numpy as jnp

from ringattn._blocks import KernelConfig, MaskIds, pad_axis, round_up
from ringattn._kernels_backward import backward_heads_major
from ringattn._kernels_forward import forward_heads_major
from ringattn._options import MaskSpec


def q_to_groups(x, K: int, length: int):
    """``[B, T, N, ...]`` → ``[B, Tp, K, G, ...]`` zero-padded to ``length`` (a reshape)."""
    B, T, N = x.shape[:3]
    x = pad_axis(x, 1, length)
    return x.reshape(B, length, K, N // K, *x.shape[3:])


def q_to_heads_major(x, K: int, length: int):
    """``[B, T, N, ...]`` → ``[B, K, G, Tp, ...]`` zero-padded to ``length``."""
    return jnp.moveaxis(q_to_groups(x, K, length), 1, 3)


def q_from_heads_major(x, T: int):
    """``[B, K, G, Tp, ...]`` → ``[B, T, N, ...]``."""
    B, K, G, Tp = x.shape[:4]
    x = jnp.moveaxis(x, 3, 1)
    return x.reshape(B, Tp, K * G, *x.shape[4:])[:, :T]


def kv_to_heads_major(x, length: int):
    """``[B, S, K, H]`` → ``[B, K, Sp, H]`` zero-padded to ``length``."""
    return jnp.moveaxis(pad_axis(x, 1, length), 1, 2)


def kv_from_heads_major(x, S: int):
    """``[B, K, Sp, H]`` → ``[B, S, K, H]``."""
    return jnp.moveaxis(x, 2, 1)[:, :S]


def make_kernel_config(
    mask: MaskSpec, head_dim: int, T: int, S: int, block_q: int, block_kv: int
) -> tuple[KernelConfig, int, int]:
    """Clamps block sizes to the lengths; returns ``(config, padded T, padded S)``."""
    bq, bk = min(block_q, T), min(block_kv, S)
    cfg = KernelConfig(mask=mask, scale=mask.scale_for(head_dim), block_q=bq, block_kv=bk, kv_len=S)
    return cfg, round_up(T, bq), round_up(S, bk)


def attention_forward(q, k, v, ids: MaskIds, *, mask: MaskSpec, blocks):
    """Canonical-layout forward: ``(out [B, T, N, H] float32, lse [B, T, N] float32)``.

    ``ids``: :class:`ringattn._blocks.MaskIds` ``[B, T]`` / ``[B, S]``, ``windows`` the
    ``[B, K, G]`` per-head window table or None; ``blocks`` is ``(block_q, block_kv)``.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    cfg, Tp, Sp = make_kernel_config(mask, H, T, S, *blocks)
    out, lse = forward_heads_major(
        q_to_groups(q, K, Tp),
        kv_to_heads_major(k, Sp),
        kv_to_heads_major(v, Sp),
        ids.padded(Tp, Sp),
        cfg,
    )
    return q_from_heads_major(out, T), q_from_heads_major(lse, T)


def attention_delta(out, dout, dlse):
    """``sum(dout * out, -1) - dlse`` in float32: ``[B, T, N]``."""
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    return delta if dlse is None else delta - dlse.astype(jnp.float32)


def attention_backward(q, k, v, ids: MaskIds, cotangents, *, mask: MaskSpec, blocks):
    """Canonical-layout backward for one key set: float32 ``(dq, dk, dv)``.

    ``cotangents = (lse, dout, delta)``: ``lse [B, T, N]`` and ``delta [B, T, N]`` describe
    the complete attention (all key sets) whose output the cotangent ``dout [B, T, N, H]`` is
    for; ``ids`` as in :func:`attention_forward`; ``blocks`` is the backward's ``(block_q,
    block_kv)``.
    """
    lse, dout, delta = cotangents
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    cfg, Tp, Sp = make_kernel_config(mask, H, T, S, *blocks)
    dq, dk, dv = backward_heads_major(
        q_to_groups(q, K, Tp),
        kv_to_heads_major(k, Sp),
        kv_to_heads_major(v, Sp),
        ids.padded(Tp, Sp),
        (q_to_heads_major(lse, K, Tp), q_to_groups(dout, K, Tp), q_to_heads_major(delta, K, Tp)),
        cfg,
    )
    return q_from_heads_major(dq, T), kv_from_heads_major(dk, S), kv_from_heads_major(dv, S)
