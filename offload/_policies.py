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

from ringattn import attention_mask

__all__ = [
    "POLICY_KINDS",
    "PolicyState",
    "RetentionPolicy",
    "Selection",
    "budget_units",
    "init_policy_state",
    "select_keep",
    "select_keep_reference",
    "token_attention_mass",
    "update_policy_state",
    "update_policy_state_reference",
]

POLICY_KINDS = ("recency", "streaming", "h2o", "snapkv", "tova")
_SCORED_KINDS = ("h2o", "snapkv", "tova")
# Fractions are turned into num / den with den <= _MAX_DENOMINATOR, so the budget of n live
# units is the exact integer ceil(num * n / den), identical in jnp (int32) and numpy.
_MAX_DENOMINATOR = 1000


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


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
    budget: int | float
    granularity: str = "page"
    page_size: int | None = None
    sink: int = 0
    recent: int = 0
    pool_size: int = 1
    pool: str = "max"
    head_reduce: str = "sum"

    def __post_init__(self):
        p = "RetentionPolicy"
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"{p}: kind must be one of {POLICY_KINDS}, got {self.kind!r}")
        b = self.budget
        if _is_int(b):
            if b < 0:
                raise ValueError(f"{p}: budget count must be >= 0, got {b}")
        elif isinstance(b, (float, np.floating)):
            if not 0.0 < b <= 1.0:
                raise ValueError(f"{p}: budget fraction must be in (0, 1], got {b}")
        else:
            raise ValueError(
                f"{p}: budget must be an int count or a float fraction, got {type(b).__name__}"
            )
        if self.granularity not in ("page", "token"):
            raise ValueError(
                f"{p}: granularity must be 'page' or 'token', got {self.granularity!r}"
            )
        if self.granularity == "page":
            if not (_is_int(self.page_size) and self.page_size >= 1):
                raise ValueError(
                    f"{p}: page_size must be an int >= 1 for granularity='page', "
                    f"got {self.page_size!r}"
                )
        elif self.page_size is not None:
            raise ValueError(
                f"{p}: page_size must be None for granularity='token', got {self.page_size!r}"
            )
        for name in ("sink", "recent"):
            v = getattr(self, name)
            if not (_is_int(v) and v >= 0):
                raise ValueError(f"{p}: {name} must be an int >= 0, got {v!r}")
        if self.kind == "recency" and self.sink:
            raise ValueError(f"{p}: sink must be 0 for kind='recency' (use 'streaming')")
        if self.kind in ("recency", "streaming") and self.recent:
            raise ValueError(
                f"{p}: recent must be 0 for kind={self.kind!r} (its budget is all recent)"
            )
        if not (_is_int(self.pool_size) and self.pool_size >= 1 and self.pool_size % 2 == 1):
            raise ValueError(f"{p}: pool_size must be an odd int >= 1, got {self.pool_size!r}")
        if self.pool_size > 1 and not self.uses_scores:
            raise ValueError(f"{p}: pool_size > 1 needs a scored kind, got {self.kind!r}")
        if self.pool not in ("max", "avg"):
            raise ValueError(f"{p}: pool must be 'max' or 'avg', got {self.pool!r}")
        if self.head_reduce not in ("sum", "max"):
            raise ValueError(f"{p}: head_reduce must be 'sum' or 'max', got {self.head_reduce!r}")

    @property
    def uses_scores(self) -> bool:
        """Whether :func:`update_policy_state` changes the state (H2O, SnapKV, TOVA)."""
        return self.kind in _SCORED_KINDS

    @property
    def budget_fraction(self) -> tuple[int, int] | None:
        """``(num, den)`` of a fractional budget, None for a count."""
        if _is_int(self.budget):
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


def budget_units(policy: RetentionPolicy, n_live: Int[Array, "*B"] | int) -> Int[Array, "*B"]:
    """The number of units kept out of ``n_live`` (jnp int array or numpy/int), capped by it.

    Example:
      >>> int(budget_units(RetentionPolicy("recency", 0.2, page_size=4), 11))
      3
    """
    xp = jnp if isinstance(n_live, jax.Array) else np
    n_live = xp.asarray(n_live, dtype=np.int32)
    frac = policy.budget_fraction
    if frac is None:
        k = xp.full_like(n_live, int(policy.budget))
    else:
        num, den = frac
        k = (n_live * num + (den - 1)) // den
    return xp.minimum(k, n_live)


def _check_policy(fn: str, policy) -> None:
    if not isinstance(policy, RetentionPolicy):
        raise ValueError(f"{fn}: policy must be a RetentionPolicy, got {type(policy).__name__}")


