"""KV retention policies: which pages (or tokens) of each sequence stay on the device.

A policy is a frozen, hashable :class:`RetentionPolicy` (a ``jit`` static argument) plus three
pure functions over a :class:`PolicyState` (one layer; ``jax.vmap`` over a leading layer axis
gives per-layer policies):

* :func:`init_policy_state` — zero scores ``[B, U]``;
* :func:`update_policy_state` — fold in an attention-mass array ``[B, N, U]`` (the
  ``page_mass`` of ``paged.paged_attention(..., return_page_mass=True)``, or
  :func:`token_attention_mass` for tokens of a contiguous cache);
* :func:`select_keep` — a :class:`Selection` of units to keep, demote (to host or disk) or
  drop, with every shape static.

``U`` is the number of units: page-table slots ``M`` (``granularity="page"``) or token slots
``S`` (``granularity="token"``). Unit ``u`` of sequence ``b`` is *live* when it lies within
the sequence's length (``u < ceil(lengths[b] / C)`` for pages, ``u < lengths[b]`` for tokens)
and, when a page table is given, ``page_table[b, u] != 0`` (slot 0 is the reserved null page:
it is never selected, kept or demoted).

Selection order (the first ``budget`` live units are kept, the rest demoted or dropped):

1. *sinks*: units with index ``< sink``, earliest first;
2. *recent*: units with index ``>= ceil(len / C) - recent`` (resp. ``len - recent``), latest
   first;
3. everything else by score, highest first; ties (equal scores, and all units of the
   score-free kinds) go to the later unit, so ``recency`` is "highest index first".

The kinds differ only in the scores they keep and their structural parts:

=============  ==============================================================================
``recency``    the ``budget`` most recent units (no scores).
``streaming``  StreamingLLM: ``sink`` first units, the rest of the budget most recent.
``h2o``        H2O: ``sink`` + ``recent`` units, the rest by *accumulated* attention mass.
``snapkv``     SnapKV: scores *replaced* by the (pooled) attention mass of an observation
               window of last queries, fed once at the end of prefill; ``recent`` should
               cover the observation window.
``tova``       TOVA: scores *replaced* at each step by the last query's attention.
=============  ==============================================================================

Heads share one page table, so a selection is per sequence, not per head: ``head_reduce="sum"``
ranks by attention summed over query heads (H2O, TOVA), ``"max"`` by the largest per-head
mass (SnapKV's per-head top-k, made budget-exact: a unit that any head needs ranks high).

A pinned request (``pinned[b]``) keeps every live unit. ``mode="demote"`` (default) returns the
evicted units as ``demote`` for the tier layer; ``mode="drop"`` as ``drop``.

References:
  Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (StreamingLLM), 2023;
  Zhang et al., "H2O: Heavy-Hitter Oracle", 2023; Li et al., "SnapKV", 2024;
  Oren et al., "Transformers are Multi-State RNNs" (TOVA), 2024.
"""

import dataclasses
import fractions
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from offload._checks import check_choice, check_float, check_int, check_lengths, is_int

__all__ = [
    "POLICY_KINDS",
    "PolicyState",
    "RetentionPolicy",
    "Selection",
    "budget_units",
    "init_policy_state",
    "select_keep",
    "select_keep_reference",
    "update_policy_state",
    "update_policy_state_reference",
]

