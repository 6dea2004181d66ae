"""Quantized KV pages: int8 and fp8 (``float8_e4m3fn``) with per-token, per-kv-head scales.

A quantized pool is a :class:`QuantizedPages` ``(data, scale, format)``: ``data`` has the float
pool's shape (``[L, K, P, C, H]`` for a cache, ``[K, P, C, H]`` for one layer) in the storage
dtype of :class:`KVFormat`, and ``scale`` the same shape without ``H``, float32. A scale page
sits beside its value page (same page id, so the null page 0 and the page table are shared).

Semantics (one token of one kv head, ``x [H]`` in float32):

* ``absmax = max(|x|)``, ``scale = absmax / QMAX`` (``QMAX = 127`` for int8, 448 for fp8);
* ``data = round(x / scale)``: round half to even and clip to ``[-127, 127]`` for
  int8; a cast to ``float8_e4m3fn`` (round to nearest even) for fp8;
* decoding is ``data.astype(float32) * scale``, always float32;
* an all-zero token gets ``scale = 0`` and ``data = 0`` and decodes to exact zeros;
* a token holding NaN or inf in any of its ``H`` values gets ``scale = NaN`` and ``data = 0``:
  it decodes to NaN everywhere (inf is not representable), so it propagates to the rows that
  see it, as a NaN does in a float pool. :func:`paged.validate` rejects such a token in a
  readable slot loudly. Slots no query may see are removed by a select in every path, NaN
  scales included.

Bound per element: int8 ``|x - x'| <= absmax / 254``; fp8 ``|x - x'| <= |x| / 16 +
absmax / 448 * 2**-10`` (3 mantissa bits; the second term covers e4m3's subnormals), plus
float32 rounding of the scale and the product. A token whose scale would be below float32's
smallest normal (``absmax < QMAX * 2**-126``, about 1.5e-36 for int8) stores zeros, since XLA
on CPU flushes subnormals: its error is below that.

Bytes per token per kv head: ``H * itemsize + 4`` (one float32 scale), for keys and for values.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from paged import _kivi

__all__ = [
    "KVFormat",
    "QuantizedPages",
    "dequantize_block",
    "is_quantized",
    "quantize_pages",
    "quantize_values",
    "select_rows",
    "set_tokens",
    "take_decoded",
]

# kind -> (storage dtype, largest magnitude a quantized value takes).
_FORMATS = {
    "int8": (jnp.int8, 127.0),
    "fp8": (jnp.float8_e4m3fn, 448.0),
    "kivi2": (jnp.uint8, 3.0),
}
_PLANNED = ("int4",)
# Codes per stored byte along H.
_PACK = {"kivi2": 4}


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """How KV pages are stored: a frozen, hashable config (a static ``jit`` argument).

    Attributes:
      kind: ``"int8"`` (symmetric, 127 levels each side) or ``"fp8"`` (``float8_e4m3fn``).
        Both use one float32 absmax scale per token per kv head. ``"int4"`` and ``"kivi2"``
        are planned and raise ``NotImplementedError`` for now.

    Raises:
      ValueError: if ``kind`` is not a known format name.
      NotImplementedError: for a planned but not yet supported kind.

    Example:
      >>> KVFormat("int8").storage_dtype, KVFormat("fp8").qmax
      (dtype('int8'), 448.0)
    """

    kind: str

    def __post_init__(self):
        if not isinstance(self.kind, str):
            raise ValueError(
                f"KVFormat: kind: expected one of {sorted(_FORMATS)}, got {self.kind!r}"
            )
        if self.kind in _PLANNED:
            raise NotImplementedError(
                f"KVFormat: kind: {self.kind!r} is not yet supported (supported: "
                f"{sorted(_FORMATS)})"
            )
        if self.kind not in _FORMATS:
            raise ValueError(
                f"KVFormat: kind: expected one of {sorted(_FORMATS)}, got {self.kind!r}"
            )

    @property
    def storage_dtype(self) -> np.dtype:
        """The dtype of ``QuantizedPages.data``."""
        return jnp.dtype(_FORMATS[self.kind][0])

    @property
    def qmax(self) -> float:
        """Largest magnitude of a stored value: ``scale = absmax / qmax``."""
        return _FORMATS[self.kind][1]

    @property
    def codes_per_byte(self) -> int:
        """Stored values per byte of ``data`` along ``H`` (4 for ``kivi2``, else 1)."""
        return _PACK.get(self.kind, 1)

    def bytes_per_token(self, head_dim: int, page_size: int | None = None) -> int | float:
        """Bytes one token takes per kv head, keys and values averaged.

        int8 / fp8: ``H * itemsize + 4`` (one float32 scale). kivi2: keys ``H / 4 + 4 H / C``
        (a bfloat16 scale and zero per channel per page of ``C = page_size`` tokens), values
        ``H / 4 + 4`` (a bfloat16 pair per token), averaged; the residual page per sequence
        is not per token and is not counted.
        """
        H = int(head_dim)
        if self.kind == "kivi2":
            if page_size is None:
                raise ValueError("KVFormat.bytes_per_token: kivi2 needs page_size")
            return (H / 4 + 4 * H / int(page_size) + H / 4 + 4) / 2
        return H * self.storage_dtype.itemsize + 4


@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """A quantized page pool: stored values, their float32 scales and the format.

    A pytree (``data`` and ``scale`` are leaves, ``format`` is static), so it passes through
    ``jit``, ``vmap``, ``shard_map`` (a ``PartitionSpec`` of the page axis applies to both
    leaves) and ``lax`` loops. It stands where a float pool stands: ``cache.k_pages[layer]``
    is the layer's quantized pool, and :func:`paged.paged_attention` and its siblings take it
    in place of a float pool.

    Attributes:
      data: ``[*lead, C, H]`` (``[L, K, P, C, H]`` or ``[K, P, C, H]``) values in
        ``format.storage_dtype``.
      scale: ``[*lead, C]`` float32 per-token, per-kv-head scales (``absmax / qmax``).
      format: the :class:`KVFormat`.

    ``shape`` and ``ndim`` are those of ``data`` (the float pool's); ``dtype`` is the storage
    dtype (``int8`` / ``float8_e4m3fn``), while every read decodes to float32; ``nbytes``
    counts data and scales. Indexing (``pages[l]``, ``pages[:, :, ids]``, ``pages[None]``)
    applies to the axes before ``C`` only, to data and scales alike.

    Example:
      >>> pages = quantize_pages(jnp.ones((1, 2, 4, 8)), KVFormat("int8"))
      >>> pages.shape, pages.dtype, pages.nbytes, float(pages.dequantize()[0, 0, 0, 0])
      ((1, 2, 4, 8), dtype('int8'), 96, 1.0)
    """

    data: Any
    scale: Any
    format: KVFormat
    zero: Any = None
    residual: Any = None
    residual_len: Any = None
    grouping: str = "token"

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.data.shape)
        return (*shape[:-1], shape[-1] * self.format.codes_per_byte)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the stored pages: data, scales and zero-points (not the residual)."""
        zero = 0 if self.zero is None else int(self.zero.nbytes)
        return int(self.data.nbytes) + int(self.scale.nbytes) + zero

    def __getitem__(self, index) -> "QuantizedPages":
        index = index if isinstance(index, tuple) else (index,)
        used = sum(i is not None for i in index)  # None adds an axis, in front of C alike
        if any(i is Ellipsis for i in index) or used > self.data.ndim - 2:
            raise IndexError(
                f"QuantizedPages: index: expected indices of the axes before C (at most "
                f"{self.data.ndim - 2}, no Ellipsis), got {index!r}"
            )
        zero = None if self.zero is None else self.zero[index]
        # The residual ([*lead, B, C, H]) follows an index of the axes before the page axis
        # only; a selection of pages carries no residual.
        residual = residual_len = None
        if self.residual is not None and used <= self.data.ndim - 3:
            residual, residual_len = self.residual[index], self.residual_len[index]
        return QuantizedPages(
            self.data[index],
            self.scale[index],
            self.format,
            zero,
            residual,
            residual_len,
            self.grouping,
        )

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The decoded stored pages (a full copy: for tests and export; without the
        residual of a kivi2 pool, which :func:`paged.gather_kv` applies)."""
        return decode_pages(self).astype(dtype)


jax.tree_util.register_dataclass(
    QuantizedPages,
    data_fields=["data", "scale", "zero", "residual", "residual_len"],
    meta_fields=["format", "grouping"],
)


def decode_pages(pool: QuantizedPages):
    """All stored values of ``pool`` decoded to float32 ``[..., C, H]``."""
    if pool.format.kind == "kivi2":
        return _kivi.decode(pool.data, pool.scale, pool.zero, pool.grouping)
    return dequantize_block(pool.data, pool.scale)


def is_quantized(x) -> bool:
    """Whether ``x`` is a :class:`QuantizedPages`."""
    return isinstance(x, QuantizedPages)


def quantize_values(x, kv_format: KVFormat):
    """``data [..., H]`` in the storage dtype and ``scale [...]`` float32 (see module docs)."""
    x = jnp.asarray(x).astype(jnp.float32)
    qmax = kv_format.qmax
    absmax = jnp.max(jnp.abs(x), axis=-1)
    finite = jnp.isfinite(absmax)
    scale = jnp.where(finite, absmax / qmax, jnp.nan)
    keep = finite & (scale > 0)  # zero tokens (and scales flushed to zero) store zeros
    # Divide by the scale, not by absmax: XLA computes x / y as x * (1 / y), and 1 / absmax
    # is subnormal (flushed to zero on CPU) for absmax > 2**126, while 1 / scale is not.
    scaled = x / jnp.where(keep, scale, 1.0)[..., None]
    scaled = jnp.clip(scaled, -qmax, qmax)
    if kv_format.kind == "int8":
        scaled = jnp.round(scaled)
    data = jnp.where(keep[..., None], scaled, 0.0).astype(kv_format.storage_dtype)
    return data, scale


def dequantize_block(data, scale):
    """``data [..., H] * scale [...]`` in float32."""
    return data.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


def quantize_pages(
    x: Float[Array, "*D C H"], kv_format: KVFormat, *, role: str | None = None
) -> QuantizedPages:
    """Quantizes a float pool (or any ``[..., C, H]`` array) into :class:`QuantizedPages`.

    int8 / fp8: each ``[H]`` vector (one token of one kv head) gets its own absmax scale.
    kivi2: every ``[C, H]`` page is stored whole (keys per channel, values per token; no
    residual: a pool quantized here has every page stored). Jittable with the format static.

    Args:
      x: ``[*D, C, H]`` float values, e.g. a pool ``[K, P, C, H]``; rank >= 2 (kivi2: rank
        >= 3 and ``H`` a multiple of 4).
      kv_format: a :class:`KVFormat`.
      role: kivi2 only (required there): ``"keys"`` (per channel over each page) or
        ``"values"`` (per token).

    Returns:
      :class:`QuantizedPages` with ``data`` of ``x``'s shape and ``scale [*D, C]``.

    Raises:
      ValueError: if ``x`` is not a float array of rank >= 2 or ``kv_format`` not a
        :class:`KVFormat`.

    Example:
      >>> pages = quantize_pages(jnp.array([[[0.5, -1.0]]]), KVFormat("int8"))
      >>> pages.data.tolist(), pages.scale.tolist()
      ([[[64, -127]]], [[0.007874015718698502]])
    """
    fn = "quantize_pages"
    if not isinstance(kv_format, KVFormat):
        raise ValueError(f"{fn}: kv_format: expected a paged.KVFormat, got {kv_format!r}")
    if (
        not hasattr(x, "shape")
        or not hasattr(x, "dtype")
        or x.ndim < 2
        or not jnp.issubdtype(x.dtype, jnp.floating)
    ):
        got = f"shape {tuple(x.shape)} dtype {x.dtype}" if hasattr(x, "dtype") else repr(x)
        raise ValueError(f"{fn}: x: expected a float array [..., C, H], got {got}")
    if kv_format.kind == "kivi2":
        if role not in ("keys", "values"):
            raise ValueError(f"{fn}: role: kivi2 needs role='keys' or 'values', got {role!r}")
        if x.ndim < 3 or x.shape[-1] % 4:
            raise ValueError(
                f"{fn}: x: kivi2 needs [..., P, C, H] with H a multiple of 4, got shape "
                f"{tuple(x.shape)}"
            )
        grouping = "channel" if role == "keys" else "token"
        data, scale, zero = _kivi.encode(x, grouping)
        return QuantizedPages(data, scale, kv_format, zero=zero, grouping=grouping)
    if role is not None:
        raise ValueError(f"{fn}: role: only kivi2 takes a role, got {role!r}")
    data, scale = quantize_values(x, kv_format)
    return QuantizedPages(data, scale, kv_format)


def set_tokens(pool, index, values):
    """``pool.at[index].set(values, mode="drop")``; a quantized pool quantizes ``values``.

    ``index`` must select whole ``[H]`` vectors (it stops before the ``H`` axis), so the same
    index applies to the data (``values [..., H]``) and to the scales (``[...]``).
    """
    if is_quantized(pool):
        if pool.format.kind == "kivi2":
            raise ValueError("set_tokens: a kivi2 pool is written through paged.write only")
        data, scale = quantize_values(values, pool.format)
        return QuantizedPages(
            pool.data.at[index].set(data, mode="drop"),
            pool.scale.at[index].set(scale, mode="drop"),
            pool.format,
        )
    return pool.at[index].set(values.astype(pool.dtype), mode="drop")


def take_decoded(pool, index):
    """``pool[index]``, decoded to float32 if quantized (``index`` stops before ``C``)."""
    if is_quantized(pool):
        return decode_pages(pool[index])
    return pool[index]


def select_rows(pool, rows):
    """``pool`` as a batch of sequences ``rows`` of its cache reads it.

    A kivi2 pool keeps one residual page per sequence row of its cache; attention over the
    pool takes them row for row with the page table. A caller whose page table lists the
    cache's sequences in another order, or repeats them (one query per row, say), narrows
    the residual with this first. Any other pool is returned as it is. Jittable.

    Args:
      pool: a float pool or :class:`QuantizedPages` (``[*lead, P, C, H]``).
      rows: ``[B']`` int rows of the cache, each in ``[0, B)``.

    Returns:
      The pool with ``residual [*lead, B', C, H]`` and ``residual_len [*lead, B']``.

    Raises:
      ValueError: if ``rows`` is not a 1-d int array.

    Example:
      >>> import paged
      >>> cache = paged.init_paged_cache(1, 1, 4, 4, 8, batch=2, max_pages_per_seq=2,
      ...                                kv_format=KVFormat("kivi2"))
      >>> select_rows(cache.k_pages[0], jnp.array([1, 1, 0])).residual.shape
      (1, 3, 4, 8)
    """
    rows = jnp.asarray(rows)
    if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"select_rows: rows: expected [B'] ints, got {rows.shape} {rows.dtype}")
    if getattr(pool, "residual", None) is None:
        return pool
    residual = jnp.take(pool.residual, rows, axis=pool.residual.ndim - 3)
    filled = jnp.take(pool.residual_len, rows, axis=pool.residual_len.ndim - 1)
    return dataclasses.replace(pool, residual=residual, residual_len=filled)