def init_policy_state(batch_size: int, num_units: int, *, policy: RetentionPolicy) -> PolicyState:
    """Zero scores for ``batch_size`` sequences of ``num_units`` units.

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
    for name, v in (("batch_size", batch_size), ("num_units", num_units)):
        if not (_is_int(v) and v >= 1):
            raise ValueError(f"{fn}: {name} must be an int >= 1, got {v!r}")
    return PolicyState(scores=jnp.zeros((int(batch_size), int(num_units)), jnp.float32))


def update_policy_state(
    state: PolicyState, mass: Float[Array, "B N U"], *, policy: RetentionPolicy
) -> PolicyState:
    """Folds one observation of attention mass into the state.

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
        raise ValueError(f"{fn}: mass must have shape [B={B}, N, U={U}], got {tuple(mass.shape)}")
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


def _check_lengths(fn, lengths, B):
    if lengths.ndim != 1 or lengths.shape[0] != B:
        raise ValueError(f"{fn}: lengths must have shape [B={B}], got {tuple(lengths.shape)}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{fn}: lengths must be integer, got {lengths.dtype}")


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

    Static shapes throughout (``jit`` with ``policy`` and ``mode`` static). Exactly
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
    if mode not in ("demote", "drop"):
        raise ValueError(f"{fn}: mode must be 'demote' or 'drop', got {mode!r}")
    scores = state.scores
    B, U = scores.shape
    _check_lengths(fn, lengths, B)
    if page_table is not None:
        if policy.granularity != "page":
            raise ValueError(f"{fn}: page_table needs granularity='page', got 'token'")
        if page_table.shape != (B, U) or not jnp.issubdtype(page_table.dtype, jnp.integer):
            raise ValueError(
                f"{fn}: page_table must be int [B={B}, U={U}], "
                f"got {page_table.dtype} {tuple(page_table.shape)}"
            )
    if pinned is not None and (pinned.shape != (B,) or pinned.dtype != jnp.bool_):
        raise ValueError(f"{fn}: pinned must be bool [B={B}], got {pinned.dtype} {pinned.shape}")

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


# --------------------------------------------------------------------------- token mass


def token_attention_mass(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    lengths: Int[Array, " B"],
    *,
    q_positions: Int[Array, "B T"] | None = None,
    causal: bool = True,
    scale: float | None = None,
) -> Float[Array, "B N S"]:
    """Dense attention probability per query head and key token, summed over the queries.

    The token-granular counterpart of ``paged_attention``'s ``page_mass``, for contiguous KV
    (``T x S`` logits are built: keep it to observation windows and small shapes).

    Args:
      q: ``[B, T, N, H]`` queries (the observation window, or the last query).
      k: ``[B, S, K, H]`` keys, ``N % K == 0``; keys at index ``>= lengths[b]`` are ignored.
      lengths: ``[B]`` int valid keys per sequence.
      q_positions: ``[B, T]`` int positions, default ``lengths - T + arange(T)`` (the last
        ``T`` tokens).
      causal: a query at position ``p`` sees keys at positions ``<= p``.
      scale: logit scale, default ``1 / sqrt(H)``.

    Returns:
      ``[B, N, S]`` float32; each query row that sees a key contributes total mass 1.

    Raises:
      ValueError: on inconsistent shapes or dtypes.

    Example:
      >>> q = jnp.ones((1, 2, 2, 4)); k = jnp.ones((1, 5, 1, 4))
      >>> token_attention_mass(q, k, jnp.array([4])).sum(-1).tolist()
      [[2.0, 2.0]]
    """
    fn = "token_attention_mass"
    if q.ndim != 4 or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"{fn}: q must be [B, T, N, H] and k [B, S, K, H] with matching B and H, "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    if N % K:
        raise ValueError(f"{fn}: q heads N={N} must be a multiple of k heads K={K}")
    _check_lengths(fn, lengths, B)
    lengths = lengths.astype(jnp.int32)
    if q_positions is None:
        q_positions = lengths[:, None] - T + jnp.arange(T, dtype=jnp.int32)[None]
    elif q_positions.shape != (B, T):
        raise ValueError(f"{fn}: q_positions must be [B={B}, T={T}], got {q_positions.shape}")
    scale = float(scale) if scale is not None else 1.0 / float(np.sqrt(H))
    return _token_mass_impl(
        q, k, lengths, q_positions.astype(jnp.int32), causal=causal, scale=scale
    )


@functools.partial(jax.jit, static_argnames=("causal", "scale"))
def _token_mass_impl(q, k, lengths, q_positions, *, causal, scale):
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None], (B, S))
    mask = attention_mask(q_positions, kv_pos, causal=causal)  # [B, T, S]
    mask &= kv_pos[:, None, :] < lengths[:, None, None]
    G = N // K
    qf = q.astype(jnp.float32).reshape(B, T, K, G, H)
    logits = jnp.einsum("btkgh,bskh->bkgts", qf, k.astype(jnp.float32)) * scale
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)  # [B, K, G, T, S]
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isneginf(m), 0.0, m))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    return jnp.sum(p, axis=3).reshape(B, N, S)  # [B, K, G, S] -> [B, N, S]
