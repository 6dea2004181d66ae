"""KV formats: the one vocabulary and the one codec per format, for ring hops and KV pages.

:class:`KVFormat` names how keys and values are stored or sent: ``"int8"`` and ``"fp8"``
(``float8_e4m3fn``) with one float32 absmax scale per token and kv head, ``"int4"`` with a
bfloat16 scale per group of ``group_size`` values along ``H``, and ``"kivi2"`` (KIVI-style
2-bit pages, written through ``paged.write``). Ring hops (``hop_format=`` of
:func:`ringattn.ring_attention_per_shard` and :func:`ringattn.sharded_attention`), the paged
cache (``paged.KVFormat`` is this very class), offload's tiers and the planner take it. The
encoding of each format is :meth:`KVFormat.encode` and its decoding :meth:`KVFormat.decode`:
a ring hop and a page quantize the same token to the same bytes.

Semantics of int8 / fp8 (one token of one kv head, ``x [H]`` in float32; every step is a
float32 operation rounded to nearest even, in this order, and ``tests/paged/test_codec_docs.py``
checks the stored bits against these words rewritten in numpy):

* ``absmax = max(|x|)``, ``scale = absmax * r`` with ``r = float32(1 / QMAX)`` (``QMAX = 127``
  for int8, 448 for fp8; a multiplication, as XLA compiles a division by a constant);
* ``y = clip(x * float32(1 / scale), -QMAX, QMAX)``: the reciprocal first, then the product
  (not ``x / scale``, which differs in about one element in 10^5);
* ``data = round(y)`` half to even, as int8; or ``y`` cast to ``float8_e4m3fn`` (round to
  nearest even, as ``ml_dtypes`` casts) for fp8;
* decoding is ``data.astype(float32) * scale``, always float32.

Semantics of int4 (``KVFormat("int4", group_size=g)``, default ``g = 32``): each token's ``[H]``
vector is cut into ``H // g`` groups of ``g`` consecutive values; per group,

* ``scale = bfloat16(absmax * float32(1 / 7))``, rounded to the nearest bfloat16 (8
  significant bits, ties to even);
* ``q = clip(round(x * float32(1 / float32(scale))), -7, 7)``, round half to even, then the
  symmetric clip (``x / scale`` stays below ``7 * (1 + 2**-8)``, so the clip costs at most
  ``absmax * 2**-8``); ``-8`` is never written (a stored ``-8`` nibble, e.g. garbage, decodes
  to ``-8 * scale``);
* two levels per byte along ``H``: value ``2i`` in the low nibble of byte ``i``, value
  ``2i + 1`` in the high nibble, each as 4-bit two's complement (``data`` uint8);
* decoding is ``q.astype(float32) * scale.astype(float32)``, one group at a time.

``H`` must be a multiple of ``g`` (so even); :meth:`KVFormat.check_head_dim` says so.

int8 / fp8 / int4: an all-zero token (group) gets ``scale = 0`` and ``data = 0`` and decodes
to exact zeros; so does one whose float32 scale ``absmax * r`` is below ``2**-126`` (float32's
smallest normal), on every backend (XLA on CPU flushes subnormals). A token (int4: a group)
holding NaN or inf gets ``scale = NaN`` and ``data = 0``: it decodes to NaN across its whole
row (inf is not representable), at any array size (the NaN comes from a count of non-finite
values: XLA:CPU's max reduction drops NaN past about 4,096 values).

Bound per element: int8 ``|x - x'| <= absmax / 254``; fp8 ``|x - x'| <= |x| / 16 +
absmax / 448 * 2**-10`` (3 mantissa bits; the second term covers e4m3's subnormals); int4
``|x - x'| <= group_absmax / 14 * (1 + 2**-8)`` (half a level; the factor is the bfloat16
rounding of the scale), so a constant token does not decode exactly (``1.0`` comes back as
``0.998``), unlike int8 / fp8. Plus float32 rounding of the scale and the product.

Bytes per token per kv head, for keys and for values: int8 / fp8 ``H + 4`` (one float32
scale); int4 ``H / 2 + 2 * H / g`` (bfloat16 scales): 72 at ``H = 128, g = 32``, 0.281 of
bfloat16's 256.
"""

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Shaped

from ringattn._checks import describe, fail

__all__ = ["KVFormat"]

_TINY = 2.0**-126  # float32's smallest normal: smaller scales are flushed, the token stores 0


def reciprocal(q: float):
    """``float32(1 / q)``, correctly rounded: the factor the documented rules multiply by."""
    return np.float32(1.0) / np.float32(q)


