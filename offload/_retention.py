"""The static configuration of a retention policy, and the budget it implies.

:class:`RetentionPolicy` is frozen, hashable and validated once in ``__post_init__`` (numpy
scalars accepted and normalised to Python types), so it is a ``jit`` static argument; see
:mod:`offload._policies` for what each kind does.
"""

import dataclasses
import fractions

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from offload._checks import check_choice, check_float, check_int, is_int

__all__ = ["POLICY_KINDS", "RetentionPolicy", "budget_units"]

POLICY_KINDS = ("recency", "streaming", "h2o", "snapkv", "tova", "scissorhands")
_SCORED_KINDS = ("h2o", "snapkv", "tova", "scissorhands")
# Fractions are turned into num / den with den <= _MAX_DENOMINATOR, so the budget of n live
# units is the exact integer ceil(num * n / den), identical in jnp (int32) and numpy.
_MAX_DENOMINATOR = 1000


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """Static configuration of a retention policy (hashable: a ``jit`` static argument).

    Attributes:
      kind: one of ``"recency"``, ``"streaming"``, ``"h2o"``, ``"snapkv"``, ``"tova"``,
        ``"scissorhands"``.
      budget: units kept per (unpinned) sequence: an ``int >= 0`` is a count, a ``float`` in
        ``(0, 1]`` a fraction of the sequence's live units, rounded up (``ceil``) after being
        made a fraction with denominator ``<= 1000``. Capped by the live units.
      granularity: ``"page"`` (units are page-table slots, ``U = M``) or ``"token"``
        (``U = S``).
      page_size: tokens per page ``C``; required for ``"page"``, must be None for ``"token"``.
      sink: leading units always ranked first (StreamingLLM's attention sinks). Not for
        ``recency``.
      recent: trailing units always ranked next (H2O's recent window, SnapKV's observation
        window). Only for the scored kinds (for ``recency``/``streaming`` the whole budget after
        the sinks is recent).
      pool_size: odd width of the 1-D pooling of each head's mass along the units before
        ranking (SnapKV's clustering); 1 = none. Only for the scored kinds.
      pool: ``"max"`` or ``"avg"`` (zero-padded, divided by ``pool_size``).
      head_reduce: ``"sum"`` or ``"max"`` over the query heads of the mass.
      history: Scissorhands' history window ``w``, an int ``>= 1``: the importance counts decay
        by ``1 - 1 / history`` at every update (an exponential window of about ``history``
        observations; ``1`` = only the last observation counts). None (default) = no decay,
        plain counts over every observation. Only for ``kind="scissorhands"``.

    Raises:
      ValueError: on any invalid field (named in the message).

    Example:
      >>> RetentionPolicy("h2o", 0.2, page_size=16, sink=1, recent=2).uses_scores
      True
    """

    kind: str
    budget: int | float | np.integer | np.floating
    granularity: str = "page"
    page_size: int | np.integer | None = None
    sink: int | np.integer = 0
    recent: int | np.integer = 0
    pool_size: int | np.integer = 1
    pool: str = "max"
    head_reduce: str = "sum"
    history: int | np.integer | None = None

    def __post_init__(self):
        p = "RetentionPolicy"
        check_choice(p, "kind", self.kind, POLICY_KINDS)
        b = self.budget
        if is_int(b):
            budget = check_int(p, "budget", b, low=0)
        elif isinstance(b, (float, np.floating)):
            budget = check_float(p, "budget", b, low=0.0, high=1.0, low_open=True)
        else:
            raise ValueError(
                f"{p}: budget: expected an int count >= 0 or a float fraction in (0, 1], "
                f"got {type(b).__name__} {b!r}"
            )
        check_choice(p, "granularity", self.granularity, ("page", "token"))
        page_size = None
        if self.granularity == "page":
            if self.page_size is None:
                raise ValueError(
                    f"{p}: page_size: expected an int >= 1 for granularity='page', got None"
                )
            page_size = check_int(p, "page_size", self.page_size, low=1)
        elif self.page_size is not None:
            raise ValueError(
                f"{p}: page_size: expected None for granularity='token', got {self.page_size!r}"
            )
        sink = check_int(p, "sink", self.sink, low=0)
        recent = check_int(p, "recent", self.recent, low=0)
        if self.kind == "recency" and sink:
            raise ValueError(
                f"{p}: sink: expected 0 for kind='recency' (use 'streaming'), got {sink}"
            )
        if self.kind in ("recency", "streaming") and recent:
            raise ValueError(
                f"{p}: recent: expected 0 for kind={self.kind!r} (its budget is all recent), "
                f"got {recent}"
            )
        pool_size = check_int(p, "pool_size", self.pool_size, low=1)
        if pool_size % 2 == 0:
            raise ValueError(f"{p}: pool_size: expected an odd int >= 1, got {pool_size}")
        if pool_size > 1 and not self.uses_scores:
            raise ValueError(
                f"{p}: pool_size: expected 1 for kind={self.kind!r} (pooling needs a scored "
                f"kind), got {pool_size}"
            )
        check_choice(p, "pool", self.pool, ("max", "avg"))
        check_choice(p, "head_reduce", self.head_reduce, ("sum", "max"))
        history = None
        if self.history is not None:
            if self.kind != "scissorhands":
                raise ValueError(
                    f"{p}: history: expected None for kind={self.kind!r} (a history window "
                    f"needs kind='scissorhands'), got {self.history!r}"
                )
            history = check_int(p, "history", self.history, low=1)
        # Normalised to Python scalars: equal policies hash equal whatever types came in.
        for name, value in (
            ("budget", budget),
            ("page_size", page_size),
            ("sink", sink),
            ("recent", recent),
            ("pool_size", pool_size),
            ("history", history),
        ):
            object.__setattr__(self, name, value)

    @property
    def uses_scores(self) -> bool:
        """Whether :func:`update_policy_state` changes the state (H2O, SnapKV, TOVA,
        Scissorhands)."""
        return self.kind in _SCORED_KINDS

    @property
    def decay(self) -> float:
        """The factor the Scissorhands counts are multiplied by before each update: ``1 - 1 /
        history``, or ``1.0`` without a history window (and for every other kind)."""
        return 1.0 if self.history is None else 1.0 - 1.0 / self.history

    @property
    def budget_fraction(self) -> tuple[int, int] | None:
        """``(num, den)`` of a fractional budget, None for a count."""
        if is_int(self.budget):
            return None
        f = fractions.Fraction(float(self.budget)).limit_denominator(_MAX_DENOMINATOR)
        return f.numerator, f.denominator


def budget_units(
    policy: RetentionPolicy, n_live: Int[Array | np.ndarray, "*B"] | int | np.integer
) -> Int[Array | np.ndarray, "*B"] | int:
    """The number of units kept out of ``n_live`` live units, capped by it.

    Jittable (``policy`` is static: ``jax.jit(functools.partial(budget_units, policy))``).

    Args:
      policy: the :class:`RetentionPolicy`.
      n_live: live units per sequence: a jnp int array (traced or not), a numpy array, or an
        int.

    Returns:
      The kept counts: a jnp ``int32`` array for a jnp input, a numpy ``int32`` array for a
      numpy input, a Python ``int`` for an int.

    Example:
      >>> int(budget_units(RetentionPolicy("recency", 0.2, page_size=4), 11))
      3
    """
    scalar = is_int(n_live)
    xp = jnp if isinstance(n_live, jax.Array) else np
    n_live = xp.asarray(n_live, dtype=np.int32)
    frac = policy.budget_fraction
    if frac is None:
        k = xp.full_like(n_live, int(policy.budget))
    else:
        num, den = frac
        k = (n_live * num + (den - 1)) // den
    k = xp.minimum(k, n_live)
    return int(k) if scalar else k
