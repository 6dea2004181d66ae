"""Eager input checks shared by every public entry of ``offload``.

One error format everywhere: ``f"{fn}: {arg}: expected {X}, got {Y}"`` (``ValueError``).
Scalars: an int option accepts Python ``int`` and numpy integer scalars and rejects ``bool``,
floats (``3.0`` included: nothing is truncated) and anything else; a float option accepts
ints and floats of Python or numpy, rejects ``bool`` and, where it must be finite, NaN and
infinities. Every checker returns the value normalised to a Python type (or an ``int32``
numpy array for id lists), ready to become a static or ``jit`` argument.
"""

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

__all__ = [
    "IdList",
    "check_array",
    "check_choice",
    "check_float",
    "check_ids",
    "check_int",
    "check_lengths",
    "check_table",
    "check_unique",
    "is_int",
]


def is_int(x) -> bool:
    """Whether ``x`` is a Python or numpy integer scalar (``bool`` excluded)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


_KIND_NAMES = {jnp.floating: "a floating", jnp.integer: "an integer", jnp.bool_: "a bool"}


def _describe(x) -> str:
    if isinstance(x, (jax.Array, np.ndarray)):
        return f"{type(x).__name__} {x.dtype} {tuple(x.shape)}"
    return repr(x)


def check_int(fn: str, name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """An int in ``[low, high)`` (either bound optional), returned as a Python ``int``.

    Raises:
      ValueError: on a bool, a float (even integral), anything else, or a value out of range.
    """
    bounds = []
    if low is not None:
        bounds.append(f">= {low}")
    if high is not None:
        bounds.append(f"< {high}")
    want = "an int" + (f" {' and '.join(bounds)}" if bounds else "")
    if low is not None and high is not None:
        want = f"an int in [{low}, {high})"
    if not is_int(value):
        raise ValueError(f"{fn}: {name}: expected {want}, got {type(value).__name__} {value!r}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value >= high):
        raise ValueError(f"{fn}: {name}: expected {want}, got {value}")
    return value


def check_float(
    fn: str,
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    finite: bool = True,
) -> float:
    """A real number (Python or numpy int/float) in the given bounds, as a Python ``float``.

    ``low`` is exclusive when ``low_open``; ``high`` is inclusive.

    Raises:
      ValueError: on a bool, a non-number, NaN or an infinity (when ``finite``), or a value out
        of range.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise ValueError(f"{fn}: {name}: expected a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if finite and not math.isfinite(value):
        raise ValueError(f"{fn}: {name}: expected a finite float, got {value}")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        interval = f"{'(' if low_open or low is None else '['}{lo}, {hi}]"
        raise ValueError(f"{fn}: {name}: expected a float in {interval}, got {value}")
    return value


def check_choice(fn: str, name: str, value, choices: Sequence) -> None:
    """``value`` is one of ``choices``.

    Raises:
      ValueError: otherwise.
    """
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{fn}: {name}: expected one of {list(choices)}, got {value!r}")


def check_ids(fn: str, name: str, ids, upper: int) -> np.ndarray:
    """A 1-D integer sequence of ids in ``[0, upper)`` (list, numpy or concrete array).

    Returns:
      The ids as an ``int32`` numpy array.

    Raises:
      ValueError: if not 1-D integers, or any id is out of range.
    """
    if isinstance(ids, jax.core.Tracer):
        raise ValueError(
            f"{fn}: {name}: expected concrete ids (host-side bookkeeping, outside jit), "
            "got a tracer"
        )
    array = np.asarray(ids)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise ValueError(
            f"{fn}: {name}: expected a 1-D integer sequence, got shape {array.shape} "
            f"dtype {array.dtype}"
        )
    if array.size and (array.min() < 0 or array.max() >= upper):
        raise ValueError(
            f"{fn}: {name}: expected ids in [0, {upper}), got min {array.min()} max {array.max()}"
        )
    return array.astype(np.int32)


def check_unique(fn: str, name: str, ids: np.ndarray) -> None:
    """No id repeats.

    Raises:
      ValueError: otherwise.
    """
    if np.unique(ids).size != ids.size:
        raise ValueError(f"{fn}: {name}: expected distinct ids, got {ids.tolist()}")


def check_array(fn: str, name: str, x, *, ndim: int, kind, layout: str) -> tuple[int, ...]:
    """A ``jax.Array`` of rank ``ndim`` whose dtype is a sub-dtype of ``kind``.

    Args:
      layout: the expected shape in legend letters, for the message (``"[B, T, N, H]"``).

    Returns:
      The shape.

    Raises:
      ValueError: otherwise.
    """
    if not isinstance(x, (jax.Array, np.ndarray)) or x.ndim != ndim:
        raise ValueError(f"{fn}: {name}: expected an array {layout}, got {_describe(x)}")
    if not jnp.issubdtype(x.dtype, kind):
        raise ValueError(
            f"{fn}: {name}: expected {_KIND_NAMES[kind]} array {layout}, got {_describe(x)}"
        )
    return tuple(x.shape)


def check_table(fn: str, name: str, table, shape: tuple[int, ...] | None = None) -> None:
    """An integer ``[B, M]`` page table (of ``shape`` when given).

    Raises:
      ValueError: otherwise.
    """
    check_array(fn, name, table, ndim=2, kind=jnp.integer, layout="int [B, M]")
    if shape is not None and tuple(table.shape) != tuple(shape):
        raise ValueError(f"{fn}: {name}: expected shape {tuple(shape)}, got {tuple(table.shape)}")


def check_lengths(fn: str, lengths, batch: int) -> None:
    """An integer ``[B]`` lengths vector.

    Raises:
      ValueError: otherwise.
    """
    if (
        not isinstance(lengths, (jax.Array, np.ndarray))
        or lengths.ndim != 1
        or lengths.shape[0] != batch
        or not jnp.issubdtype(lengths.dtype, jnp.integer)
    ):
        raise ValueError(f"{fn}: lengths: expected int [B={batch}], got {_describe(lengths)}")


# Host-side id lists (page ids, host slots): a list or tuple of ints, a numpy array or a
# concrete jax.Array; checked by :func:`check_ids`.
IdList = Int[Array | np.ndarray, " n"] | Sequence[int | np.integer]
