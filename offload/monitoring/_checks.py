"""Eager scalar checks of ``offload.monitoring``: copies of the core's (``offload/_checks.py``).

A subpackage uses only the core's public names, so the few checkers it needs are copied here;
``tests/offload/test_checks_copies.py`` keeps each copy identical to the core's function. One
error format everywhere: ``f"{fn}: {arg}: expected {X}, got {Y}"`` (``ValueError``).
"""

import math

import numpy as np

__all__ = ["check_float", "check_int", "is_int"]


def is_int(x) -> bool:
    """Whether ``x`` is a Python or numpy integer scalar (``bool`` excluded)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


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
