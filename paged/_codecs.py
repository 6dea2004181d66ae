"""The encoders and decoders of the quantized KV formats, one small codec per kind (``_CODECS``).

int8 / fp8 (per-token absmax, float32 scale), int4 (per-group absmax, bfloat16 scale, two
levels per byte) and kivi2 (through :mod:`paged._kivi_codec`). The exact semantics, bit for
bit, are written out in :mod:`paged._quantized`'s docstring; :class:`paged.KVFormat` picks a
codec by its kind.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax

from paged import _kivi_codec

_TINY = 2.0**-126  # float32's smallest normal: smaller scales are flushed, the token stores 0


def _absmax_scale(x, qmax, axis=-1):
    """``(scale, keep)`` of float32 ``x``: ``absmax / qmax`` along ``axis`` (NaN where the
    vector holds NaN / inf) and whether the vector stores non-zero levels. The NaN comes from
    a count of non-finite values: XLA:CPU's max reduction drops NaN in larger arrays."""
    absmax = jnp.max(jnp.abs(x), axis=axis)
    finite = ~_kivi_codec.nonfinite(x, axis) & jnp.isfinite(absmax)
    # The documented rule, spelled as it runs: XLA rewrites a division by a constant into a
    # multiplication by its float32 reciprocal, so say so here.
    scale = jnp.where(finite, absmax * reciprocal(qmax), jnp.nan)
    keep = finite & (scale >= _TINY)
    # Below float32's smallest normal the scale is 0 on every backend (XLA:CPU flushes it).
    return jnp.where(finite & ~keep, 0.0, scale), keep


def reciprocal(q: float):
    """``float32(1 / q)``, correctly rounded: the factor the documented rules multiply by."""
    return np.float32(1.0) / np.float32(q)


class _PerTokenCodec:
    """int8 / fp8: one float32 absmax scale per ``[H]`` vector, ``data`` of ``x``'s shape."""

    def __init__(self, storage_dtype, qmax: float, rounds: bool):
        self.storage_dtype, self.scale_dtype = jnp.dtype(storage_dtype), jnp.dtype(jnp.float32)
        self.qmax, self.rounds = qmax, rounds

    def data_shape(self, shape, group_size):
        return tuple(shape)

    def scale_shape(self, shape, group_size, grouping="token"):
        return tuple(shape[:-1])

    def float_shape(self, data_shape, group_size):
        return tuple(data_shape)

    def bytes_per_token(self, H, group_size):
        return H * self.storage_dtype.itemsize + 4

    def encode(self, x, group_size):
        scale, keep = _absmax_scale(x, self.qmax)
        # Divide by the scale, not by absmax: XLA computes x / y as x * (1 / y), and 1 / absmax
        # is subnormal (flushed to zero on CPU) for absmax > 2**126, while 1 / scale is not.
        # x * (1 / scale), spelled out: XLA rewrites x / broadcast(scale) into exactly this.
        scaled = x * (1.0 / jnp.where(keep, scale, 1.0))[..., None]
        scaled = jnp.clip(scaled, -self.qmax, self.qmax)
        if self.rounds:
            scaled = jnp.round(scaled)
        data = jnp.where(keep[..., None], scaled, 0.0).astype(self.storage_dtype)
        return data, scale

    def decode(self, data, scale, group_size):
        return data.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


class _Int4Codec:
    """int4: symmetric levels -7..7, two per byte along H, a bfloat16 scale per group."""

    storage_dtype = jnp.dtype(jnp.uint8)
    scale_dtype = jnp.dtype(jnp.bfloat16)
    qmax = 7.0

    def data_shape(self, shape, group_size):
        return (*shape[:-1], shape[-1] // 2)

    def scale_shape(self, shape, group_size, grouping="token"):
        return (*shape[:-1], shape[-1] // group_size)

    def float_shape(self, data_shape, group_size):
        return (*data_shape[:-1], 2 * data_shape[-1])

    def bytes_per_token(self, H, group_size):
        return H // 2 + 2 * (H // group_size)

    def encode(self, x, group_size):
        *lead, H = x.shape
        groups = x.reshape(*lead, H // group_size, group_size)  # [..., H / g, g]
        scale, keep = _absmax_scale(groups, self.qmax)
        # Round to nearest: a scale >= 2**-126 stays >= 2**-126 (a bfloat16 normal).
        scale = scale.astype(jnp.bfloat16)
        inverse = 1.0 / jnp.where(keep, scale.astype(jnp.float32), 1.0)[..., None]
        levels = jnp.clip(jnp.round(groups * inverse), -self.qmax, self.qmax)
        levels = jnp.where(keep[..., None], levels, 0.0).astype(jnp.int8).reshape(*lead, H)
        nibbles = lax.bitcast_convert_type(levels, jnp.uint8) & jnp.uint8(0xF)
        data = nibbles[..., 0::2] | (nibbles[..., 1::2] << jnp.uint8(4))  # [..., H / 2]
        return data, scale

    def decode(self, data, scale, group_size):
        *lead, half = data.shape
        signed = lax.bitcast_convert_type(data, jnp.int8)
        low = lax.bitcast_convert_type(data << jnp.uint8(4), jnp.int8) >> jnp.int8(4)
        high = signed >> jnp.int8(4)  # arithmetic shifts: the nibbles' two's complement
        levels = jnp.stack([low, high], axis=-1).astype(jnp.float32)  # [..., H / 2, 2]
        levels = levels.reshape(*lead, -1, group_size)  # [..., H / g, g]
        return (levels * scale.astype(jnp.float32)[..., None]).reshape(*lead, 2 * half)


class _Kivi2Codec:
    """kivi2 (see :mod:`paged._kivi`): 2-bit codes, four per byte along H, bfloat16 scale and
    zero per channel over each key page / per value token; written through ``paged.write``."""

    storage_dtype = jnp.dtype(jnp.uint8)
    scale_dtype = jnp.dtype(jnp.bfloat16)
    qmax = 3.0

    def data_shape(self, shape, group_size):
        return (*shape[:-1], shape[-1] // 4)

    def scale_shape(self, shape, group_size, grouping="token"):
        return (*shape[:-2], shape[-1]) if grouping == "channel" else tuple(shape[:-1])

    def float_shape(self, data_shape, group_size):
        return (*data_shape[:-1], 4 * data_shape[-1])

    def bytes_per_token(self, H, group_size, page_size):
        return (H / 4 + 4 * H / page_size + H / 4 + 4) / 2

    def encode(self, x, group_size):
        raise ValueError("kivi2 pages are written through paged.write / write_layer / append")


_CODECS = {
    "int8": _PerTokenCodec(jnp.int8, 127.0, rounds=True),
    "fp8": _PerTokenCodec(jnp.float8_e4m3fn, 448.0, rounds=False),
    "int4": _Int4Codec(),
    "kivi2": _Kivi2Codec(),
}
