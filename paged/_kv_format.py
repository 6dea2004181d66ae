"""The quantized KV format: :class:`paged.KVFormat`, a frozen, hashable config.

Its kind (int8, fp8, int4, kivi2), int4's group size and kivi2's residual window, validated when
it is built, and what follows from them: bytes per token, the storage dtypes, the codec
(:mod:`paged._codecs`). The pools it describes are :class:`paged.QuantizedPages`
(:mod:`paged._quantized`, whose docstring states the semantics of each kind).
"""

import dataclasses

import numpy as np

from paged._codecs import _CODECS

__all__ = ["KVFormat"]


_PLANNED = ()


_GROUPED = ("int4",)  # kinds that read group_size


_DEFAULT_GROUP = 32


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """How KV pages are stored: a frozen, hashable config (a static ``jit`` argument).

    Attributes:
      kind: ``"int8"`` (symmetric, 127 levels each side) or ``"fp8"`` (``float8_e4m3fn``),
        both with one float32 absmax scale per token per kv head; or ``"int4"`` (symmetric
        levels -7..7, two per byte, one bfloat16 absmax scale per group of ``group_size``
        values along ``H``); or ``"kivi2"`` (KIVI-style 2-bit: keys per channel over each page,
        values per token, bfloat16 scale and zero-point, the most recent tokens of each
        sequence in float32; see :mod:`paged._kivi`).
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
      NotImplementedError: for a planned but not yet supported kind.

    Example:
      >>> KVFormat("int8").storage_dtype, KVFormat("fp8").qmax, KVFormat("int4").scale_dtype
      (dtype('int8'), 448.0, dtype(bfloat16))
      >>> KVFormat("int4").bytes_per_token(128), KVFormat("int8").bytes_per_token(128)
      (72, 132)
      >>> KVFormat("kivi2", residual=128).residual_pages(16), KVFormat("kivi2").tag
      (9, 'kivi2')
    """

    kind: str
    group_size: int = _DEFAULT_GROUP
    residual: int = 0

    def __post_init__(self):
        known = sorted(_CODECS)
        if not isinstance(self.kind, str):
            raise ValueError(f"KVFormat: kind: expected one of {known}, got {self.kind!r}")
        if self.kind in _PLANNED:
            raise NotImplementedError(
                f"KVFormat: kind: {self.kind!r} is not yet supported (supported: {known})"
            )
        if self.kind not in _CODECS:
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
        return {"int4": 2, "kivi2": 4}.get(self.kind, 1)

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