def _absmax_scale(x, qmax, axis=-1):
    """``(scale, keep)`` of float32 ``x``: ``absmax / qmax`` along ``axis`` (NaN where the
    vector holds NaN / inf) and whether the vector stores non-zero levels. The NaN comes from
    a count of non-finite values: XLA:CPU's max reduction drops NaN in larger arrays."""
    absmax = jnp.max(jnp.abs(x), axis=axis)
    nonfinite = jnp.sum(~jnp.isfinite(x), axis=axis, dtype=jnp.int32) > 0
    finite = ~nonfinite & jnp.isfinite(absmax)
    # The documented rule, spelled as it runs: XLA rewrites a division by a constant into a
    # multiplication by its float32 reciprocal, so say so here.
    scale = jnp.where(finite, absmax * reciprocal(qmax), jnp.nan)
    keep = finite & (scale >= _TINY)
    # Below float32's smallest normal the scale is 0 on every backend (XLA:CPU flushes it).
    return jnp.where(finite & ~keep, 0.0, scale), keep


class _PerTokenCodec:
    """int8 / fp8: one float32 absmax scale per ``[H]`` vector, ``data`` of ``x``'s shape."""

    codes_per_byte = 1

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
    codes_per_byte = 2

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


class _Kivi2Layout:
    """kivi2's shapes and bytes (its codec, per channel over a page for keys, lives with the
    paged cache: ``paged.quantize_pages(x, KVFormat("kivi2"), role=...)``)."""

    storage_dtype = jnp.dtype(jnp.uint8)
    scale_dtype = jnp.dtype(jnp.bfloat16)
    qmax = 3.0
    codes_per_byte = 4

    def data_shape(self, shape, group_size):
        return (*shape[:-1], shape[-1] // 4)

    def scale_shape(self, shape, group_size, grouping="token"):
        return (*shape[:-2], shape[-1]) if grouping == "channel" else tuple(shape[:-1])

    def float_shape(self, data_shape, group_size):
        return (*data_shape[:-1], 4 * data_shape[-1])

    def bytes_per_token(self, H, group_size, page_size):
        return (H / 4 + 4 * H / page_size + H / 4 + 4) / 2


_CODECS = {
    "int8": _PerTokenCodec(jnp.int8, 127.0, rounds=True),
    "fp8": _PerTokenCodec(jnp.float8_e4m3fn, 448.0, rounds=False),
    "int4": _Int4Codec(),
    "kivi2": _Kivi2Layout(),
}
_GROUPED = ("int4",)  # kinds that read group_size
_DEFAULT_GROUP = 32


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """How keys and values are stored in pages or sent in ring hops: a frozen, hashable
    config (a static ``jit`` argument). ``ringattn.KVFormat`` and ``paged.KVFormat`` are the
    same class; ring hops take the per-token kinds (``hop_format=KVFormat("int8")``).

    Attributes:
      kind: ``"int8"`` (symmetric, 127 levels each side) or ``"fp8"`` (``float8_e4m3fn``),
        both with one float32 absmax scale per token per kv head; or ``"int4"`` (symmetric
        levels -7..7, two per byte, one bfloat16 absmax scale per group of ``group_size``
        values along ``H``); or ``"kivi2"`` (KIVI-style 2-bit: keys per channel over each page,
        values per token, bfloat16 scale and zero-point, the most recent tokens of each
        sequence in float32; written through ``paged.write``).
      group_size: int4's group along ``H`` (a positive even int, default 32; ``H`` must be a
        multiple of it). The other kinds have no groups and require the default (so that
        equal formats compare equal).
      residual: kivi2's full-precision window, in tokens (a non-negative int, default 0):
        reads take the most recent ``residual`` tokens of each sequence, rounded up to whole
        pages, plus the page that is still filling, from a float32 window of
        ``residual_pages(C) = ceil(residual / C) + 1`` pages per sequence (so at least
        ``residual`` and fewer than ``residual + C`` tokens are exact). ``0``: the open page
        only. Other kinds require 0.

    Raises:
      ValueError: if ``kind`` is not a known format name, ``group_size`` is not a positive
        even int (or differs from the default for a kind without groups), or ``residual`` is
        not a non-negative int (or is set for a kind other than kivi2).

    Example:
      >>> KVFormat("int8").storage_dtype, KVFormat("fp8").qmax, KVFormat("int4").scale_dtype
      (dtype('int8'), 448.0, dtype(bfloat16))
      >>> KVFormat("int4").bytes_per_token(128), KVFormat("int8").bytes_per_token(128)
      (72, 132)
      >>> KVFormat("kivi2", residual=128).residual_pages(16), KVFormat("kivi2").tag
      (9, 'kivi2')
    """

    #: Every format name, in the order the docs list them.
    KINDS: ClassVar[tuple[str, ...]] = ("int8", "fp8", "int4", "kivi2")

    kind: str
    group_size: int = _DEFAULT_GROUP
    residual: int = 0

    def __post_init__(self):
        known = sorted(_CODECS)
        if not isinstance(self.kind, str) or self.kind not in _CODECS:
            raise ValueError(f"KVFormat: kind: expected one of {known}, got {self.kind!r}")
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g <= 0 or g % 2:
            raise ValueError(f"KVFormat: group_size: expected a positive even int, got {g!r}")
        if self.kind not in _GROUPED and g != _DEFAULT_GROUP:
            raise ValueError(
                f"KVFormat: group_size: {self.kind!r} has one scale per token (no groups): "
                f"leave group_size at its default {_DEFAULT_GROUP}, got {g!r}"
            )
        object.__setattr__(self, "group_size", int(g))
        r = self.residual
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
            raise ValueError(f"KVFormat: residual: expected a non-negative int, got {r!r}")
        if self.kind != "kivi2" and r != 0:
            raise ValueError(
                f"KVFormat: residual: only kivi2 keeps a full-precision window: leave residual "
                f"at 0 for {self.kind!r}, got {r!r}"
            )
        object.__setattr__(self, "residual", int(r))

    def residual_pages(self, page_size: int) -> int:
        """kivi2: pages of the float32 window per sequence, ``ceil(residual / C) + 1`` (the
        open page and the most recent full pages); 0 for the other kinds."""
        if self.kind != "kivi2":
            return 0
        C = int(page_size)
        return -(-self.residual // C) + 1

    @property
    def _codec(self):
        return _CODECS[self.kind]

    @property
    def storage_dtype(self) -> np.dtype:
        """The dtype of ``QuantizedPages.data`` (int8, float8_e4m3fn, uint8 for int4)."""
        return self._codec.storage_dtype

    @property
    def scale_dtype(self) -> np.dtype:
        """The dtype of ``QuantizedPages.scale`` (float32; bfloat16 for int4)."""
        return self._codec.scale_dtype

    @property
    def qmax(self) -> float:
        """Largest magnitude of a stored level: ``scale = absmax / qmax`` (127, 448, 7)."""
        return self._codec.qmax

    @property
    def tag(self) -> str:
        """A name that identifies the format: the kind, plus ``-g{group_size}`` for int4 and
        ``-r{residual}`` for a kivi2 window of ``residual > 0`` tokens."""
        if self.kind in _GROUPED:
            return f"{self.kind}-g{self.group_size}"
        return f"{self.kind}-r{self.residual}" if self.residual else self.kind

    def check_head_dim(self, fn: str, name: str, head_dim: int) -> None:
        """Raises ``ValueError`` (naming ``fn`` and ``name``) unless this format stores ``H``."""
        if self.kind == "kivi2" and int(head_dim) % 4:
            raise ValueError(
                f"{fn}: {name}: kivi2 packs 4 codes a byte: expected H % 4 == 0, got H={head_dim}"
            )
        if self.kind in _GROUPED and int(head_dim) % self.group_size:
            raise ValueError(
                f"{fn}: {name}: expected a head dim H divisible by the {self.kind} group_size "
                f"{self.group_size}, got H={head_dim} (pass KVFormat({self.kind!r}, "
                f"group_size=...) with a divisor of H)"
            )

    def data_shape(self, shape) -> tuple[int, ...]:
        """The shape of ``data`` for a float pool of ``shape`` ``[..., C, H]``."""
        return self._codec.data_shape(tuple(shape), self.group_size)

    def scale_shape(self, shape, grouping: str = "token") -> tuple[int, ...]:
        """The shape of ``scale`` (and kivi2's ``zero``) for a float pool of ``shape``:
        ``[..., C]``, ``[..., C, H/g]`` (int4), or ``[..., P, H]`` for kivi2 keys
        (``grouping="channel"``)."""
        return self._codec.scale_shape(tuple(shape), self.group_size, grouping)

    def float_shape(self, data_shape) -> tuple[int, ...]:
        """The float pool's shape ``[..., C, H]`` from the shape of ``data``."""
        return self._codec.float_shape(tuple(data_shape), self.group_size)

    @property
    def codes_per_byte(self) -> int:
        """Stored values per byte of ``data`` along ``H``: 1 (int8, fp8), 2 (int4), 4 (kivi2)."""
        return self._codec.codes_per_byte

    def encode(self, x: Float[Array, "*rows H"]) -> tuple[Shaped[Array, "*rows D"], Array]:
        """Quantizes ``x`` in this format: the codec that ring hops and pages share.

        Args:
          x: ``[..., H]`` floating values (any float dtype, read as float32); each ``[H]``
            vector (one token of one kv head) gets its own scale, or ``H // group_size`` of
            them for int4. ``H`` must be storable (:meth:`check_head_dim`).

        Returns:
          ``(data, scale)``: ``data`` of ``data_shape(x.shape)`` in :attr:`storage_dtype`
          (``[..., H]``, or ``[..., H // 2]`` uint8 for int4), ``scale`` of
          ``scale_shape(x.shape)`` in :attr:`scale_dtype` (``[...]`` float32, or
          ``[..., H // group_size]`` bfloat16 for int4). Jittable.

        Raises:
          ValueError: ``x`` is not a floating array of rank >= 1, ``H`` is not storable, or
            the format is kivi2 (its keys are quantized per channel over a page: use
            ``paged.quantize_pages(x, KVFormat("kivi2"), role=...)``).

        Example:
          >>> data, scale = KVFormat("int8").encode(jnp.array([[1.0, -0.5], [0.0, 0.0]]))
          >>> data.tolist(), scale.tolist()
          ([[127, -64], [0, 0]], [0.007874015718698502, 0.0])
        """
        fn = "KVFormat.encode"
        self._check_codec(fn)
        if not hasattr(x, "dtype") or x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
            raise fail(fn, "x", "a floating array [..., H]", describe(x))
        self.check_head_dim(fn, "x", x.shape[-1])
        return self._codec.encode(jnp.asarray(x).astype(jnp.float32), self.group_size)

    def decode(self, data: Shaped[Array, "*rows D"], scale: Array) -> Float[Array, "*rows H"]:
        """The float32 ``[..., H]`` values that ``data`` and ``scale`` (from :meth:`encode`)
        stand for: ``data * scale`` (int4: per group, after unpacking the nibbles).

        Raises:
          ValueError: ``data`` is not in :attr:`storage_dtype`, ``scale`` is not shaped
            ``scale_shape(float_shape(data.shape))``, or the format is kivi2 (decode its
            pages with ``paged.QuantizedPages.dequantize``).

        Example:
          >>> fmt = KVFormat("int8")
          >>> fmt.decode(*fmt.encode(jnp.array([[1.0, -0.5]]))).tolist()
          [[1.0, -0.5039370059967041]]
        """
        fn = "KVFormat.decode"
        self._check_codec(fn)
        if not hasattr(data, "dtype") or data.ndim < 1 or data.dtype != self.storage_dtype:
            raise fail(fn, "data", f"a {self.storage_dtype} array [..., D]", describe(data))
        expected = self.scale_shape(self.float_shape(data.shape))
        if not hasattr(scale, "shape") or tuple(scale.shape) != expected:
            raise fail(fn, "scale", f"shape {expected}", describe(scale))
        return self._codec.decode(data, scale, self.group_size)

    def _check_codec(self, fn: str) -> None:
        if self.kind == "kivi2":
            raise ValueError(
                f"{fn}: kivi2 quantizes keys per channel over a whole page, not token by "
                "token: use paged.quantize_pages(x, KVFormat('kivi2'), role='keys' or "
                "'values') and QuantizedPages.dequantize"
            )

    def bytes_per_token(self, head_dim: int, page_size: int | None = None) -> int | float:
        """Bytes one token takes per kv head, for keys or for values, scales included.

        int8 / fp8: ``H * itemsize + 4``; int4: ``H / 2 + 2 * H / group_size``. kivi2 (needs
        ``page_size`` ``C``): keys ``H / 4 + 4 H / C``, values ``H / 4 + 4``, averaged; the
        float32 residual window of each sequence is per sequence, not per token, and not
        counted.
        """
        if self.kind == "kivi2":
            if page_size is None:
                raise ValueError("KVFormat.bytes_per_token: kivi2 needs page_size")
            return self._codec.bytes_per_token(int(head_dim), self.group_size, int(page_size))
        return int(self._codec.bytes_per_token(int(head_dim), self.group_size))
