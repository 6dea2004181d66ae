"""The dense float32 oracle that every fast path in the library is tested against."""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ringattn._mask import (
    MaskSpec,
    attention_mask,
    check_qkv,
    normalize_mask_inputs,
    resolve_scale,
)

__all__ = ["attention_reference"]


def attention_reference(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    causal: bool = False,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    q_positions: Int[Array, "B T"] | None = None,
    kv_positions: Int[Array, "B S"] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Dense attention in float32: the ``T x S`` matrix is built, so use small shapes.

    Args:
      q: ``[B, T, N, H]`` queries.
      k: ``[B, S, K, H]`` keys, ``N % K == 0`` (MHA, GQA, MQA).
      v: ``[B, S, K, H]`` values.
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      q_segment_ids: ``[B, T]`` int segment ids; queries see only keys of their segment.
      kv_segment_ids: ``[B, S]`` int segment ids (given with ``q_segment_ids``).
      q_positions: ``[B, T]`` int positions, default ``arange(T)``.
      kv_positions: ``[B, S]`` int positions, default ``arange(S)``.
      window: hide keys at positions ``<= p - window``.
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``.
      return_lse: also return the ``[B, T, N]`` log-sum-exp of the logits.

    Returns:
      ``out [B, T, N, H]`` in ``q.dtype`` (computed in float32), and ``lse [B, T, N]``
      float32 if ``return_lse``. A query that sees no key gets ``out = 0``, ``lse = -inf``.

    Raises:
      ValueError: on inconsistent shapes, dtypes or options.
    """
    fn = "attention_reference"
    B, T, S, N, K, H = check_qkv(fn, q, k, v)
    MaskSpec(causal=causal, window=window, softcap=softcap, scale=scale)
    q_seg, kv_seg, q_pos, kv_pos = normalize_mask_inputs(
        fn,
        B,
        T,
        S,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        q_positions=q_positions,
        kv_positions=kv_positions,
    )
    out, lse = _reference(
        q,
        k,
        v,
        q_pos,
        kv_pos,
        q_seg,
        kv_seg,
        bool(causal),
        window,
        softcap,
        resolve_scale(scale, H),
    )
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnums=(7, 8, 9, 10))
def _reference(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window, softcap, scale):
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    qf = q.astype(jnp.float32).reshape(B, T, K, G, H)
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    logits = jnp.einsum("btkgh,bskh->bkgts", qf, kf) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    mask = attention_mask(
        q_pos, kv_pos, causal=causal, window=window, q_segment_ids=q_seg, kv_segment_ids=kv_seg
    )  # [B, T, S]
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)  # [B, K, G, T, S]
    m = jnp.max(logits, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(logits - m_safe)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    empty = denom == 0.0
    denom_safe = jnp.where(empty, 1.0, denom)
    out = jnp.einsum("bkgts,bskh->btkgh", p / denom_safe, vf).reshape(B, T, N, H)
    out = out.astype(q.dtype)
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(denom_safe))[..., 0]  # [B, K, G, T]
    lse = lse.transpose(0, 3, 1, 2).reshape(B, T, N)
    return out, lse
