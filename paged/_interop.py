"""Conversions between :class:`paged.QuantizedPages` and the quantized KV conventions of JAX's
own paged-attention kernels (``jax.experimental.pallas.ops``).

Ours: one pool per kv side, ``data [K, P + 1, C, H]`` int8 / ``float8_e4m3fn`` and ``scale
[K, P + 1, C]`` float32 (one scale per token per kv head), decoded as ``data * scale`` in
float32; page 0 is the reserved null page. Theirs, all with zero-based pages (page 0 an
ordinary page, ``P`` pages):

=====================  =========================================  ==========================
JAX kernel             pages                                      scales
=====================  =========================================  ==========================
TPU ragged paged       ``kv_pages [P, C, 2K, H]``: keys at         ``k_scale``, ``v_scale``:
(``ref_ragged_paged_   combined heads ``0::2``, values ``1::2``    one Python float each
attention``)           (float8 or int8)                           (per tensor)
TPU paged              ``QuantizedTensor.weight [K, P, C, H]``     ``.scales [K, P, C, 1]``:
(``paged_attention``)  int8                                       absmax, decoded
                                                                  ``w * h / 127.5``
GPU paged              ``k_pages [K, P, C, H]`` int8 / float8      ``k_scales_pages [K, P,
(``paged_attention``)                                             C]``: ``w * s`` (ours)
=====================  =========================================  ==========================

Every ``from_jax_*`` returns pools of ``P + 1`` pages with zero-based page ``i`` at index
``i + 1`` and a zeroed null page (scale 0) in front: convert their tables with
:func:`paged.from_zero_based_table`. Every ``to_jax_*`` drops our page 0; convert our tables
with :func:`to_zero_based_table`. Their kernels read only pages a table names (padding slots
included) and mask the slots past a length, the TPU and GPU kernels arithmetically: a NaN or
inf stored there reaches their results, where ours removes it with a select. Garbage in pages
no table names is harmless on both sides.

Exactness (details in each function): the TPU int8 and GPU conventions convert the stored
values bitwise both ways. GPU: scales bitwise too. TPU: scales are multiplied or divided by
127.5, so they come back within one float32 ulp (most of them exactly; none can be exact for
all, see :func:`to_jax_tpu_quantized`). The ragged convention has one scale per tensor: to it
from per-token scales is a requantization (bounded in :func:`to_jax_ragged_kv_pages`);
converting from it is exact.

The ragged conversions live in :mod:`paged._interop_ragged`; this module holds the shared
checks, the TPU paged and GPU conversions and the table conversion.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, Shaped

from paged._checks import check_array, check_quantized, describe
from paged._quantized import KVFormat, QuantizedPages, is_quantized

__all__ = [
    "JAX_TPU_MAX_INT8",
    "JaxScalePages",
    "KVPoolPair",
    "from_jax_gpu_scale_pages",
    "from_jax_tpu_quantized",
    "to_jax_gpu_scale_pages",
    "to_jax_tpu_quantized",
    "to_zero_based_table",
]

# ``quantization_utils.MAX_INT8`` of JAX's TPU paged attention: it decodes ``w * h / 127.5``.
JAX_TPU_MAX_INT8 = 127.5

FloatScalar = float | int | np.floating | np.integer

# Storage dtypes the conversions understand, and our format for each.
_KINDS = {np.dtype(jnp.int8): "int8", np.dtype(jnp.float8_e4m3fn): "fp8"}
# Requantization range: int8 keeps -128 (JAX's 127.5 convention stores it), fp8 its max.
_RANGE = {"int8": (-128.0, 127.0), "fp8": (-448.0, 448.0)}


class KVPoolPair(NamedTuple):
    """Our key and value pools, both :class:`paged.QuantizedPages` ``[K, P + 1, C, H]``."""

    k_pages: QuantizedPages
    v_pages: QuantizedPages


class JaxScalePages(NamedTuple):
    """JAX's GPU paged attention pool: ``pages [K, P, C, H]`` and ``scales_pages [K, P, C]``."""

    pages: Any
    scales_pages: Any


