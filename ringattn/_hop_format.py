"""Quantized ring hops: per-token, per-kv-head absmax quantization of the travelling K/V.

With ``hop_format="int8"`` or ``"fp8"`` each device quantizes its local keys and values once;
the ring then passes the quantized values and their float32 scales (one per token and kv head)
through ``ppermute`` instead of the input dtype, and every block (the local one included) is
dequantized to float32 right before its block computation. The result is exact attention over
``dequantize_hop(quantize_hop(k))``, ``dequantize_hop(quantize_hop(v))``.

Formats (absmax over the head dim ``H`` of one token and kv head; ``x`` in float32, each
step a float32 operation rounded to nearest even, in this order; ``QMAX`` 127 or 448):
``scale = absmax * float32(1 / QMAX)``, ``y = x * float32(1 / scale)`` (the reciprocal
first, then the product; not ``x / scale``), then

* ``"int8"``: ``data = clip(round(y), -127, 127)``, round half to even, then the clip: a hop
  of ``H + 4`` bytes per token and kv head instead of ``4 H`` (float32) or ``2 H`` (bf16);
  error at most ``scale / 2 = absmax / 254`` per element.
* ``"fp8"``: ``data = clip(y, -448, 448)`` cast to ``float8_e4m3fn`` (round to nearest even;
  448 is its largest finite value): the same bytes, a relative error of at most ``2**-4``
  per element (3 mantissa bits) above the format's subnormal range.

``tests/paged/test_codec_docs.py`` rewrites these words in numpy and checks the bits.
An all-zero token, or one whose scale would be below ``2**-126`` (float32's smallest
normal), gets ``scale = 0`` and data 0 and dequantizes to exact zeros. A token whose row holds
NaN or inf gets a NaN scale and data 0, and dequantizes to NaN across its whole row (that
token and kv head only), at any array size; a key no query may see still has no effect.

Gradients are straight-through: the backward ring sends the same quantized K/V (and float32
dK/dV accumulators, unquantized), so ``dq`` is the exact gradient of attention over the
dequantized keys and values, and ``dk``, ``dv`` are the exact gradients with respect to the
dequantized keys and values, returned as the gradients of ``k`` and ``v``.
"""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped

from ringattn._checks import describe, fail

__all__ = ["HOP_FORMATS", "QuantizedHop", "check_hop_format", "dequantize_hop", "quantize_hop"]

HOP_FORMATS = ("int8", "fp8")

# format -> (storage dtype, largest magnitude the scale maps the absmax to)
_FORMATS = {
    "int8": (jnp.int8, 127.0),
    "fp8": (jnp.float8_e4m3fn, 448.0),
}


def check_hop_format(fn: str, hop_format) -> str | None:
    """``None`` or one of :data:`HOP_FORMATS`, else ``ValueError`` naming ``fn``."""
    if hop_format is None or (isinstance(hop_format, str) and hop_format in HOP_FORMATS):
        return hop_format
    raise fail(fn, "hop_format", f"None or one of {HOP_FORMATS}", describe(hop_format))


class QuantizedHop(NamedTuple):
    """Keys or values as a quantized ring hop carries them.

    Attributes:
      data: ``[..., H]`` ``int8`` or ``float8_e4m3fn`` quantized values.
      scale: ``[...]`` float32 scale of each token and kv head (``0`` for an all-zero row).
    """

    data: Shaped[Array, "*rows H"]
    scale: Float[Array, "*rows"]


