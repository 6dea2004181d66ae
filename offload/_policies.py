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

================  ===========================================================================
``recency``       the ``budget`` most recent units (no scores).
``streaming``     StreamingLLM: ``sink`` first units, the rest of the budget most recent.
``h2o``           H2O: ``sink`` + ``recent`` units, the rest by *accumulated* attention mass.
``snapkv``        SnapKV: scores *replaced* by the (pooled) attention mass of an observation
                  window of last queries, fed once at the end of prefill; ``recent`` should
                  cover the observation window.
``tova``          TOVA: scores *replaced* at each step by the last query's attention.
``scissorhands``  Scissorhands: scores *count* the observations in which the unit was
                  *important* (see below), optionally over a decaying history window;
                  ``recent`` is the paper's always-kept recent window.
================  ===========================================================================

Scissorhands (the persistence of importance: a token that mattered in many recent steps keeps
mattering). At each :func:`update_policy_state` call, with ``m [B, U]`` the mass pooled and
head-reduced exactly as for the other scored kinds:

* a unit *takes part* in the observation when its raw mass is ``> 0`` in at least one head
  (before pooling; NaN is not ``> 0``): masked and padded units, whose mass is exactly 0, take
  no part and are never important (nor are units whose attention underflowed to 0);
* the threshold of row ``b`` is ``min(mean, top)``: ``mean`` is the float32 sum of ``m`` over
  the taking-part units divided by their count, ``top`` the largest such ``m`` (the cap keeps
  the largest unit important even when the float32 mean of equal masses rounds above them);
* a taking-part unit is *important* when ``m >= threshold``; a row with no taking-part unit
  (or with a NaN among its taking-part masses) has no important unit, and never a NaN or a
  division by zero: the scores stay finite counts;
* ``scores = decay * scores + important`` with ``decay = 1 - 1 / history`` (``1`` when
  ``history`` is None: plain counts).

Deviations from the paper (Liu et al., 2023), which counts per token how often, within the last
``w`` decode steps, its attention fell *below* an importance threshold and evicts the tokens
counted unimportant most often (keeping a recent window): (a) the score counts *important*
observations (higher = keep) so it ranks like every other scored kind; a unit younger than the
history therefore has fewer observations and ranks low rather than high, so cover young units
with ``recent`` (the paper also always keeps a recent window); (b) the threshold is this
library's choice, the row's mean (the uniform share of the observed mass), capped as above; (c)
the exact sliding window of ``w`` steps is replaced by an exponential decay with the same total
weight (a unit important at every step tends to ``history``), since the state is one ``[B, U]``
array; (d) the mean is over the units taking part (mass ``> 0``), not over every token of the
context, and pages (``granularity="page"``) are judged by their summed mass like tokens; (e) the
selection runs whenever :func:`select_keep` is called, with the shared ordering above, not only
when a buffer fills.

