"""Blockwise attention with an additive logit bias and a traced boolean mask (custom VJP).

The logits are ``softcap(scale * q k^T) + bias`` (the bias after the softcap, so a cap never
clips it); pairs that the mask (the library's, and the traced ``allowed``) hides are then
``-inf``. ``bias`` and ``allowed`` are ``[B or 1, N or 1, T or 1, S or 1]`` (an axis of size 1
is broadcast); :func:`term_to_heads_major` turns them into the kernels' layout (a reshape,
and a zero- or False-padded copy only where ``T`` or ``S`` is not a multiple of the block),
and the kernels (:mod:`ringattn._kernels_bias`) slice one block at a time. The backward
returns ``dbias`` in the bias's own shape and dtype (summed over its broadcast axes).
"""

import functools

import jax
import jax.numpy as jnp

from ringattn._blocks import MaskIds, pad_axis
from ringattn._checks import describe, fail
from ringattn._heads_major import (
    attention_delta,
    kv_from_heads_major,
    kv_to_heads_major,
    make_kernel_config,
    q_from_heads_major,
    q_to_groups,
    q_to_heads_major,
)
from ringattn._kernels_bias import (
    LogitTerms,
    biased_backward_heads_major,
    biased_forward_heads_major,
)
from ringattn._options import MaskSpec

__all__ = ["biased_attention", "check_logit_term"]


def check_logit_term(fn: str, arg: str, x, dims: tuple[int, int, int, int], *, boolean: bool):
    """Checks ``x [B or 1, N or 1, T or 1, S or 1]`` (``dims = (B, N, T, S)``): a floating
    array (a bool one when ``boolean``); returns it as a JAX array."""
    kind = "bool" if boolean else "floating-point"
    B, N, T, S = dims
    expected = f"a {kind} array [B or 1, N or 1, T or 1, S or 1] with B={B}, N={N}, T={T}, S={S}"
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise fail(fn, arg, expected, type(x).__name__)
    dtype_ok = x.dtype == jnp.bool_ if boolean else jnp.issubdtype(x.dtype, jnp.floating)
    if not dtype_ok or x.ndim != 4:
        raise fail(fn, arg, expected, describe(x))
    for axis, (got, full) in enumerate(zip(x.shape, dims, strict=True)):
        if got not in (1, full):
            name = "BNTS"[axis]
            raise fail(fn, arg, f"{expected} (axis {axis}: 1 or {name}={full})", describe(x))
    return jnp.asarray(x)


def term_to_heads_major(x, K: int, Tp: int, Sp: int):
    """``[Bb, N or 1, T or 1, S or 1]`` → ``[Bb, K or 1, G or 1, Tp or 1, Sp or 1]``, the
    ``T`` and ``S`` axes padded (zeros, or False) where they are not broadcast."""
    Bb, Nb, Tb, Sb = x.shape
    x = x.reshape(Bb, 1, 1, Tb, Sb) if Nb == 1 else x.reshape(Bb, K, Nb // K, Tb, Sb)
    if Tb > 1:
        x = pad_axis(x, 3, Tp)
    if Sb > 1:
        x = pad_axis(x, 4, Sp)
    return x


def term_from_heads_major(x, shape):
    """The inverse of :func:`term_to_heads_major` for a term of ``shape`` (cropped)."""
    Bb, Nb, Tb, Sb = shape
    return x[:, :, :, :Tb, :Sb].reshape(shape)


def _terms(terms: LogitTerms, K, Tp, Sp) -> LogitTerms:
    return LogitTerms(*(None if x is None else term_to_heads_major(x, K, Tp, Sp) for x in terms))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, ids: MaskIds, terms: LogitTerms, spec, block_sizes):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    cfg, Tp, Sp = make_kernel_config(spec, H, T, S, *block_sizes.forward)
    out, lse = biased_forward_heads_major(
        q_to_groups(q, K, Tp),
        kv_to_heads_major(k, Sp),
        kv_to_heads_major(v, Sp),
        ids.padded(Tp, Sp),
        _terms(terms, K, Tp, Sp),
        cfg,
    )
    return q_from_heads_major(out, T).astype(q.dtype), q_from_heads_major(lse, T)


def _attention_fwd(q, k, v, ids, terms, spec, block_sizes):
    out, lse = _attention(q, k, v, ids, terms, spec, block_sizes)
    return (out, lse), (q, k, v, ids, terms, out, lse)


def _attention_bwd(spec, block_sizes, residuals, cotangents):
    q, k, v, ids, terms, out, lse = residuals
    dout, dlse = cotangents
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    cfg, Tp, Sp = make_kernel_config(spec, H, T, S, *block_sizes.backward)
    delta = attention_delta(out, dout, dlse)
    dq, dk, dv, dbias = biased_backward_heads_major(
        q_to_groups(q, K, Tp),
        kv_to_heads_major(k, Sp),
        kv_to_heads_major(v, Sp),
        ids.padded(Tp, Sp),
        _terms(terms, K, Tp, Sp),
        (q_to_heads_major(lse, K, Tp), q_to_groups(dout, K, Tp), q_to_heads_major(delta, K, Tp)),
        cfg,
    )
    if dbias is not None:
        dbias = term_from_heads_major(dbias, terms.bias.shape).astype(terms.bias.dtype)
    dq = q_from_heads_major(dq, T).astype(q.dtype)
    dk = kv_from_heads_major(dk, S).astype(k.dtype)
    dv = kv_from_heads_major(dv, S).astype(v.dtype)
    return dq, dk, dv, None, LogitTerms(dbias, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def biased_attention(
    q, k, v, ids: MaskIds, terms: LogitTerms, spec: MaskSpec, block_sizes
) -> tuple[jax.Array, jax.Array]:
    """``(out [B, T, N, H] in q.dtype, lse [B, T, N] float32)`` on validated inputs.

    ``ids``: :class:`ringattn._blocks.MaskIds` ``[B, T]`` / ``[B, S]`` int32, ``windows``
    the ``[B, K, G]`` per-head window table or None; ``terms``: :class:`LogitTerms` ``(bias
    (float), allowed (bool))``, each ``[B or 1, N or 1, T or 1, S or 1]`` or None, checked by
    :func:`check_logit_term`; ``block_sizes``: a :class:`ringattn.BlockSizes`. Gradients
    reach ``q``, ``k``, ``v`` and ``bias`` (reverse mode only: a ``custom_vjp``).
    """
    return _attention(q, k, v, ids, terms, spec, block_sizes)