def _stored_format(fn: str, name: str, x, ndim: int) -> KVFormat:
    """``x`` an int8 / float8_e4m3fn array of rank ``ndim``; returns our format for it."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or x.ndim != ndim:
        raise ValueError(f"{fn}: {name}: expected a rank-{ndim} array, got {describe(x)}")
    kind = _KINDS.get(np.dtype(x.dtype))
    if kind is None:
        raise ValueError(
            f"{fn}: {name}: expected dtype int8 or float8_e4m3fn (quantized pages), got "
            f"{describe(x)}"
        )
    if any(size < 1 for size in x.shape):
        raise ValueError(f"{fn}: {name}: expected non-empty dims, got {describe(x)}")
    return KVFormat(kind)


def _our_pool(fn: str, name: str, pages, kinds=("int8", "fp8")) -> tuple[int, int, int, int]:
    """``pages`` a :class:`QuantizedPages` ``[K, P, C, H]`` of a kind in ``kinds``, ``P >= 2``
    (the null page and at least one real page); returns ``(K, P, C, H)``."""
    if not is_quantized(pages):
        raise ValueError(f"{fn}: {name}: expected a paged.QuantizedPages, got {describe(pages)}")
    kind = getattr(pages.format, "kind", None)
    if isinstance(pages.format, KVFormat) and kind not in ("int8", "fp8"):
        raise NotImplementedError(
            f"{fn}: {name}: format {kind!r} has no counterpart in JAX's kernels (int8 and fp8 "
            f"convert)"
        )
    check_quantized(fn, name, pages, 4)
    if kind not in kinds:
        raise ValueError(
            f"{fn}: {name}: expected a format in {list(kinds)} (this convention), got {kind!r}"
        )
    K, P, C, H = pages.shape
    if min(K, C, H) < 1 or P < 2:
        raise ValueError(
            f"{fn}: {name}: expected [K, P, C, H] with P >= 2 (the null page and at least one "
            f"page), got {describe(pages)}"
        )
    return K, P, C, H


def _with_null_page(data, scale, kv_format: KVFormat) -> QuantizedPages:
    """Zero-based ``data [K, P, C, H]``, ``scale [K, P, C]`` -> ours with a zeroed page 0."""
    data = jnp.pad(jnp.asarray(data), ((0, 0), (1, 0), (0, 0), (0, 0)))
    scale = jnp.pad(jnp.asarray(scale, jnp.float32), ((0, 0), (1, 0), (0, 0)))
    return QuantizedPages(data, scale, kv_format)


def from_jax_tpu_quantized(pages) -> QuantizedPages:
    """Converts a pool of JAX's TPU paged attention (int8 ``QuantizedTensor``) to ours.

    JAX's ``pallas/ops/tpu/paged_attention`` takes ``QuantizedTensor(weight, scales)`` with
    ``weight [K, P, C, H]`` int8 and ``scales [K, P, C, 1]`` the absmax of each token
    (``quantization_utils.quantize_to_int8``: ``w = rint(x * 127.5 / h)``, which may store
    -128), decoded ``w * h / 127.5`` (:data:`JAX_TPU_MAX_INT8`). Ours: ``data = weight``
    (bitwise) and ``scale = h / 127.5`` in float32 (within one ulp: the float nearest the
    quotient whose product with 127.5 is nearest ``h``), so our decoded ``w * scale`` agrees
    with theirs within ``2**-22`` relative (the orders of rounding differ). Theirs -> ours ->
    theirs gives the weights back bitwise and the scales within one ulp (``2**-22``
    relative; exactly when ``h`` is some float32 times 127.5, rounded) for ``2**-118 <= h <=
    2**118``; an ``h`` below ``127.5 * 2**-126`` (about 1.5e-36) becomes 0, as our scale
    would be subnormal and XLA on CPU flushes it. Jittable.

    Args:
      pages: an object with ``weight [K, P, C, H]`` int8 and ``scales [K, P, C, 1]`` float
        (JAX's ``QuantizedTensor``), zero-based pages.

    Returns:
      :class:`paged.QuantizedPages` ``[K, P + 1, C, H]`` int8: page ``i`` at index ``i + 1``,
      a zeroed null page 0. Convert the table with :func:`paged.from_zero_based_table`.

    Raises:
      ValueError: if ``weight`` is not a rank-4 int8 array or ``scales`` not float
        ``[K, P, C, 1]``.

    Example:
      >>> from jax.experimental.pallas.ops.tpu.paged_attention import quantization_utils
      >>> t = quantization_utils.quantize_to_int8(jnp.full((1, 2, 4, 8), 2.0))
      >>> pages = from_jax_tpu_quantized(t)
      >>> pages.shape, int(pages.data[0, 1, 0, 0]), float(pages.dequantize()[0, 1, 0, 0])
      ((1, 3, 4, 8), 127, 1.992156982421875)

      (JAX's 127.5 convention: ``rint(127.5)`` saturates to 127, so 2.0 decodes to
      ``127 * 2 / 127.5``, in JAX's decoding as in ours.)
    """
    fn = "from_jax_tpu_quantized"
    if not hasattr(pages, "weight") or not hasattr(pages, "scales"):
        raise ValueError(
            f"{fn}: pages: expected a QuantizedTensor(weight, scales), got {describe(pages)}"
        )
    kv_format = _stored_format(fn, "pages.weight", pages.weight, 4)
    if kv_format.kind != "int8":
        raise ValueError(f"{fn}: pages.weight: expected dtype int8, got {describe(pages.weight)}")
    scales = pages.scales
    want = (*pages.weight.shape[:-1], 1)
    check_array(fn, "pages.scales", scales, 4, jnp.floating)
    if tuple(scales.shape) != want:
        raise ValueError(
            f"{fn}: pages.scales: expected shape {want} (weight's with H reduced to 1), got "
            f"{describe(scales)}"
        )
    scale = _divide_by_max_int8(jnp.asarray(scales, jnp.float32)[..., 0])
    return _with_null_page(pages.weight, scale, kv_format)


def _divide_by_max_int8(h):
    """``h / 127.5`` in float32, chosen among the floats within 3 ulps of it as the one whose
    product with 127.5 (what :func:`to_jax_tpu_quantized` computes) is nearest ``h`` (ties:
    the quotient). So ours -> theirs -> ours gives back ``s`` whenever no other float32 has
    the same product ``float32(s * 127.5)``: all but about 0.4% of scales (127.5 is just
    below 128, so products of neighbours in the upper part of a binade can coincide), those
    within one ulp. A plain division misses by an ulp on most scales on XLA's CPU (it
    multiplies by ``1 / 127.5``)."""
    c = np.float32(JAX_TPU_MAX_INT8)
    center = h / c
    candidates, below, above = [center], center, center
    for _ in range(3):
        below, above = jnp.nextafter(below, -jnp.inf), jnp.nextafter(above, jnp.inf)
        candidates += [below, above]
    candidates = jnp.stack(candidates)  # [7, ...], the quotient first
    # The barrier keeps XLA from simplifying (h / c) * c to h.
    products = jax.lax.optimization_barrier(candidates) * c
    # Distances of about an ulp of a tiny h are subnormal (flushed to zero on CPU): compare
    # small ones scaled by 2**64 (exact, a power of two).
    lift = jnp.where(jnp.abs(h) < 2.0**-60, np.float32(2.0**64), np.float32(1.0))
    best = jnp.argmin(jnp.abs(products * lift - h * lift), axis=0)
    chosen = jnp.take_along_axis(candidates, best[None], axis=0)[0]
    return jnp.where(jnp.isfinite(h), chosen, center)


def to_jax_tpu_quantized(pages: QuantizedPages):
    """Converts our int8 pool to JAX's TPU paged attention ``QuantizedTensor``.

    ``weight`` is our stored values bitwise (pages ``1..``; our page ``i`` is their ``i - 1``)
    and ``scales = scale * 127.5`` float32 ``[K, P, C, 1]``, so JAX's ``w * h / 127.5`` decodes
    our values within ``2**-22`` relative. Ours -> theirs -> ours gives the values back
    bitwise and the scales (``2**-118 <= s <= 2**118``) exactly for all but about 0.4% of
    them (random scales, measured in the tests), those within one ulp (``2**-22``): no float32
    ``h`` can do better, as 127.5 is just below 128 and ``s * 127.5`` rounds two neighbouring
    ``s`` in the upper part of a binade to one float32. Jittable.

    Args:
      pages: :class:`paged.QuantizedPages` ``[K, P + 1, C, H]`` int8, page 0 null.

    Returns:
      ``jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils.QuantizedTensor``
      ``(weight [K, P, C, H] int8, scales [K, P, C, 1] float32)``. Convert the table with
      :func:`to_zero_based_table`.

    Raises:
      ValueError: if ``pages`` is not an int8 :class:`paged.QuantizedPages` ``[K, P, C, H]``
        with ``P >= 2`` (fp8 has no counterpart in this convention).
      NotImplementedError: for a format other than int8 and fp8.

    Example:
      >>> from paged import KVFormat, quantize_pages
      >>> t = to_jax_tpu_quantized(quantize_pages(jnp.ones((1, 3, 4, 8)), KVFormat("int8")))
      >>> t.weight.shape, t.scales.shape, int(t.weight[0, 0, 0, 0]), float(t.scales[0, 0, 0, 0])
      ((1, 2, 4, 8), (1, 2, 4, 1), 127, 1.003937005996704)
    """
    from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import (
        QuantizedTensor,
    )

    _our_pool("to_jax_tpu_quantized", "pages", pages, kinds=("int8",))
    scales = pages.scale[:, 1:, :, None] * np.float32(JAX_TPU_MAX_INT8)
    return QuantizedTensor(weight=pages.data[:, 1:], scales=scales)


def from_jax_gpu_scale_pages(
    pages: Shaped[Array, "K P C H"], scales_pages: Shaped[Array, "K P C"]
) -> QuantizedPages:
    """Converts a pool of JAX's GPU paged attention (scale pages) to ours.

    JAX's ``pallas/ops/gpu/paged_attention.paged_attention(q, k_pages, v_pages, block_tables,
    lengths, k_scales_pages, v_scales_pages)`` stores ``[K, P, C, H]`` values and one scale per
    token per kv head ``[K, P, C]``: it multiplies the logits by the key scales and the
    probabilities by the value scales, which is decoding ``w * s`` (ours) up to float32
    rounding. Values and float32 scales convert bitwise (other float scales are cast to
    float32). Jittable.

    Args:
      pages: ``[K, P, C, H]`` int8 or float8_e4m3fn, zero-based pages.
      scales_pages: ``[K, P, C]`` float scales.

    Returns:
      :class:`paged.QuantizedPages` ``[K, P + 1, C, H]`` (format from the dtype): page ``i``
      at index ``i + 1``, a zeroed null page 0. Convert the table with
      :func:`paged.from_zero_based_table`.

    Raises:
      ValueError: if ``pages`` is not a rank-4 int8 / float8_e4m3fn array or
        ``scales_pages`` not float of shape ``pages.shape[:-1]``.

    Example:
      >>> pages = from_jax_gpu_scale_pages(jnp.ones((1, 2, 4, 8), jnp.int8),
      ...                                  jnp.full((1, 2, 4), 0.25))
      >>> pages.format.kind, pages.shape, float(pages.dequantize()[0, 1, 0, 0])
      ('int8', (1, 3, 4, 8), 0.25)
    """
    fn = "from_jax_gpu_scale_pages"
    kv_format = _stored_format(fn, "pages", pages, 4)
    check_array(fn, "scales_pages", scales_pages, 3, jnp.floating)
    if tuple(scales_pages.shape) != tuple(pages.shape[:-1]):
        raise ValueError(
            f"{fn}: scales_pages: expected shape {tuple(pages.shape[:-1])} (pages' without H), "
            f"got {describe(scales_pages)}"
        )
    return _with_null_page(pages, scales_pages, kv_format)


def to_jax_gpu_scale_pages(pages: QuantizedPages) -> JaxScalePages:
    """Converts our pool to JAX's GPU paged attention convention (values and scale pages).

    Pages ``1..`` of our data and scales, bitwise (our page ``i`` is their ``i - 1``): exact
    both ways. Pass ``k_pages, v_pages`` and ``k_scales_pages, v_scales_pages`` from two
    calls. Jittable.

    Args:
      pages: :class:`paged.QuantizedPages` ``[K, P + 1, C, H]``, int8 or fp8, page 0 null.

    Returns:
      :class:`JaxScalePages` ``(pages [K, P, C, H] in the storage dtype, scales_pages
      [K, P, C] float32)``. Convert the table with :func:`to_zero_based_table`.

    Raises:
      ValueError: if ``pages`` is not a :class:`paged.QuantizedPages` ``[K, P, C, H]`` with
        ``P >= 2``.
      NotImplementedError: for a format other than int8 and fp8.

    Example:
      >>> from paged import KVFormat, quantize_pages
      >>> out = to_jax_gpu_scale_pages(quantize_pages(jnp.ones((1, 3, 4, 8)), KVFormat("fp8")))
      >>> out.pages.shape, out.scales_pages.shape
      ((1, 2, 4, 8), (1, 2, 4))
    """
    _our_pool("to_jax_gpu_scale_pages", "pages", pages)
    return JaxScalePages(pages.data[:, 1:], pages.scale[:, 1:])


def to_zero_based_table(page_table: Int[Array | np.ndarray, "B M"]) -> Int[Array, "B M"]:
    """Converts our page table (page 0 null) to a zero-based one (JAX's, vLLM's).

    The inverse of :func:`paged.from_zero_based_table` on real pages: ``page_table - 1`` for
    pools whose page 0 was dropped (the ``to_jax_*`` conversions drop it). Our null entries
    (unused slots, 0) become page 0, an ordinary page there: JAX's kernels mask it by length,
    as they do every slot past a sequence's length. Ids are assumed valid
    (:func:`paged.validate_page_table`); a negative one also maps to 0. Jittable.

    Args:
      page_table: ``[B, M]`` int page ids with the null page at 0.

    Returns:
      ``[B, M]`` int32 zero-based ids, ``max(page_table - 1, 0)``.

    Raises:
      ValueError: if ``page_table`` is not a 2-D int array.

    Example:
      >>> to_zero_based_table(np.array([[1, 3], [2, 0]])).tolist()
      [[0, 2], [1, 0]]
    """
    check_array("to_zero_based_table", "page_table", page_table, 2, jnp.integer)
    return jnp.maximum(jnp.asarray(page_table, jnp.int32) - 1, 0)
