"""Arbitrary static boolean masks (splash attention's ``NumpyMask`` / ``LogicalOr`` route).

A :class:`DenseMask` is a numpy ``[T, S]`` bool array over query and key INDICES of one call
(not positions), hashable by its bytes so it can sit in a static :class:`ringattn.MaskSpec`.
It is ANDed with the other mask conditions; ``|`` and ``&`` combine masks (an OR of a causal
pattern and a prefix block gives a prefix-LM mask). The blockwise kernel computes each block
pair's any/all table from it at trace time, so block pairs the mask hides are skipped and
pairs it fully allows need no elementwise mask.

Supported by :func:`ringattn.attention_reference` and :func:`ringattn.blockwise_attention`;
the ring, ``sharded_attention`` and the decode functions raise ``NotImplementedError`` (their
shards see different index ranges of the mask).
"""

import dataclasses
import hashlib

import numpy as np

from ringattn._checks import IntLike, check_int, describe, fail

__all__ = ["DenseMask"]


@dataclasses.dataclass(frozen=True, eq=False)
class DenseMask:
    """A static boolean ``[T, S]`` mask: True where query ``t`` may see key ``s``.

    Attributes:
      array: ``[T, S]`` numpy bool (copied, read-only).

    Example:
      >>> import numpy as np
      >>> prefix = DenseMask(np.zeros((4, 4), bool)).with_block(0, 2, 0, 2)
      >>> (DenseMask.causal(4, 4) | prefix).array.astype(int).tolist()[0]
      [1, 1, 0, 0]
    """

    array: np.ndarray

    def __post_init__(self):
        a = self.array
        if not isinstance(a, np.ndarray) or a.ndim != 2 or a.dtype != np.bool_:
            raise fail("DenseMask", "array", "a 2-d numpy bool array [T, S]", describe(a))
        a = np.array(a, copy=True)
        a.setflags(write=False)
        object.__setattr__(self, "array", a)
        digest = hashlib.sha1(a.tobytes()).hexdigest()
        object.__setattr__(self, "_key", (a.shape, digest))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.array.shape)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, DenseMask) and self._key == other._key

    def __repr__(self):
        return f"DenseMask(shape={self.shape}, allowed={int(self.array.sum())})"

    def _combine(self, other, op, name):
        if not isinstance(other, DenseMask) or other.shape != self.shape:
            raise fail(
                f"DenseMask.{name}", "other", f"a DenseMask of shape {self.shape}", describe(other)
            )
        return DenseMask(op(self.array, other.array))

    def __or__(self, other):
        return self._combine(other, np.logical_or, "__or__")

    def __and__(self, other):
        return self._combine(other, np.logical_and, "__and__")

    def with_block(self, t0: IntLike, t1: IntLike, s0: IntLike, s1: IntLike) -> "DenseMask":
        """A copy with queries ``[t0, t1)`` allowed to see keys ``[s0, s1)``."""
        a = np.array(self.array)
        a[check_int("DenseMask.with_block", "t0", t0) : int(t1), int(s0) : int(s1)] = True
        return DenseMask(a)

    @classmethod
    def causal(cls, T: IntLike, S: IntLike, offset: IntLike = 0) -> "DenseMask":
        """Query ``t`` sees keys ``s <= t + offset``."""
        T = check_int("DenseMask.causal", "T", T, minimum=0)
        S = check_int("DenseMask.causal", "S", S, minimum=0)
        return cls(np.arange(S)[None, :] <= np.arange(T)[:, None] + int(offset))

    def block_table(self, Tp: int, Sp: int, bq: int, bk: int) -> tuple[np.ndarray, np.ndarray]:
        """``(any, all)`` per block pair ``[Tp // bq, Sp // bk]`` of the mask padded with False
        to ``[Tp, Sp]``: a pair is live iff any entry is True, unmasked iff all are."""
        padded = self.padded(Tp, Sp)
        blocks = padded.reshape(Tp // bq, bq, Sp // bk, bk)
        return blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3))

    def padded(self, Tp: int, Sp: int) -> np.ndarray:
        T, S = self.shape
        out = np.zeros((Tp, Sp), bool)
        out[:T, :S] = self.array
        return out
