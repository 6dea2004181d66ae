"""Quantized ring hops: per-token, per-kv-head absmax quantization of the travelling K/V.

With ``hop_format="int8"`` or ``"fp8"`` each device quantizes its local keys and values once;
the ring then passes the quantized values and their float32 scales (one per token and kv head)
through ``ppermute`` instead of the input dtype, and every block (the local one included) is
dequantized to float32 right before its block computation. The result is exact attention over
``dequantize_hop(quantize_hop(k))``, ``dequantize_hop(quantize_hop(v))``.

The hop format is a :class:`ringattn.KVFormat` of a per-token kind, ``KVFormat("int8")`` or
``KVFormat("fp8")`` (``paged.KVFormat`` is the same class); the strings ``"int8"`` and
``"fp8"`` are shorthand for them, as a dtype name is for a dtype. Its codec is the one the
quantized KV pages use (:meth:`KVFormat.encode` / :meth:`KVFormat.decode`, rules in
``ringattn._formats``), so a ring hop and a page store the same token as the same bytes:
``scale = absmax * float32(1 / QMAX)`` per token and kv head (QMAX 127 or 448), data
``x * float32(1 / scale)`` clipped to ``±QMAX``, rounded half to even for int8 or cast to
``float8_e4m3fn`` for fp8, ``H + 4`` bytes per token and kv head instead of ``4 H`` (float32)
or ``2 H`` (bf16). An all-zero token, or one whose scale would be below ``2**-126``, gets
``scale = 0`` and dequantizes to exact zeros; a token whose row holds NaN or inf gets a NaN
scale and dequantizes to NaN across its row (that token and kv head only); a key no query may
see still has no effect. ``tests/paged/test_codec_docs.py`` rewrites the rules in numpy and
checks the bits. int4 and kivi2 (grouped scales, per-page channels) do not travel in hops.

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
from ringattn._formats import KVFormat

__all__ = ["HOP_FORMATS", "QuantizedHop", "check_hop_format", "dequantize_hop", "quantize_hop"]

#: The :class:`KVFormat` kinds a ring hop carries; each name is also accepted as shorthand
#: for ``KVFormat(name)`` wherever a ``hop_format`` is taken.
HOP_FORMATS = ("int8", "fp8")


def check_hop_format(fn: str, hop_format) -> KVFormat | None:
    """``None`` or the :class:`KVFormat` of a ``hop_format`` (a KVFormat of a kind in
    :data:`HOP_FORMATS`, or one of those names); ``ValueError`` for anything else,
    ``NotImplementedError`` for a KVFormat whose kind hops do not carry."""
    if hop_format is None:
        return None
    if isinstance(hop_format, str) and hop_format in HOP_FORMATS:
        return KVFormat(hop_format)
    if isinstance(hop_format, KVFormat):
        if hop_format.kind not in HOP_FORMATS:
            raise NotImplementedError(
                f"{fn}: hop_format: ring hops carry the per-token formats {HOP_FORMATS}, got "
                f"{hop_format!r}; quantize pages with it (paged.init_paged_cache(kv_format=)) "
                "or pass hop_format=KVFormat('int8') or KVFormat('fp8')"
            )
        return hop_format
    raise fail(
        fn,
        "hop_format",
        f"None or one of {HOP_FORMATS} (shorthand for ringattn.KVFormat(name)), or such a KVFormat",
        describe(hop_format),
    )


class QuantizedHop(NamedTuple):
    """Keys or values as a quantized ring hop carries them.

    Attributes:
      data: ``[..., H]`` ``int8`` or ``float8_e4m3fn`` quantized values.
      scale: ``[...]`` float32 scale of each token and kv head (``0`` for an all-zero row).
    """

    data: Shaped[Array, "*rows H"]
    scale: Float[Array, "*rows"]


def quantize_hop(x: Float[Array, "*rows H"], *, hop_format: KVFormat | str) -> QuantizedHop:
    """Per-row absmax quantization over the last axis (the head dim), as a ring hop sends it.

    Args:
      x: ``[..., H]`` floating keys or values, e.g. ``[B, S, K, H]``; each row of ``H`` values
        (one token, one kv head) gets its own scale.
      hop_format: ``KVFormat("int8")`` (``scale = absmax * float32(1 / 127)``, ``x *
        float32(1 / scale)`` clipped to ``±127``, rounded half to even) or
        ``KVFormat("fp8")`` (``scale = absmax * float32(1 / 448)``, ``x * float32(1 /
        scale)`` clipped to ``±448``, cast to ``float8_e4m3fn``, round to nearest even), or
        the shorthand ``"int8"`` / ``"fp8"``: the same bits as ``hop_format.encode(x)`` and
        as a page of that format. See the module docs.

    Returns:
      :class:`QuantizedHop` ``(data [..., H], scale [...] float32)``.

    Raises:
      ValueError: ``hop_format`` not a KVFormat or name of :data:`HOP_FORMATS`, or ``x``
        not a floating array of rank >= 1.
      NotImplementedError: a KVFormat of a kind hops do not carry (int4, kivi2).

    Example:
      >>> import jax.numpy as jnp
      >>> hop = quantize_hop(jnp.array([[1.0, -0.5], [0.0, 0.0]]), hop_format="int8")
      >>> hop.data.tolist(), hop.scale.tolist()
      ([[127, -64], [0, 0]], [0.007874015718698502, 0.0])
    """
    fn = "quantize_hop"
    hop_format = check_hop_format(fn, hop_format)
    if hop_format is None:
        raise fail(fn, "hop_format", f"one of {HOP_FORMATS} or its KVFormat", "None")
    if not hasattr(x, "dtype") or x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise fail(fn, "x", "a floating array [..., H]", describe(x))
    return quantize_rows(x, hop_format)


def quantize_rows(x, hop_format: KVFormat) -> QuantizedHop:
    """:func:`quantize_hop` on validated inputs: ``hop_format.encode`` (traceable)."""
    return QuantizedHop(*hop_format.encode(x))


def dequantize_hop(hop: QuantizedHop) -> Float[Array, "*rows H"]:
    """``data * scale`` in float32: the keys or values every block computation sees.

    Args:
      hop: :class:`QuantizedHop` from :func:`quantize_hop`.

    Returns:
      ``[..., H]`` float32.

    Raises:
      ValueError: ``hop`` is not a QuantizedHop whose ``data`` is int8 or float8_e4m3fn (the
        format it was quantized in) and whose ``scale`` shape is ``data``'s without its last
        axis.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([[1.0, -0.5]])
      >>> dequantize_hop(quantize_hop(x, hop_format="int8")).tolist()
      [[1.0, -0.5039370059967041]]
    """
    fn = "dequantize_hop"
    if not isinstance(hop, QuantizedHop):
        raise fail(fn, "hop", "a ringattn.QuantizedHop", describe(hop))
    kinds = {KVFormat(kind).storage_dtype: kind for kind in HOP_FORMATS}
    kind = kinds.get(getattr(hop.data, "dtype", None))
    if kind is None:
        raise fail(fn, "hop.data", "an int8 or float8_e4m3fn array [..., H]", describe(hop.data))
    if tuple(hop.scale.shape) != tuple(hop.data.shape[:-1]):
        raise fail(fn, "hop.scale", f"shape {tuple(hop.data.shape[:-1])}", describe(hop.scale))
    return dequantize_rows(hop.data, hop.scale, KVFormat(kind))


def dequantize_rows(data, scale, hop_format: KVFormat):
    """:func:`dequantize_hop` on validated arrays: ``hop_format.decode`` (traceable)."""
    return hop_format.decode(data, scale)


def hop_row_bytes(head_dim: int, dtype, hop_format: KVFormat | None) -> int:
    """Bytes one token of one kv head (keys or values) takes in a hop."""
    if hop_format is None:
        return head_dim * np.dtype(dtype).itemsize
    return int(hop_format.bytes_per_token(head_dim))
