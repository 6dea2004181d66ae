"""Quantized KV pages: int8, fp8 (``float8_e4m3fn``) and int4, with absmax scales.

A quantized pool is a :class:`QuantizedPages` ``(data, scale, format)``. It stands for a float
pool of shape ``[*lead, C, H]`` (``[L, K, P, C, H]`` for a cache, ``[K, P, C, H]`` for one
layer), which :attr:`QuantizedPages.shape` keeps reporting; the leaves depend on the kind:

========  ==========================  ==========================  =====================
kind      ``data``                    ``scale``                   scale per
========  ==========================  ==========================  =====================
int8      ``[*lead, C, H]`` int8      ``[*lead, C]`` float32      token, kv head
fp8       ``[*lead, C, H]`` e4m3fn    ``[*lead, C]`` float32      token, kv head
int4      ``[*lead, C, H // 2]`` u8   ``[*lead, C, H // g]`` bf16  group of ``g`` along H
========  ==========================  ==========================  =====================

A scale page sits beside its value page (same page id, so the null page 0 and the page table
are shared).

The format is a :class:`ringattn.KVFormat` (``paged.KVFormat`` is the same class), and each
kind's bits are its codec, :meth:`KVFormat.encode` / :meth:`KVFormat.decode`: the one ring hops
use too, so a page and a ring hop store the same token as the same bytes. The rules, their
edge cases (all-zero, sub-normal and NaN / inf tokens) and their error bounds are in
``ringattn._formats`` and the docs' "Quantized KV" page; ``tests/paged/test_codec_docs.py``
checks the stored bits against those words rewritten in numpy. kivi2's codec (per channel
over a page for keys) is :mod:`paged._kivi_codec`, its window :mod:`paged._kivi`.

A token (int4: a group) holding NaN or inf decodes to NaN, so it propagates to the rows that
see it, as a NaN does in a float pool; :func:`paged.validate` rejects such a token in a
readable slot loudly. Slots no query may see are removed by a select in every path, NaN
scales included.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from paged import _kivi_codec
from ringattn import KVFormat

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


@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """A quantized page pool: stored values, their scales and the format.

    A pytree (``data`` and ``scale`` are leaves, ``format`` is static), so it passes through
    ``jit``, ``vmap``, ``shard_map`` (a ``PartitionSpec`` of the page axis applies to both
    leaves) and ``lax`` loops. It stands where a float pool stands: ``cache.k_pages[layer]``
    is the layer's quantized pool, and :func:`paged.paged_attention` and its siblings take it
    in place of a float pool.

    Attributes:
      data: ``format.data_shape([*lead, C, H])`` values in ``format.storage_dtype``:
        ``[*lead, C, H]`` for int8 / fp8, ``[*lead, C, H // 2]`` uint8 for int4.
      scale: ``format.scale_shape(...)`` in ``format.scale_dtype``: ``[*lead, C]`` float32
        per-token scales for int8 / fp8, ``[*lead, C, H // group_size]`` bfloat16 for int4.
      format: the :class:`KVFormat`.

    ``shape`` is the float pool's ``[*lead, C, H]`` (for every kind) and ``ndim`` its rank;
    ``dtype`` is the storage dtype, while every read decodes to float32; ``nbytes`` counts
    data and scales. Indexing (``pages[l]``, ``pages[:, :, ids]``, ``pages[None]``) applies to
    the axes before ``C`` only, to data and scales alike.

    Example:
      >>> pages = quantize_pages(jnp.ones((1, 2, 4, 8)), KVFormat("int8"))
      >>> pages.shape, pages.dtype, pages.nbytes, float(pages.dequantize()[0, 0, 0, 0])
      ((1, 2, 4, 8), dtype('int8'), 96, 1.0)
      >>> pages = quantize_pages(jnp.ones((1, 2, 4, 8)), KVFormat("int4", group_size=4))
      >>> pages.shape, pages.data.shape, pages.scale.shape, pages.nbytes
      ((1, 2, 4, 8), (1, 2, 4, 4), (1, 2, 4, 2), 64)
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
        return self.format.float_shape(self.data.shape)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the stored pages: data, scales and zero-points (not a kivi2 residual)."""
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
        # The residual ([*lead, B, W * C, H]) follows an index of the axes before the page axis
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

    def __iter__(self):  # over the leading axis (its layers, for a stacked pool)
        return (self[i] for i in range(self.data.shape[0]))

    def __len__(self) -> int:
        return self.data.shape[0]

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The decoded stored pages ``[*lead, C, H]`` (a full copy: for tests and export;
        without a kivi2 pool's residual pages, which :func:`paged.gather_kv` applies)."""
        return decode_pages(self).astype(dtype)


jax.tree_util.register_dataclass(
    QuantizedPages,
    data_fields=["data", "scale", "zero", "residual", "residual_len"],
    meta_fields=["format", "grouping"],
)


def decode_pages(pool: "QuantizedPages"):
    """All stored values of ``pool`` decoded to float32 ``[..., C, H]``."""
    if pool.format.kind == "kivi2":
        return _kivi_codec.decode(pool.data, pool.scale, pool.zero, pool.grouping)
    return dequantize_block(pool.data, pool.scale, pool.format)


def is_quantized(x) -> bool:
    """Whether ``x`` is a :class:`QuantizedPages`."""
    return isinstance(x, QuantizedPages)


def quantize_values(x, kv_format: KVFormat):
    """``(data, scale)`` of float ``x [..., H]``: ``kv_format.encode`` (the shared codec)."""
    return kv_format.encode(jnp.asarray(x))


def dequantize_block(data, scale, kv_format: KVFormat):
    """The float32 ``[..., H]`` values that ``data`` and ``scale`` of ``kv_format`` encode."""
    return kv_format.decode(data, scale)


def quantize_pages(
    x: Float[Array, "*D C H"], kv_format: KVFormat, *, role: str | None = None
) -> QuantizedPages:
    """Quantizes a float pool (or any ``[..., C, H]`` array) into :class:`QuantizedPages`.

    Each ``[H]`` vector (one token of one kv head; for int4 each group of ``group_size`` of
    its values) gets its own absmax scale. Jittable with the format static.

    kivi2: every ``[C, H]`` page is stored whole (keys per channel over the page, values per
    token), with no residual: every page of a pool quantized here is stored.

    Args:
      x: ``[*D, C, H]`` float values, e.g. a pool ``[K, P, C, H]``; rank >= 2 (kivi2: >= 3).
      kv_format: a :class:`KVFormat`.
      role: kivi2 only, and required there: ``"keys"`` or ``"values"``.

    Returns:
      :class:`QuantizedPages` of ``shape`` ``x.shape`` (``data`` and ``scale`` shaped by
      ``kv_format.data_shape`` / ``scale_shape``).

    Raises:
      ValueError: if ``x`` is not a float array of rank >= 2, ``kv_format`` not a
        :class:`KVFormat`, or (int4) ``H`` not a multiple of ``group_size``.

    Example:
      >>> pages = quantize_pages(jnp.array([[[0.5, -1.0]]]), KVFormat("int8"))
      >>> pages.data.tolist(), pages.scale.tolist()
      ([[[64, -127]]], [[0.007874015718698502]])
      >>> pages = quantize_pages(jnp.array([[[3.0, -7.0]]]), KVFormat("int4", group_size=2))
      >>> pages.data.tolist(), pages.dequantize().tolist()  # levels 3, -7: 0x3 | 0x9 << 4
      ([[[147]]], [[[3.0, -7.0]]])
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
    kv_format.check_head_dim(fn, "x", x.shape[-1])
    if kv_format.kind == "kivi2":
        if role not in ("keys", "values"):
            raise ValueError(f"{fn}: role: kivi2 needs role='keys' or 'values', got {role!r}")
        if x.ndim < 3:
            raise ValueError(f"{fn}: x: kivi2 needs [..., P, C, H], got shape {tuple(x.shape)}")
        grouping = "channel" if role == "keys" else "token"
        data, scale, zero = _kivi_codec.encode(x, grouping)
        return QuantizedPages(data, scale, kv_format, zero=zero, grouping=grouping)
    if role is not None:
        raise ValueError(f"{fn}: role: only kivi2 takes a role, got {role!r}")
    data, scale = quantize_values(x, kv_format)
    return QuantizedPages(data, scale, kv_format)


def set_tokens(pool, index, values):
    """``pool.at[index].set(values, mode="drop")``; a quantized pool quantizes ``values``.

    ``index`` must select whole ``[H]`` vectors (it stops before the ``H`` axis), so the same
    index applies to the data (``values [..., H]``) and to the scales (``[...]``, or
    ``[..., H / g]`` for int4: the index stops before the group axis alike).
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

    A kivi2 pool keeps one residual window per sequence row of its cache; attention over the
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
