"""Conversions between :class:`paged.QuantizedPages` and JAX's TPU ragged paged attention.

Theirs (``ref_ragged_paged_attention``): ``kv_pages [P, C, 2K, H]``, keys at combined heads
``0::2`` and values at ``1::2``, float8 or int8, with one Python float scale per side (per
tensor) and zero-based pages. Ours: one pool per side with per-token scales and a null page 0.
:func:`from_jax_ragged_kv_pages` is exact; :func:`to_jax_ragged_kv_pages` requantizes per-token
scales to one per tensor (bounded in its docstring). The conventions of every JAX kernel, and
the other conversions, are in :mod:`paged._interop`.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Shaped

from paged._checks import describe
from paged._interop import (
    _RANGE,
    FloatScalar,
    KVPoolPair,
    _our_pool,
    _stored_format,
    _with_null_page,
)
from paged._quantized import QuantizedPages, dequantize_block

__all__ = ["JaxRaggedKV", "from_jax_ragged_kv_pages", "to_jax_ragged_kv_pages"]


class JaxRaggedKV(NamedTuple):
    """JAX's ragged paged attention inputs: ``kv_pages [P, C, 2K, H]`` and its two scalars.

    Pass as ``ref_ragged_paged_attention(q, kv.kv_pages, ..., k_scale=kv.k_scale,
    v_scale=kv.v_scale)`` (the kernel takes the scales as static Python floats).
    """

    kv_pages: Any
    k_scale: float
    v_scale: float


def _scale_option(fn: str, name: str, value) -> float | None:
    """A per-tensor scale: None, or a finite positive real (returned as a Python float)."""
    if value is None:
        return None
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not np.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"{fn}: {name}: expected None or a finite positive Python float, got {value!r}"
        )
    return float(value)


def from_jax_ragged_kv_pages(
    kv_pages: Shaped[Array, "P C KV H"],
    *,
    k_scale: FloatScalar | None = None,
    v_scale: FloatScalar | None = None,
) -> KVPoolPair:
    """Converts JAX's ragged paged attention pages (fused K/V, per-tensor scales) to ours.

    JAX's ``ref_ragged_paged_attention`` (``pallas/ops/tpu/ragged_paged_attention``) reads
    keys from ``kv_pages[:, :, 0::2]`` and values from ``kv_pages[:, :, 1::2]`` and decodes
    them ``k.astype(float32) * k_scale`` (``v_scale`` alike; no scale: unscaled). Ours: every
    token's scale is ``float32(k_scale)`` (1 when None), so our decoded values equal the
    reference's float32 ones bitwise (it then casts them to ``q``'s dtype: with bfloat16
    queries it rounds where we keep float32). Query head ``n`` uses kv head ``n // (N / K)``
    in both. Jittable (the scales are static).

    Args:
      kv_pages: ``[P, C, 2K, H]`` int8 or float8_e4m3fn, zero-based pages (``KV = 2K``).
      k_scale: the key scale (a finite positive Python float), or None (unscaled).
      v_scale: the value scale, or None.

    Returns:
      :class:`KVPoolPair` of :class:`paged.QuantizedPages` ``[K, P + 1, C, H]`` (format from
      the dtype): page ``i`` at index ``i + 1``, a zeroed null page 0 (scale 0). Convert the
      table with :func:`paged.from_zero_based_table`.

    Raises:
      ValueError: if ``kv_pages`` is not a rank-4 int8 / float8_e4m3fn array with an even,
        non-zero third dim, or a scale is not None / a finite positive float.

    Example:
      >>> kv = jnp.ones((3, 4, 2, 8), jnp.float8_e4m3fn)  # P=3, C=4, K=1, H=8
      >>> k, v = from_jax_ragged_kv_pages(kv, k_scale=0.5, v_scale=2.0)
      >>> k.shape, float(k.dequantize()[0, 1, 0, 0]), float(v.dequantize()[0, 0, 0, 0])
      ((1, 4, 4, 8), 0.5, 0.0)
    """
    fn = "from_jax_ragged_kv_pages"
    kv_format = _stored_format(fn, "kv_pages", kv_pages, 4)
    P, C, K2, H = kv_pages.shape
    if K2 % 2:
        raise ValueError(
            f"{fn}: kv_pages: expected [P, C, 2K, H] (keys and values interleaved), got an odd "
            f"third dim in {describe(kv_pages)}"
        )
    scales = [_scale_option(fn, "k_scale", k_scale), _scale_option(fn, "v_scale", v_scale)]
    fused = jnp.asarray(kv_pages).reshape(P, C, K2 // 2, 2, H)  # [P, C, K, 2, H]
    pools = []
    for side, scale in enumerate(scales):
        data = fused[:, :, :, side].transpose(2, 0, 1, 3)  # [K, P, C, H]
        value = np.float32(1.0 if scale is None else scale)
        pools.append(_with_null_page(data, jnp.full(data.shape[:-1], value), kv_format))
    return KVPoolPair(*pools)


def _tensor_scale(fn: str, name: str, pages: QuantizedPages, given) -> float:
    """The per-tensor scale: ``given``, else the largest finite scale of pages ``1..``."""
    given = _scale_option(fn, name, given)
    if given is not None:
        return given
    if isinstance(pages.scale, jax.core.Tracer):
        raise ValueError(
            f"{fn}: {name}: expected a Python float under jit (the default is computed from "
            f"the scales' values, which a traced pool does not have), got None"
        )
    scale = pages.scale[:, 1:]
    largest = float(jnp.max(jnp.where(jnp.isfinite(scale), scale, 0.0)))
    return largest if largest > 0 else 1.0


def _requantize(pages: QuantizedPages, scale: float):
    """Pages ``1..`` decoded and re-encoded over one scale: ``[K, P - 1, C, H]`` stored."""
    kind = pages.format.kind
    low, high = _RANGE[kind]
    x = dequantize_block(pages.data[:, 1:], pages.scale[:, 1:], pages.format) / np.float32(scale)
    x = jnp.clip(x, low, high)
    if kind == "int8":
        x = jnp.where(jnp.isnan(x), 0.0, jnp.round(x))
    return x.astype(pages.format.storage_dtype)


def to_jax_ragged_kv_pages(
    k_pages: QuantizedPages,
    v_pages: QuantizedPages,
    *,
    k_scale: FloatScalar | None = None,
    v_scale: FloatScalar | None = None,
) -> JaxRaggedKV:
    """Converts our pools to JAX's ragged paged attention layout (fused K/V, one scale each).

    JAX's convention has one scale per tensor where ours has one per token: each side is
    decoded and re-encoded over its per-tensor scale ``t`` (``k_scale``, default the largest
    finite scale in pages ``1..``; free pages count: pass ``k_scale=`` to choose it),
    ``round(x / t)`` clipped to ``[-128, 127]`` (int8) or cast to ``float8_e4m3fn`` after a
    clip to ``[-448, 448]``. Our page 0 is dropped. This is a requantization:

    * int8: ``|x' - x| <= t / 2`` per element (half a step of the coarser grid), vs ours'
      ``scale / 2``;
    * fp8: ``|x' - x| <= |x| / 16 + t * 2**-10`` (3 mantissa bits; the second term is e4m3's
      subnormal spacing on the coarser grid);

    plus float32 rounding, for every value with ``|x| <= qmax * t`` (larger ones are clipped:
    only a ``t`` below the largest scale makes them). It is exact, the stored values bitwise,
    when every scale of pages ``1..`` is ``t`` or 0 (pools made by
    :func:`from_jax_ragged_kv_pages`, so theirs -> ours -> theirs is exact): ``x / t`` is then
    the stored value up to float32 rounding, far under half a step. A token with a NaN scale
    (written NaN / inf: :func:`paged.validate` finds it) becomes NaN in fp8 and 0 in int8.

    Jittable only with both scales given (they are static: JAX's kernel needs them as Python
    floats); with a default, it reads the scales (eager).

    Args:
      k_pages: :class:`paged.QuantizedPages` ``[K, P + 1, C, H]``, int8 or fp8, page 0 null.
      v_pages: the same for values, of the same shape and format.
      k_scale: the per-tensor key scale to encode with (finite positive float), or None.
      v_scale: the same for values.

    Returns:
      :class:`JaxRaggedKV` ``(kv_pages [P, C, 2K, H] in the storage dtype, k_scale, v_scale)``
      (Python floats); our page ``i`` is their page ``i - 1``. Convert the table with
      :func:`to_zero_based_table`.

    Raises:
      ValueError: if the pools are not two :class:`paged.QuantizedPages` ``[K, P, C, H]`` of
        one shape and format with ``P >= 2``, a scale is not None / a finite positive float,
        or a scale is None under ``jit``.
      NotImplementedError: for a format other than int8 and fp8.

    Example:
      >>> from paged import KVFormat, quantize_pages
      >>> k = quantize_pages(jnp.ones((1, 3, 4, 8)), KVFormat("fp8"))
      >>> kv = to_jax_ragged_kv_pages(k, k)
      >>> kv.kv_pages.shape, kv.k_scale == float(k.scale[0, 1, 0])
      ((2, 4, 2, 8), True)
    """
    fn = "to_jax_ragged_kv_pages"
    shape = _our_pool(fn, "k_pages", k_pages)
    if _our_pool(fn, "v_pages", v_pages) != shape or v_pages.format != k_pages.format:
        raise ValueError(
            f"{fn}: v_pages: expected the shape and format of k_pages ({describe(k_pages)}), "
            f"got {describe(v_pages)}"
        )
    K, P, C, H = shape
    t_k = _tensor_scale(fn, "k_scale", k_pages, k_scale)
    t_v = _tensor_scale(fn, "v_scale", v_pages, v_scale)
    k = _requantize(k_pages, t_k)  # [K, P - 1, C, H]
    v = _requantize(v_pages, t_v)
    fused = jnp.stack([k, v], axis=-2)  # [K, P - 1, C, 2, H]
    fused = fused.transpose(1, 2, 0, 3, 4).reshape(P - 1, C, 2 * K, H)  # [P - 1, C, 2K, H]
    return JaxRaggedKV(fused, t_k, t_v)