Heads share one page table, so a selection is per sequence, not per head: ``head_reduce="sum"``
ranks by attention summed over query heads (H2O, TOVA), ``"max"`` by the largest per-head
mass (SnapKV's per-head top-k, made budget-exact: a unit that any head needs ranks high).

Pages shared between rows (a prefix-cache hit, a fork: one page id in several rows of
``page_table``) are kept by every row holding them as soon as one of those rows keeps them
(:func:`keep_shared_pages`): a page is evicted only when every row of the batch holding it
evicts it, so evicting it (scrubbing, freeing, reusing its device copy) never changes what a
keeping row reads. Such a row may keep more units than its budget.

A pinned request (``pinned[b]``) keeps every live unit. ``mode="demote"`` (default) returns the
evicted units as ``demote`` for the tier layer; ``mode="drop"`` as ``drop``; ``mode="retrieve"``
as ``retrieve``: they go to pinned host like demoted units, but keep their key bounds on the
device (:func:`offload.retrieval.with_host_bounds`) and stay candidates of every decode step's
query-aware selection (:func:`offload.retrieval.retrieval_decode_attention`), instead of being fetched
back wholesale or not at all.

References:
  Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (StreamingLLM), 2023;
  Zhang et al., "H2O: Heavy-Hitter Oracle", 2023; Li et al., "SnapKV", 2024;
  Oren et al., "Transformers are Multi-State RNNs" (TOVA), 2024; Liu et al., "Scissorhands:
  Exploiting the Persistence of Importance Hypothesis for LLM KV Cache Compression at Test
  Time", 2023.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from offload._checks import check_choice, check_int, check_lengths
from offload._retention import RetentionPolicy
from offload._shared_pages import keep_shared_pages

__all__ = [
    "PolicyState",
    "Selection",
    "init_policy_state",
    "select_keep",
    "update_policy_state",
]


class PolicyState(NamedTuple):
    """Per-sequence unit scores of one layer.

    Attributes:
      scores: ``[B, U]`` float32: accumulated mass (H2O), last pooled observation-window mass
        (SnapKV), last query's mass (TOVA), the (decayed) count of important observations
        (Scissorhands), zeros for ``recency``/``streaming``.
    """

    scores: Float[Array, "B U"]


class Selection(NamedTuple):
    """Disjoint masks over the units, whose union is the live units.

    Attributes:
      keep: ``[B, U]`` bool, stays on the device.
      demote: ``[B, U]`` bool, leaves the device for host or disk (``mode="demote"``).
      drop: ``[B, U]`` bool, discarded (``mode="drop"``).
      retrieve: ``[B, U]`` bool, leaves the device for pinned host with its key bounds kept
        on the device, read back per step when a query selects it (``mode="retrieve"``).
        Always set by :func:`select_keep` (all False in the other modes); None only in a
        ``Selection`` built by hand with three fields.
    """

    keep: Bool[Array, "B U"]
    demote: Bool[Array, "B U"]
    drop: Bool[Array, "B U"]
    retrieve: Bool[Array, "B U"] | None = None


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
        query of every step, SnapKV the observation window once at the end of prefill,
        Scissorhands every decode step (masked units must have mass exactly 0).

    Returns:
      The new state: H2O adds the pooled, head-reduced mass; SnapKV and TOVA replace the
      scores with it; Scissorhands decays the scores and adds 1 for each important unit (the
      rule is in the module docstring); ``recency`` and ``streaming`` return ``state``
      unchanged.

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
    rule = {"h2o": "add", "scissorhands": "count"}.get(policy.kind, "replace")
    return PolicyState(
        scores=_update_impl(
            state.scores,
            mass,
            rule=rule,
            decay=policy.decay,
            pool_size=policy.pool_size,
            pool=policy.pool,
            head_reduce=policy.head_reduce,
        )
    )


@functools.partial(jax.jit, static_argnames=("rule", "decay", "pool_size", "pool", "head_reduce"))
def _update_impl(scores, mass, *, rule, decay, pool_size, pool, head_reduce):
    """Pools each head's mass along the units, reduces over heads, then adds (``"add"``),
    replaces (``"replace"``) or counts the important units (``"count"``, Scissorhands)."""
    mass = mass.astype(jnp.float32)
    taking_part = jnp.any(mass > 0, axis=1)  # [B, U], before pooling
    w = pool_size
    if w > 1:
        pad = ((0, 0), (0, 0), (w // 2, w // 2))
        if pool == "max":
            mass = jax.lax.reduce_window(mass, -jnp.inf, jax.lax.max, (1, 1, w), (1, 1, 1), pad)
        else:
            mass = jax.lax.reduce_window(mass, 0.0, jax.lax.add, (1, 1, w), (1, 1, 1), pad) / w
    reduced = jnp.sum(mass, axis=1) if head_reduce == "sum" else jnp.max(mass, axis=1)
    if rule == "add":
        return scores + reduced
    if rule == "replace":
        return reduced
    count = jnp.sum(taking_part, axis=-1, keepdims=True, dtype=jnp.float32)
    total = jnp.sum(jnp.where(taking_part, reduced, 0.0), axis=-1, keepdims=True)
    mean = total / jnp.maximum(count, 1.0)
    top = jnp.max(jnp.where(taking_part, reduced, -jnp.inf), axis=-1, keepdims=True)
    important = taking_part & (reduced >= jnp.minimum(mean, top))
    return scores * jnp.float32(decay) + important.astype(jnp.float32)


def units_by_length(policy: RetentionPolicy, lengths):
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
    docstring and is deterministic (ties go to the later unit). With a ``page_table``, a page
    id held by several rows is kept in all of them when any of them keeps it (those rows may
    then keep more than the budget; see :func:`keep_shared_pages`).

    Args:
      state: :class:`PolicyState` with ``scores [B, U]``.
      lengths: ``[B]`` int tokens per sequence; units past ``ceil(len / C)`` (pages) or
        ``len`` (tokens) are never selected.
      policy: the :class:`RetentionPolicy`.
      page_table: optional ``[B, U]`` int page ids (``U = M``); slots holding the null page 0
        are not live; a page id in several rows is shared (kept by all if kept by one). Only
        for ``granularity="page"``. Pass it whenever rows may share pages (a prefix cache,
        forks): without it each row is selected alone.
      pinned: optional ``[B]`` bool; a pinned sequence keeps every live unit.
      mode: ``"demote"`` (evicted units go to ``demote``), ``"drop"`` (to ``drop``) or
        ``"retrieve"`` (to ``retrieve``: see the module docstring).

    Returns:
      A :class:`Selection` of four ``[B, U]`` bool masks: disjoint, union = live units.

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
    check_choice(fn, "mode", mode, ("demote", "drop", "retrieve"))
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
    if page_table is not None:  # a page kept by any row holding it stays for all of them
        live = keep | evicted
        keep = live & keep_shared_pages(page_table, keep)
        evicted = live & ~keep
    none = jnp.zeros_like(keep)
    return Selection(
        keep=keep,
        demote=evicted if mode == "demote" else none,
        drop=evicted if mode == "drop" else none,
        retrieve=evicted if mode == "retrieve" else none,
    )


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