def quantize_hop(x: Float[Array, "*rows H"], *, hop_format: str) -> QuantizedHop:
    """Per-row absmax quantization over the last axis (the head dim), as a ring hop sends it.

    Args:
      x: ``[..., H]`` floating keys or values, e.g. ``[B, S, K, H]``; each row of ``H`` values
        (one token, one kv head) gets its own scale.
      hop_format: ``"int8"`` (``scale = absmax * float32(1 / 127)``, ``x * float32(1 /
        scale)`` rounded half to even, clipped to ``±127``) or ``"fp8"`` (``scale = absmax *
        float32(1 / 448)``, ``x * float32(1 / scale)`` clipped to ``±448``, cast to
        ``float8_e4m3fn``, round to nearest even). See the module docs.

    Returns:
      :class:`QuantizedHop` ``(data [..., H], scale [...] float32)``.

    Raises:
      ValueError: ``hop_format`` not one of :data:`HOP_FORMATS`, or ``x`` not a floating
        array of rank >= 1.

    Example:
      >>> import jax.numpy as jnp
      >>> hop = quantize_hop(jnp.array([[1.0, -0.5], [0.0, 0.0]]), hop_format="int8")
      >>> hop.data.tolist(), hop.scale.tolist()
      ([[127, -64], [0, 0]], [0.007874015718698502, 0.0])
    """
    fn = "quantize_hop"
    if check_hop_format(fn, hop_format) is None:
        raise fail(fn, "hop_format", f"one of {HOP_FORMATS}", "None")
    if not hasattr(x, "dtype") or x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise fail(fn, "x", "a floating array [..., H]", describe(x))
    return quantize_rows(x, hop_format)


def quantize_rows(x, hop_format: str) -> QuantizedHop:
    """:func:`quantize_hop` on validated inputs (traceable, any floating dtype)."""
    dtype, top = _FORMATS[hop_format]
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) * (np.float32(1.0) / np.float32(top))
    # A row holding NaN / inf gets a NaN scale, from a count of its non-finite values: XLA:CPU's
    # max reduction drops NaN in larger arrays, so the max alone cannot be trusted to carry it.
    bad = jnp.sum(~jnp.isfinite(x), axis=-1, dtype=jnp.int32) > 0
    # Below float32's smallest normal the scale is 0 on every backend (XLA:CPU flushes it).
    scale = jnp.where(bad, jnp.nan, jnp.where(scale < 2.0**-126, 0.0, scale))
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    y = jnp.where(
        scale[..., None] > 0, x * (1.0 / safe), 0.0
    )  # 0 in a NaN row: its scale carries it
    if hop_format == "int8":
        y = jnp.round(y)
    y = jnp.clip(y, -top, top)  # NaN stays NaN (its scale is NaN too)
    return QuantizedHop(y.astype(dtype), scale)


def dequantize_hop(hop: QuantizedHop) -> Float[Array, "*rows H"]:
    """``data * scale`` in float32: the keys or values every block computation sees.

    Args:
      hop: :class:`QuantizedHop` from :func:`quantize_hop`.

    Returns:
      ``[..., H]`` float32.

    Raises:
      ValueError: ``hop`` is not a QuantizedHop whose ``scale`` shape is ``data``'s without
        its last axis.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([[1.0, -0.5]])
      >>> dequantize_hop(quantize_hop(x, hop_format="int8")).tolist()
      [[1.0, -0.5039370059967041]]
    """
    fn = "dequantize_hop"
    if not isinstance(hop, QuantizedHop):
        raise fail(fn, "hop", "a ringattn.QuantizedHop", describe(hop))
    if tuple(hop.scale.shape) != tuple(hop.data.shape[:-1]):
        raise fail(fn, "hop.scale", f"shape {tuple(hop.data.shape[:-1])}", describe(hop.scale))
    return dequantize_rows(hop.data, hop.scale)


def dequantize_rows(data, scale):
    """:func:`dequantize_hop` on validated arrays."""
    return data.astype(jnp.float32) * scale[..., None]


def hop_row_bytes(head_dim: int, dtype, hop_format: str | None) -> int:
    """Bytes one token of one kv head (keys or values) takes in a hop."""
    if hop_format is None:
        return head_dim * np.dtype(dtype).itemsize
    return head_dim * np.dtype(_FORMATS[hop_format][0]).itemsize + 4
