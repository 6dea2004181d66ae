"""The dense float32 oracle that every fast path in the library is tested against."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ringattn._bias import check_logit_term
from ringattn._checks import FloatLike, IntLike, fold_traced_scale
from ringattn._online_softmax import AttentionOutput, apply_sinks
from ringattn._options import (
    MaskSpec,
    Positions,
    SegmentIds,
    arange_positions,
    prepare,
    visibility,
)

__all__ = ["attention_reference"]


def attention_reference(
    q: Float[Array | np.ndarray, "B T N H"],
    k: Float[Array | np.ndarray, "B S K H"],
    v: Float[Array | np.ndarray, "B S K H"],
    *,
    mask: MaskSpec | None = None,
    causal: bool | np.bool_ | None = None,
    window: IntLike | tuple[IntLike | None, ...] | None = None,
    softcap: FloatLike | None = None,
    scale: FloatLike | Float[Array, ""] | None = None,
    segment_ids: SegmentIds | None = None,
    positions: Positions | None = None,
    sinks: Float[Array | np.ndarray, " N"] | None = None,
    bias: Float[Array | np.ndarray, "#B #N #T #S"] | None = None,
) -> AttentionOutput:
    """Dense attention in float32: the ``T x S`` matrix is built, so use small shapes.

    The oracle of every path in the library (and of ``paged``'s references): the same
    options, the same semantics (see :mod:`ringattn`), the same guarantees — keys no query may
    see have no effect on outputs or gradients even if they hold NaN or inf (they are
    selected away, never multiplied by zero). To ``jit`` it with options, bind them:
    ``jax.jit(functools.partial(attention_reference, causal=True))``.

    Args:
      q: ``[B, T, N, H]`` queries.
      k: ``[B, S, K, H]`` keys, ``N % K == 0`` (MHA, GQA, MQA).
      v: ``[B, S, K, H]`` values.
      mask: a :class:`ringattn.MaskSpec`, or its fields as the keywords below (not both).
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      window: hide keys at positions ``<= p - window``; a tuple: one per query head.
      softcap: logits become ``softcap * tanh(logits / softcap)``.
      scale: logit scale, default ``1 / sqrt(H)``. A float, or a float JAX scalar that
        may be traced (a temperature trained with the model, under ``jit`` / ``grad``): it
        then multiplies ``q`` (in ``q``'s dtype) and the kernel runs at scale 1, so the
        logits are ``scale * q k^T`` up to rounding (softcap applies after, as always) and
        ``jax.grad`` reaches ``scale``. Only this keyword takes one: a ``MaskSpec`` is
        static.
      segment_ids: :class:`ringattn.SegmentIds` ``(q [B, T], kv [B, S])``.
      positions: :class:`ringattn.Positions` ``(q [B, T], kv [B, S])``, default ``arange``.
        With ``T != S`` under a causal or window mask ``positions.q`` is required (where a
        shorter query block sits is ambiguous: ``paged`` puts it last): a ``ValueError``.
      sinks: ``[N]`` per-head sink logit, or None.
      bias: additive logit bias ``[B or 1, N or 1, T or 1, S or 1]`` (an axis of size 1 is
        broadcast), or None: the logits are ``softcap(scale * q k^T) + bias``, then masked.

    Returns:
      :class:`ringattn.AttentionOutput`: ``out [B, T, N, H]`` in ``q.dtype`` (computed in
      float32) and ``lse [B, T, N]`` float32. A query that sees no key gets ``out = 0``,
      ``lse = -inf`` (``lse = sink`` with sinks).

    Raises:
      ValueError: on inconsistent shapes, dtypes or options; ``T != S`` under a causal or
        window mask without ``positions.q``; a bias that is not a float array of the shape
        above.

    Example:
      >>> import jax.numpy as jnp
      >>> last = Positions(q=jnp.array([[1, 2]]), kv=None)  # T=2 queries at the end of S=3
      >>> out, lse = attention_reference(jnp.ones((1, 2, 2, 4)), jnp.ones((1, 3, 1, 4)),
      ...                                jnp.ones((1, 3, 1, 4)), causal=True, positions=last)
      >>> out.shape, lse.shape
      ((1, 2, 2, 4), (1, 2, 2))
    """
    fn = "attention_reference"
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    q, scale = fold_traced_scale(fn, q, scale)
    if sinks is not None:
        sinks = jnp.asarray(sinks)
    (B, T, S, N, K, H), spec, seg, pos = prepare(
        fn,
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        window=window,
        softcap=softcap,
        scale=scale,
        segment_ids=segment_ids,
        positions=positions,
        sinks=sinks,
        dense_ok=True,
    )
    if bias is not None:
        bias = check_logit_term(fn, "bias", jnp.asarray(bias), (B, N, T, S), boolean=False)
    q_pos = arange_positions(B, T) if pos.q is None else pos.q
    kv_pos = arange_positions(B, S) if pos.kv is None else pos.kv
    out, lse = _reference(q, k, v, Positions(q_pos, kv_pos), seg, bias, spec)
    return apply_sinks(out, lse, sinks)


@functools.partial(jax.jit, static_argnums=(6,))
def _reference(q, k, v, pos: Positions, seg, bias, spec: MaskSpec):
    """Dense attention on validated inputs, ``pos`` both given (``[B, T]`` / ``[B, S]``)."""
    q_pos, kv_pos = pos
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    mask = visibility(q_pos, kv_pos, spec, seg, spec.windows(N))  # [B, T, S] or [B, N, T, S]
    mask = mask.reshape(B, K, G, T, -1) if spec.per_head else mask[:, None, None]
    # Keys no query sees are replaced by zeros (a select): NaN there cannot reach anything.
    seen = jnp.any(mask, axis=(1, 2, 3))[:, :, None, None]  # [B, S, 1, 1]
    kf = jnp.where(seen, k.astype(jnp.float32), 0.0)
    vf = jnp.where(seen, v.astype(jnp.float32), 0.0)
    qf = q.astype(jnp.float32).reshape(B, T, K, G, H)
    logits = jnp.einsum("btkgh,bskh->bkgts", qf, kf) * spec.scale_for(H)
    if spec.softcap is not None:
        logits = spec.softcap * jnp.tanh(logits / spec.softcap)
    if bias is not None:  # [B or 1, N or 1, T or 1, S or 1] -> broadcastable to [B, K, G, T, S]
        Bb, Nb, Tb, Sb = bias.shape
        grouped = (Bb, 1, 1, Tb, Sb) if Nb == 1 else (Bb, K, G, Tb, Sb)
        logits = logits + bias.astype(jnp.float32).reshape(grouped)
    logits = jnp.where(mask, logits, -jnp.inf)  # [B, K, G, T, S]
    # The shift does not change the result, so no gradient goes through it: the max's own
    # gradient (ties found by comparing with the max) is NaN where a recomputed logit
    # rounds differently (seen with a bias under XLA:CPU -O0).
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf))
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