POLICY_KINDS = ("recency", "streaming", "h2o", "snapkv", "tova")
_SCORED_KINDS = ("h2o", "snapkv", "tova")
# Fractions are turned into num / den with den <= _MAX_DENOMINATOR, so the budget of n live
# units is the exact integer ceil(num * n / den), identical in jnp (int32) and numpy.
_MAX_DENOMINATOR = 1000


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """Static configuration of a retention policy (hashable: a ``jit`` static argument).

    Attributes:
      kind: one of ``"recency"``, ``"streaming"``, ``"h2o"``, ``"snapkv"``, ``"tova"``.
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
        # Normalised to Python scalars: equal policies hash equal whatever types came in.
        for name, value in (
            ("budget", budget),
            ("page_size", page_size),
            ("sink", sink),
            ("recent", recent),
            ("pool_size", pool_size),
        ):
            object.__setattr__(self, name, value)

    @property
    def uses_scores(self) -> bool:
        """Whether :func:`update_policy_state` changes the state (H2O, SnapKV, TOVA)."""
        return self.kind in _SCORED_KINDS

    @property
    def budget_fraction(self) -> tuple[int, int] | None:
        """``(num, den)`` of a fractional budget, None for a count."""
        if is_int(self.budget):
            return None
        f = fractions.Fraction(float(self.budget)).limit_denominator(_MAX_DENOMINATOR)
        return f.numerator, f.denominator


class PolicyState(NamedTuple):
    """Per-sequence unit scores of one layer.

    Attributes:
      scores: ``[B, U]`` float32: accumulated mass (H2O), last pooled observation-window mass
        (SnapKV), last query's mass (TOVA), zeros for ``recency``/``streaming``.
    """

    scores: Float[Array, "B U"]


class Selection(NamedTuple):
    """Disjoint masks over the units, whose union is the live units.

    Attributes:
      keep: ``[B, U]`` bool, stays on the device.
      demote: ``[B, U]`` bool, leaves the device for host or disk (``mode="demote"``).
      drop: ``[B, U]`` bool, discarded (``mode="drop"``).
    """

    keep: Bool[Array, "B U"]
    demote: Bool[Array, "B U"]
    drop: Bool[Array, "B U"]


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


def _check_policy(fn: str, policy) -> None:
    if not isinstance(policy, RetentionPolicy):
        raise ValueError(f"{fn}: policy: expected a RetentionPolicy, got {type(policy).__name__}")


def init_policy_state(
    batch_size: int | np.integer, num_units: int | np.integer, *, policy: RetentionPolicy
) -> PolicyState:
    """Zero scores for ``batch_size`` sequences of ``num_units`` units.

    The sizes are static: jit it with them bound,
    ``jax.jit(functools.partial(init_policy_state, 2, 8, policy=policy))``.

    Args:
      batch_size: ``B >= 1``.
      num_units: ``U >= 1``: page-table slots ``M`` or token slots ``S``.
      policy: the :class:`RetentionPolicy` (checked here).

    Returns:
      A :class:`PolicyState` with ``scores [B, U]`` float32 zeros.

    Raises:
      ValueError: if ``batch_size`` or ``num_units`` is not a positive int, or ``policy`` is
        not a RetentionPolicy.

    Example:
      >>> pol = RetentionPolicy("tova", 4, granularity="token")
      >>> init_policy_state(2, 8, policy=pol).scores.shape
      (2, 8)
    """
    fn = "init_policy_state"
    _check_policy(fn, policy)
    batch_size = check_int(fn, "batch_size", batch_size, low=1)
    num_units = check_int(fn, "num_units", num_units, low=1)
    return PolicyState(scores=jnp.zeros((batch_size, num_units), jnp.float32))


def update_policy_state(
    state: PolicyState, mass: Float[Array, "B N U"], *, policy: RetentionPolicy
) -> PolicyState:
    """Folds one observation of attention mass into the state.

    Jittable with the policy bound: ``jax.jit(functools.partial(update_policy_state,
    policy=policy))`` (or ``jax.jit(update_policy_state, static_argnames="policy")``).

    Args:
      state: the current :class:`PolicyState` (``scores [B, U]``).
      mass: ``[B, N, U]`` non-negative attention probability per query head and unit, summed
        over the observed queries: ``page_mass`` of ``paged.paged_attention`` for pages,
        :func:`token_attention_mass` for tokens. H2O feeds every decode step, TOVA the last
        query of every step, SnapKV the observation window once at the end of prefill.

    Returns:
      The new state: H2O adds the pooled, head-reduced mass; SnapKV and TOVA replace the
      scores with it; ``recency`` and ``streaming`` return ``state`` unchanged.

    Raises:
      ValueError: if ``mass`` is not rank 3, or its ``B``/``U`` disagree with ``state``.

    Example:
      >>> pol = RetentionPolicy("h2o", 2, granularity="token")
      >>> st = init_policy_state(1, 4, policy=pol)
      >>> st = update_policy_state(st, jnp.ones((1, 2, 4)) / 4, policy=pol)
      >>> st.scores.tolist()
      [[0.5, 0.5, 0.5, 0.5]]
    """
    fn = "update_policy_state"
    _check_policy(fn, policy)
    B, U = state.scores.shape
    if mass.ndim != 3 or mass.shape[0] != B or mass.shape[2] != U:
        raise ValueError(f"{fn}: mass: expected shape [B={B}, N, U={U}], got {tuple(mass.shape)}")
    if not policy.uses_scores:
        return state
    return PolicyState(
        scores=_update_impl(
            state.scores,
            mass,
            accumulate=policy.kind == "h2o",
            pool_size=policy.pool_size,
            pool=policy.pool,
            head_reduce=policy.head_reduce,
        )
    )


@functools.partial(jax.jit, static_argnames=("accumulate", "pool_size", "pool", "head_reduce"))
def _update_impl(scores, mass, *, accumulate, pool_size, pool, head_reduce):
    """Pools each head's mass along the units, reduces over heads, adds or replaces."""
    mass = mass.astype(jnp.float32)
    w = pool_size
    if w > 1:
        pad = ((0, 0), (0, 0), (w // 2, w // 2))
        if pool == "max":
            mass = jax.lax.reduce_window(mass, -jnp.inf, jax.lax.max, (1, 1, w), (1, 1, 1), pad)
        else:
            mass = jax.lax.reduce_window(mass, 0.0, jax.lax.add, (1, 1, w), (1, 1, 1), pad) / w
    reduced = jnp.sum(mass, axis=1) if head_reduce == "sum" else jnp.max(mass, axis=1)
    return scores + reduced if accumulate else reduced


def _units_by_length(policy: RetentionPolicy, lengths):
    if policy.granularity == "page":
        return (lengths + policy.page_size - 1) // policy.page_size
    return lengths


def select_keep(
    state: PolicyState,
    lengths: Int[Array, " B"],
    *,
    policy: RetentionPolicy,
    page_table: Int[Array, "B U"] | None = None,
    pinned: Bool[Array, " B"] | None = None,
    mode: str = "demote",
) -> Selection:
    """Selects the units each sequence keeps on the device; the rest are demoted or dropped.

    Static shapes throughout: jit it with the options bound,
    ``jax.jit(functools.partial(select_keep, policy=policy, mode="drop"))`` (or
    ``static_argnames=("policy", "mode")``). Exactly
    ``budget_units(policy, n_live)`` units are kept per unpinned sequence (``n_live`` = its
    live units), all live units for a pinned one; the order is described in the module
    docstring and is deterministic (ties go to the later unit).

    Args:
      state: :class:`PolicyState` with ``scores [B, U]``.
      lengths: ``[B]`` int tokens per sequence; units past ``ceil(len / C)`` (pages) or
        ``len`` (tokens) are never selected.
      policy: the :class:`RetentionPolicy`.
      page_table: optional ``[B, U]`` int page ids (``U = M``); slots holding the null page 0
        are not live. Only for ``granularity="page"``.
      pinned: optional ``[B]`` bool; a pinned sequence keeps every live unit.
      mode: ``"demote"`` (evicted units go to ``demote``) or ``"drop"`` (to ``drop``).

    Returns:
      A :class:`Selection` of ``[B, U]`` bool masks: disjoint, union = live units.

    Raises:
      ValueError: on a bad ``mode``, ``policy``, or shapes/dtypes of ``lengths``,
        ``page_table`` or ``pinned``, or a ``page_table`` with ``granularity="token"``.

    Example:
      >>> pol = RetentionPolicy("streaming", 3, granularity="token", sink=1)
      >>> st = init_policy_state(1, 8, policy=pol)
      >>> sel = select_keep(st, jnp.array([6]), policy=pol)
      >>> sel.keep.astype(int).tolist(), sel.demote.astype(int).tolist()
      ([[1, 0, 0, 0, 1, 1, 0, 0]], [[0, 1, 1, 1, 0, 0, 0, 0]])
    """
    fn = "select_keep"
    _check_policy(fn, policy)
    check_choice(fn, "mode", mode, ("demote", "drop"))
    scores = state.scores
    B, U = scores.shape
    check_lengths(fn, lengths, B)
    if page_table is not None:
        if policy.granularity != "page":
            raise ValueError(
                f"{fn}: page_table: expected None for granularity='token' (tables are for "
                "granularity='page'), got a table"
            )
        if page_table.shape != (B, U) or not jnp.issubdtype(page_table.dtype, jnp.integer):
            raise ValueError(
                f"{fn}: page_table: expected int [B={B}, U={U}], "
                f"got {page_table.dtype} {tuple(page_table.shape)}"
            )
    if pinned is not None and (pinned.shape != (B,) or pinned.dtype != jnp.bool_):
        raise ValueError(
            f"{fn}: pinned: expected bool [B={B}], got {pinned.dtype} {tuple(pinned.shape)}"
        )

    frac = policy.budget_fraction
    num, den = (int(policy.budget), 0) if frac is None else frac
    # Budget, sinks and the recent window travel as traced scalars, so one compilation serves
    # every policy of the same granularity and page size.
    scalars = jnp.array([policy.sink, policy.recent, num, den], jnp.int32)
    keep, evicted = _select_impl(
        scores, lengths.astype(jnp.int32), page_table, pinned, scalars, page_size=policy.page_size
    )
    none = jnp.zeros_like(keep)
    if mode == "demote":
        return Selection(keep=keep, demote=evicted, drop=none)
    return Selection(keep=keep, demote=none, drop=evicted)


@functools.partial(jax.jit, static_argnames=("page_size",))
def _select_impl(scores, lengths, page_table, pinned, scalars, *, page_size):
    """``(keep, evicted)`` masks; ``scalars = [sink, recent, num, den]`` (``den = 0``: count)."""
    sink, recent, num, den = scalars[0], scalars[1], scalars[2], scalars[3]
    B, U = scores.shape
    idx = jnp.arange(U, dtype=jnp.int32)[None, :]
    n_len = lengths if page_size is None else (lengths + page_size - 1) // page_size
    n_len = n_len[:, None]  # [B, 1]
    live = idx < n_len
    if page_table is not None:
        live &= page_table != 0
    tier = jnp.where(idx < sink, 0, jnp.where(idx >= n_len - recent, 1, 2))
    tier = jnp.where(live, tier, 3)
    s = scores.astype(jnp.float32)
    s = jnp.where(jnp.isnan(s) | (s == 0.0), 0.0, s)  # NaN ranks like 0; -0.0 ties with 0.0
    by_score = jnp.where(tier == 2, -s, 0.0)
    by_index = jnp.where(tier == 0, idx, -idx)  # sinks earliest first, others latest first
    by_index = jnp.broadcast_to(by_index, (B, U))
    order = jnp.lexsort((by_index, by_score, tier), axis=-1)  # last key is primary
    rank = jnp.argsort(order, axis=-1)
    n_live = jnp.sum(live, axis=-1, dtype=jnp.int32)
    k = jnp.where(den > 0, (n_live * num + den - 1) // jnp.maximum(den, 1), num)
    k = jnp.minimum(k, n_live)
    if pinned is not None:
        k = jnp.where(pinned, n_live, k)
    keep = live & (rank < k[:, None])
    return keep, live & ~keep


# --------------------------------------------------------------------------- numpy references


def update_policy_state_reference(scores, mass, *, policy: RetentionPolicy) -> np.ndarray:
    """Numpy oracle of :func:`update_policy_state` on raw arrays (``[B, U]``, ``[B, N, U]``)."""
    scores = np.asarray(scores, np.float32)
    mass = np.asarray(mass, np.float32)
    if not policy.uses_scores:
        return scores.copy()
    B, N, U = mass.shape
    w, half = policy.pool_size, policy.pool_size // 2
    pooled = np.empty_like(mass)
    for u in range(U):
        lo, hi = max(0, u - half), min(U, u + half + 1)
        window = mass[:, :, lo:hi]
        if policy.pool == "max":
            pooled[:, :, u] = window.max(axis=-1)
        else:
            pooled[:, :, u] = window.sum(axis=-1) / w
    reduced = pooled.sum(axis=1) if policy.head_reduce == "sum" else pooled.max(axis=1)
    return (scores + reduced) if policy.kind == "h2o" else reduced


def select_keep_reference(
    scores, lengths, *, policy: RetentionPolicy, page_table=None, pinned=None, mode="demote"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Numpy oracle of :func:`select_keep`: ``(keep, demote, drop)`` bool ``[B, U]``."""
    scores = np.asarray(scores, np.float32)
    B, U = scores.shape
    lengths = np.asarray(lengths)
    keep = np.zeros((B, U), bool)
    evicted = np.zeros((B, U), bool)
    for b in range(B):
        n_len = int(_units_by_length(policy, int(lengths[b])))
        live = [u for u in range(min(U, n_len)) if page_table is None or int(page_table[b][u]) != 0]

        def key(u, n_len=n_len, b=b):
            if u < policy.sink:
                return (0, 0.0, u)
            if u >= n_len - policy.recent:
                return (1, 0.0, -u)
            s = float(scores[b, u])
            s = 0.0 if np.isnan(s) else s
            return (2, -s, -u)

        ranked = sorted(live, key=key)
        k = len(ranked)
        if pinned is None or not bool(pinned[b]):
            k = int(budget_units(policy, k))
        for u in ranked[:k]:
            keep[b, u] = True
        for u in ranked[k:]:
            evicted[b, u] = True
    none = np.zeros((B, U), bool)
    return (keep, evicted, none) if mode == "demote" else (keep, none, evicted)
