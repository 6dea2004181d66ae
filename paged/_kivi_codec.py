"""The KIVI-style 2-bit codec: four codes per byte, asymmetric ``(scale, zero)`` pairs per
channel over a page (keys) or per token (values). The format, its bounds and the residual
window that the cache keeps beside it are described in :mod:`paged._kivi`; this module is the
bits only, and imports nothing of the cache, so :mod:`paged._quantized` (the one place the
formats' codecs are chosen) and :mod:`paged._kivi` (the window) both build on it.
"""

import jax.numpy as jnp

__all__ = ["decode", "encode", "nonfinite", "pack2", "unpack2"]

_LEVELS = 3.0  # codes 0 .. 3


def nonfinite(x, axis):
    """Whether each group of ``x`` along ``axis`` holds a NaN or inf: a count of non-finite
    values, never a max / min reduction (XLA:CPU's vectorized max / min drops NaN past a few
    thousand values, so a NaN cannot be trusted to reach the result of one)."""
    return jnp.sum(~jnp.isfinite(x), axis=axis, dtype=jnp.int32) > 0


def pack2(q):
    """``[..., H]`` codes in ``0..3`` -> ``[..., H // 4]`` uint8 (4 codes per byte)."""
    q = q.astype(jnp.uint8).reshape(*q.shape[:-1], q.shape[-1] // 4, 4)
    shifts = jnp.arange(4, dtype=jnp.uint8) * 2
    return jnp.sum(q << shifts, axis=-1, dtype=jnp.uint8)


def unpack2(data):
    """``[..., H // 4]`` uint8 -> ``[..., H]`` float32 codes in ``0..3``."""
    shifts = jnp.arange(4, dtype=jnp.uint8) * 2
    q = (data[..., None] >> shifts) & jnp.uint8(3)
    return q.reshape(*data.shape[:-1], data.shape[-1] * 4).astype(jnp.float32)


def encode(x, grouping: str):
    """``x [..., C, H]`` float -> ``(data [..., C, H // 4], scale, zero)`` bfloat16 stats
    ``[..., H]`` (``"channel"``: over the ``C`` tokens) or ``[..., C]`` (``"token"``)."""
    x = x.astype(jnp.float32)
    axis = -2 if grouping == "channel" else -1
    lo = jnp.min(x, axis=axis)
    hi = jnp.max(x, axis=axis)
    zero = lo.astype(jnp.bfloat16)
    scale = ((hi - lo) * (jnp.float32(1.0) / jnp.float32(_LEVELS))).astype(jnp.bfloat16)
    z = jnp.expand_dims(zero.astype(jnp.float32), axis)
    s = jnp.expand_dims(scale.astype(jnp.float32), axis)
    positive = s > 0
    q = jnp.round((x - z) * (1.0 / jnp.where(positive, s, 1.0)))
    q = jnp.where(positive, jnp.clip(q, 0.0, _LEVELS), 0.0)
    bad = nonfinite(x, axis) | ~jnp.isfinite(hi - lo)  # min / max may have dropped a NaN
    q = jnp.where(jnp.expand_dims(bad, axis), 0.0, q)  # a NaN / inf group: codes 0, stats NaN
    scale = jnp.where(bad, jnp.nan, scale).astype(jnp.bfloat16)
    zero = jnp.where(bad, jnp.nan, zero).astype(jnp.bfloat16)  # not XLA's min, which may skip NaN
    return pack2(q), scale, zero


def decode(data, scale, zero, grouping: str):
    """The inverse of :func:`encode`: float32 ``[..., C, H]``."""
    q = unpack2(data)
    axis = -2 if grouping == "channel" else -1
    s = jnp.expand_dims(scale.astype(jnp.float32), axis)
    z = jnp.expand_dims(zero.astype(jnp.float32), axis)
    return z + q * s
