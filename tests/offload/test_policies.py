"""Retention policies: selections against the numpy oracle, invariants, jit, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import (
    POLICY_KINDS,
    PolicyState,
    RetentionPolicy,
    budget_units,
    init_policy_state,
    select_keep,
    select_keep_reference,
    token_attention_mass,
    update_policy_state,
    update_policy_state_reference,
)
from tests._util import assert_close

select_jit = jax.jit(select_keep, static_argnames=("policy", "mode"))
update_jit = jax.jit(update_policy_state, static_argnames=("policy",))


def _sel_np(sel):
    return tuple(np.asarray(x) for x in sel)


def _assert_selection_equal(sel, ref):
    for name, a, b in zip(("keep", "demote", "drop", "retrieve"), _sel_np(sel), ref, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


def _state(scores):
    return PolicyState(scores=jnp.asarray(scores, jnp.float32))


def _kept(sel, b=0):
    return np.flatnonzero(np.asarray(sel.keep[b])).tolist()


# --------------------------------------------------------------------------- crafted patterns


def test_recency_keeps_latest_units():
    pol = RetentionPolicy("recency", 3, granularity="token")
    sel = select_keep(_state(np.zeros((2, 10))), jnp.array([7, 2]), policy=pol)
    assert _kept(sel, 0) == [4, 5, 6]
    assert _kept(sel, 1) == [0, 1]  # budget capped by the live units
    assert np.asarray(sel.demote[0]).nonzero()[0].tolist() == [0, 1, 2, 3]


def test_streaming_keeps_sinks_and_window_over_pages():
    pol = RetentionPolicy("streaming", 4, page_size=4, sink=1)
    # 30 tokens in pages of 4 -> 8 live slots.
    sel = select_keep(_state(np.zeros((1, 10))), jnp.array([30]), policy=pol)
    assert _kept(sel) == [0, 5, 6, 7]


def test_h2o_keeps_heavy_hitters_sinks_and_recent():
    pol = RetentionPolicy("h2o", 5, granularity="token", sink=1, recent=2)
    mass = np.full((1, 2, 12), 0.01, np.float32)
    mass[0, 0, 4] = 3.0  # heavy hitter seen by head 0
    mass[0, 1, 7] = 2.0  # heavy hitter seen by head 1
    mass[0, :, 9] = 0.5  # lighter than both
    state = init_policy_state(1, 12, policy=pol)
    state = update_policy_state(state, jnp.asarray(mass), policy=pol)
    state = update_policy_state(state, jnp.asarray(mass), policy=pol)  # accumulates
    np.testing.assert_allclose(np.asarray(state.scores[0, 4]), 2 * 3.01, rtol=1e-6)
    sel = select_keep(state, jnp.array([11]), policy=pol)
    # sink 0, recent 9 and 10 (the last two of 11 live), heavy 4 and 7.
    assert _kept(sel) == [0, 4, 7, 9, 10]


def test_tova_replaces_scores_with_last_query():
    pol = RetentionPolicy("tova", 2, granularity="token")
    state = init_policy_state(1, 6, policy=pol)
    first = np.zeros((1, 1, 6), np.float32)
    first[0, 0, [1, 2]] = 0.5
    second = np.zeros((1, 1, 6), np.float32)
    second[0, 0, [3, 5]] = 0.5
    state = update_policy_state(state, jnp.asarray(first), policy=pol)
    state = update_policy_state(state, jnp.asarray(second), policy=pol)
    assert _kept(select_keep(state, jnp.array([6]), policy=pol)) == [3, 5]


def test_snapkv_pooling_keeps_neighbourhoods():
    pol = RetentionPolicy("snapkv", 4, granularity="token", recent=1, pool_size=3)
    mass = np.zeros((1, 2, 12), np.float32)
    mass[0, 0, 3] = 1.0  # max-pooled onto 2, 3, 4
    mass[0, 1, 8] = 0.2
    state = update_policy_state(init_policy_state(1, 12, policy=pol), jnp.asarray(mass), policy=pol)
    # recent: 11; then 2, 3, 4 (score 1.0; ties to the later unit, all three fit).
    assert _kept(select_keep(state, jnp.array([12]), policy=pol)) == [2, 3, 4, 11]
    per_head = RetentionPolicy("snapkv", 2, granularity="token", head_reduce="max")
    mass2 = np.zeros((1, 2, 6), np.float32)
    mass2[0, 0] = [0.0, 0.9, 0.0, 0.0, 0.0, 0.6]
    mass2[0, 1] = [0.0, 0.0, 0.7, 0.0, 0.0, 0.6]
    state = update_policy_state(
        init_policy_state(1, 6, policy=per_head), jnp.asarray(mass2), policy=per_head
    )
    # max over heads: 1 (0.9) and 2 (0.7) beat 5 (0.6, though its head sum is 1.2).
    assert _kept(select_keep(state, jnp.array([6]), policy=per_head)) == [1, 2]


def _persistence_masses():
    """Token 1 is heavy once, then barely attended; token 2 is moderately attended (above the
    mean) at every step; token 0 is a sink; 12 tokens, one head."""
    first = np.full((1, 1, 12), 0.005, np.float32)
    first[0, 0, 1] = 0.85  # once-heavy
    first[0, 0, 2] = 0.1  # persistent, above the mean 1/12
    later = np.full((1, 1, 12), 0.295 / 9, np.float32)
    later[0, 0, 0] = 0.6  # the sink
    later[0, 0, 1] = 0.005  # no longer attended
    later[0, 0, 2] = 0.1  # still above the mean
    return [first, later, later, later]


def test_scissorhands_keeps_persistent_token_where_h2o_keeps_once_heavy():
    masses = _persistence_masses()
    lengths = jnp.array([12])
    kept = {}
    for kind in ("h2o", "scissorhands"):
        pol = RetentionPolicy(kind, 3, granularity="token", sink=1, recent=1)
        state = init_policy_state(1, 12, policy=pol)
        for m in masses:
            state = update_policy_state(state, jnp.asarray(m), policy=pol)
        kept[kind] = _kept(select_keep(state, lengths, policy=pol))
        if kind == "scissorhands":
            # Counts of important observations: token 1 once, token 2 every step, the sink
            # in the three later steps; the rest never reach the mean.
            expected = np.zeros(12, np.float32)
            expected[[0, 1, 2]] = [3.0, 1.0, 4.0]
            np.testing.assert_array_equal(np.asarray(state.scores[0]), expected)
    # H2O's accumulated mass: token 1 has 0.865 > token 2's 0.4, so it keeps the stale token.
    assert kept["h2o"] == [0, 1, 11]
    # Scissorhands: token 2 (important 4 times) beats token 1 (once): persistence wins.
    assert kept["scissorhands"] == [0, 2, 11]


def test_scissorhands_history_decays_counts_exactly():
    pol = RetentionPolicy("scissorhands", 1, granularity="token", history=2)
    assert pol.decay == 0.5
    a = np.array([[[1.0, 0.1, 0.1]]], np.float32)  # token 0 important
    b = np.array([[[0.1, 0.1, 1.0]]], np.float32)  # token 2 important
    state = init_policy_state(1, 3, policy=pol)
    for m in (a, a, a, b, b):
        state = update_policy_state(state, jnp.asarray(m), policy=pol)
    # token 0: (1 + 0.5 + 0.25) * 0.25 = 0.4375; token 2: 1 + 0.5 = 1.5.
    np.testing.assert_array_equal(np.asarray(state.scores[0]), [0.4375, 0.0, 1.5])
    assert _kept(select_keep(state, jnp.array([3]), policy=pol)) == [2]
    # Without a history window the counts never decay: token 0's 3 beats token 2's 2.
    plain = RetentionPolicy("scissorhands", 1, granularity="token")
    state = init_policy_state(1, 3, policy=plain)
    for m in (a, a, a, b, b):
        state = update_policy_state(state, jnp.asarray(m), policy=plain)
    np.testing.assert_array_equal(np.asarray(state.scores[0]), [3.0, 0.0, 2.0])
    assert _kept(select_keep(state, jnp.array([3]), policy=plain)) == [0]
    # history=1: only the last observation counts.
    last = RetentionPolicy("scissorhands", 1, granularity="token", history=1)
    state = init_policy_state(1, 3, policy=last)
    for m in (a, a, b):
        state = update_policy_state(state, jnp.asarray(m), policy=last)
    np.testing.assert_array_equal(np.asarray(state.scores[0]), [0.0, 0.0, 1.0])


def test_scissorhands_masked_units_empty_rows_ties_and_nan():
    pol = RetentionPolicy("scissorhands", 2, granularity="token")
    mass = np.zeros((5, 2, 5), np.float32)
    mass[0, 0, :3] = [0.2, 0.5, 0.3]  # units 3, 4 masked (mass 0): not in the mean
    mass[1] = 0.0  # no unit takes part: nothing important, no NaN
    mass[2, :, :3] = 0.1  # equal masses: all three important (the mean is capped at the max)
    mass[3, 0, :3] = [0.2, 0.3, 0.4]
    mass[3, 1, 1] = np.nan  # a NaN in a unit taking part (head 0 > 0): the row counts nothing
    mass[4, 0, :3] = [0.2, np.nan, 0.4]  # NaN is not > 0: unit 1 takes no part (mean 0.3)
    state = update_policy_state(init_policy_state(5, 5, policy=pol), jnp.asarray(mass), policy=pol)
    expected = [[0, 1, 0, 0, 0], [0] * 5, [1, 1, 1, 0, 0], [0] * 5, [0, 0, 1, 0, 0]]
    np.testing.assert_array_equal(np.asarray(state.scores), expected)
    ref = update_policy_state_reference(np.zeros((5, 5)), mass, policy=pol)
    np.testing.assert_array_equal(ref, expected)
    # Row 0: the mean is over the 3 units taking part (1/3), so only unit 1 is important; had
    # the masked units been counted (mean 1/5), units 0 and 2 would have been important too.


def test_scissorhands_random_steps_match_reference():
    """Several steps of unquantised mass with masked units (mass 0 past each length), garbage
    scores in the non-live units, pinned rows, both granularities and modes, sinks/recent."""
    rng = np.random.default_rng(7)
    B, N, U = 5, 3, 10
    for index, policy in enumerate(
        [
            RetentionPolicy("scissorhands", 0.4, granularity="token", sink=1, recent=2),
            RetentionPolicy("scissorhands", 3, page_size=3, sink=2, recent=1, history=4),
            RetentionPolicy(
                "scissorhands", 4, granularity="token", history=2, pool_size=3, pool="avg"
            ),
            RetentionPolicy("scissorhands", 0.3, page_size=2, head_reduce="max", history=7),
        ]
    ):
        C = policy.page_size or 1
        lengths = np.array([0, 1, 3 * C + 1, 7 * C, U * C], np.int32)
        n_units = -(-lengths // C)
        table = None
        if policy.granularity == "page":
            table = rng.permutation(np.arange(1, B * U + 1)).reshape(B, U).astype(np.int32)
            table[4, [2, 5]] = 0  # holes
            table = jnp.asarray(table)
        pinned = jnp.array([False, True, False, False, index % 2 == 0])
        state = init_policy_state(B, U, policy=policy)
        # Garbage (finite) scores in the non-live units: they must not matter.
        garbage = np.where(np.arange(U)[None] >= n_units[:, None], 1e6, 0.0)
        state = PolicyState(scores=state.scores + jnp.asarray(garbage, jnp.float32))
        ref_scores = np.asarray(state.scores)
        for step in range(5):
            mass = rng.random((B, N, U)).astype(np.float32) ** 3
            mass *= (np.arange(U)[None] < n_units[:, None])[:, None, :]
            if step == 2:
                mass[3] = 0.0  # a step in which row 3 sees nothing
            state = update_jit(state, jnp.asarray(mass), policy=policy)
            ref_scores = update_policy_state_reference(ref_scores, mass, policy=policy)
            assert_close(state.scores, ref_scores, dtype=jnp.float32, what=f"scores {step}")
            for mode in ("demote", "drop", "retrieve"):
                args = dict(policy=policy, page_table=table, pinned=pinned, mode=mode)
                sel = select_jit(state, jnp.asarray(lengths), **args)
                _assert_selection_equal(sel, select_keep_reference(ref_scores, lengths, **args))
        assert np.all(np.isfinite(np.asarray(state.scores)))


def test_null_pages_and_pinned():
    pol = RetentionPolicy("recency", 2, page_size=2)
    table = jnp.array([[5, 3, 0, 9, 0], [1, 2, 3, 4, 6]], jnp.int32)
    lengths = jnp.array([10, 7])
    sel = select_keep(
        _state(np.zeros((2, 5))),
        lengths,
        policy=pol,
        page_table=table,
        pinned=jnp.array([0, 1]) > 0,
    )
    assert _kept(sel, 0) == [1, 3]  # slots 2 and 4 hold the null page
    assert _kept(sel, 1) == [0, 1, 2, 3]  # pinned: all 4 live slots (7 tokens)
    assert not np.asarray(sel.demote[1]).any()


def test_fraction_budget_is_exact_integer_ceil():
    pol = RetentionPolicy("recency", 0.1, granularity="token")
    assert budget_units(pol, 30) == 3  # 0.1 * 30 is 3.0000000000000004 in float64
    assert int(budget_units(pol, jnp.int32(31))) == 4
    assert budget_units(RetentionPolicy("recency", 1.0, granularity="token"), 7) == 7
    assert budget_units(RetentionPolicy("recency", 0, granularity="token"), 7) == 0


def test_drop_mode_reports_drop_not_demote():
    pol = RetentionPolicy("recency", 1, granularity="token")
    sel = select_keep(_state(np.zeros((1, 4))), jnp.array([3]), policy=pol, mode="drop")
    assert not np.asarray(sel.demote).any() and not np.asarray(sel.retrieve).any()
    assert np.asarray(sel.drop[0]).nonzero()[0].tolist() == [0, 1]
    sel = select_keep(_state(np.zeros((1, 4))), jnp.array([3]), policy=pol, mode="retrieve")
    assert not (np.asarray(sel.demote) | np.asarray(sel.drop)).any()
    assert np.asarray(sel.retrieve[0]).nonzero()[0].tolist() == [0, 1]
    with pytest.raises(ValueError, match="mode"):
        select_keep(_state(np.zeros((1, 4))), jnp.array([3]), policy=pol, mode="fetch")


# --------------------------------------------------------------------------- random vs numpy

POLICIES = [
    RetentionPolicy("recency", 0.3, page_size=4),
    RetentionPolicy("streaming", 5, granularity="token", sink=2),
    RetentionPolicy("h2o", 0.5, page_size=4, sink=1, recent=2),
    RetentionPolicy("snapkv", 4, granularity="token", recent=2, pool_size=3, pool="avg"),
    RetentionPolicy("snapkv", 0.25, page_size=2, pool_size=5, head_reduce="max"),
    RetentionPolicy("tova", 3, granularity="token"),
    RetentionPolicy("scissorhands", 4, granularity="token", sink=1, recent=2),
    RetentionPolicy("scissorhands", 0.5, page_size=2, recent=1, history=3, pool_size=3),
]


@pytest.mark.parametrize("index", range(len(POLICIES)), ids=lambda i: str(POLICIES[i].kind))
@pytest.mark.parametrize("jit", [False, True])
def test_random_matches_reference(index, jit):
    policy = POLICIES[index]
    mode = ("demote", "drop", "retrieve")[(index + jit) % 3]  # every mode over the policies
    rng = np.random.default_rng(0)
    B, N, U = 4, 2, 12
    C = policy.page_size or 1
    lengths = jnp.array([0, 1, C + 1, U * C], jnp.int32)
    table = None
    if policy.granularity == "page":
        table = jnp.asarray(rng.permutation(np.arange(1, B * U + 1)).reshape(B, U), jnp.int32)
        table = table.at[3, 4].set(0)  # a hole
    pinned = jnp.array([False, False, True, False])
    update = update_jit if jit else update_policy_state
    select = select_jit if jit else select_keep
    state = init_policy_state(B, U, policy=policy)
    ref_scores = np.zeros((B, U), np.float32)
    for _ in range(2):
        mass = rng.random((B, N, U)).astype(np.float32)
        # Quantised mass gives exact ties, so the tie-break is exercised too.
        mass = np.round(mass * 4) / 4
        state = update(state, jnp.asarray(mass), policy=policy)
        ref_scores = update_policy_state_reference(ref_scores, mass, policy=policy)
    assert_close(state.scores, ref_scores, dtype=jnp.float32, what="scores")
    sel = select(state, lengths, policy=policy, page_table=table, pinned=pinned, mode=mode)
    ref = select_keep_reference(
        state.scores, lengths, policy=policy, page_table=table, pinned=pinned, mode=mode
    )
    _assert_selection_equal(sel, ref)
    eager = select_keep(state, lengths, policy=policy, page_table=table, pinned=pinned, mode=mode)
    _assert_selection_equal(eager, _sel_np(sel))


@pytest.mark.parametrize(
    "pol",
    [
        RetentionPolicy("h2o", 3, granularity="token", sink=1, recent=1),
        RetentionPolicy("scissorhands", 3, granularity="token", sink=1, recent=1, history=2),
    ],
    ids=lambda p: p.kind,
)
def test_vmap_over_layers_matches_per_layer(pol):
    rng = np.random.default_rng(1)
    L, B, N, U, steps = 3, 2, 2, 8, 3
    mass = jnp.asarray(rng.random((steps, L, B, N, U)), jnp.float32)
    lengths = jnp.array([8, 5])
    update = jax.jit(jax.vmap(functools.partial(update_policy_state, policy=pol)))
    select = jax.jit(jax.vmap(lambda s: select_keep(s, lengths, policy=pol)))
    states = jax.vmap(lambda _: init_policy_state(B, U, policy=pol))(jnp.arange(L))
    for t in range(steps):
        states = update(states, mass[t])
    sels = select(states)
    for layer in range(L):
        one = init_policy_state(B, U, policy=pol)
        for t in range(steps):
            one = update_policy_state(one, mass[t, layer], policy=pol)
        np.testing.assert_allclose(np.asarray(states.scores[layer]), np.asarray(one.scores))
        ref = select_keep_reference(one.scores, lengths, policy=pol)
        _assert_selection_equal(jax.tree.map(lambda x, i=layer: x[i], sels), ref)


# --------------------------------------------------------------------------- invariants

B_H, U_H = 3, 8


@st.composite
def _cases(draw):
    kind = draw(st.sampled_from(POLICY_KINDS))
    granularity = draw(st.sampled_from(["page", "token"]))
    if draw(st.booleans()):
        budget = draw(st.integers(0, U_H + 2))
    else:
        budget = draw(st.sampled_from([0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0]))
    sink = draw(st.integers(0, 3)) if kind != "recency" else 0
    recent = draw(st.integers(0, 3)) if kind not in ("recency", "streaming") else 0
    page_size = draw(st.integers(1, 3)) if granularity == "page" else None
    policy = RetentionPolicy(
        kind, budget, granularity=granularity, page_size=page_size, sink=sink, recent=recent
    )
    C = page_size or 1
    lengths = draw(st.lists(st.integers(0, U_H * C), min_size=B_H, max_size=B_H))
    scores = draw(
        st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5]), min_size=B_H * U_H, max_size=B_H * U_H)
    )
    pinned = draw(st.lists(st.booleans(), min_size=B_H, max_size=B_H))
    table = None
    if granularity == "page":
        holes = draw(st.lists(st.booleans(), min_size=B_H * U_H, max_size=B_H * U_H))
        table = np.where(np.array(holes), 0, np.arange(1, B_H * U_H + 1)).reshape(B_H, U_H)
    mode = draw(st.sampled_from(["demote", "drop", "retrieve"]))
    return policy, np.array(lengths), np.array(scores).reshape(B_H, U_H), pinned, table, mode


@settings(max_examples=30, deadline=None)
@given(_cases())
def test_selection_invariants(case):
    policy, lengths, scores, pinned, table, mode = case
    pinned = np.array(pinned)
    # Eager: every example has its own (static) policy, so jit would recompile each time.
    sel = select_keep(
        _state(scores),
        jnp.asarray(lengths, jnp.int32),
        policy=policy,
        page_table=None if table is None else jnp.asarray(table, jnp.int32),
        pinned=jnp.asarray(pinned),
        mode=mode,
    )
    keep, demote, drop, retrieve = _sel_np(sel)
    C = policy.page_size or 1
    idx = np.arange(U_H)[None]
    live = idx < -(-lengths[:, None] // C)
    if table is not None:
        live &= table != 0
    evicted = demote | drop | retrieve
    np.testing.assert_array_equal(keep | evicted, live)  # keep ∪ demote = live
    assert not (keep & evicted).any() and not (demote & drop).any()  # disjoint
    assert not ((demote & retrieve).any() or (drop & retrieve).any())
    moved = {"demote": demote, "drop": drop, "retrieve": retrieve}
    np.testing.assert_array_equal(moved.pop(mode), evicted)  # the evicted go to the mode's mask
    assert not any(m.any() for m in moved.values())
    n_live = live.sum(-1)
    expected = np.where(pinned, n_live, budget_units(policy, n_live))
    np.testing.assert_array_equal(keep.sum(-1), expected)  # budget respected exactly
    assert not evicted[pinned].any()  # pinned never demoted
    ref = select_keep_reference(
        scores, lengths, policy=policy, page_table=table, pinned=pinned, mode=mode
    )
    _assert_selection_equal(sel, ref)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(kind="lru", budget=1), "kind: expected one of"),
        (dict(kind="recency", budget=-1, page_size=1), "budget: expected an int >= 0, got -1"),
        (
            dict(kind="recency", budget=1.5, page_size=1),
            r"budget: expected a float in \(0.0, 1.0\]",
        ),
        (
            dict(kind="recency", budget=0.0, page_size=1),
            r"budget: expected a float in \(0.0, 1.0\]",
        ),
        (dict(kind="recency", budget=True, page_size=1), "budget: expected an int count"),
        (dict(kind="recency", budget=float("nan"), page_size=1), "budget: expected a finite float"),
        (dict(kind="recency", budget=1, granularity="head"), "granularity: expected one of"),
        (dict(kind="recency", budget=1), "page_size: expected an int >= 1"),
        (
            dict(kind="recency", budget=1, page_size=2.0),
            "page_size: expected an int >= 1, got float",
        ),
        (
            dict(kind="recency", budget=1, granularity="token", page_size=2),
            "page_size: expected None",
        ),
        (dict(kind="h2o", budget=1, page_size=1, sink=-1), "sink: expected an int >= 0"),
        (dict(kind="h2o", budget=1, page_size=1, recent=1.5), "recent: expected an int >= 0"),
        (dict(kind="h2o", budget=1, page_size=1, recent=False), "recent: expected an int >= 0"),
        (
            dict(kind="recency", budget=1, page_size=1, sink=1),
            "sink: expected 0 for kind='recency'",
        ),
        (dict(kind="streaming", budget=1, page_size=1, recent=1), "recent: expected 0"),
        (dict(kind="snapkv", budget=1, page_size=1, pool_size=2), "pool_size: expected an odd"),
        (dict(kind="streaming", budget=1, page_size=1, pool_size=3), "pool_size: expected 1 for"),
        (dict(kind="snapkv", budget=1, page_size=1, pool="min"), "pool: expected one of"),
        (dict(kind="tova", budget=1, page_size=1, head_reduce="mean"), "head_reduce: expected one"),
        (
            dict(kind="scissorhands", budget=1, page_size=1, history=0),
            "history: expected an int >= 1, got 0",
        ),
        (
            dict(kind="scissorhands", budget=1, page_size=1, history=2.0),
            "history: expected an int >= 1, got float",
        ),
        (
            dict(kind="scissorhands", budget=1, page_size=1, history=True),
            "history: expected an int >= 1, got bool",
        ),
        (
            dict(kind="h2o", budget=1, page_size=1, history=4),
            "history: expected None for kind='h2o'",
        ),
        (
            dict(kind="recency", budget=1, page_size=1, history=1),
            "history: expected None for kind='recency'",
        ),
    ],
)
@pytest.mark.no_typecheck
def test_policy_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RetentionPolicy(**kwargs)


def test_policy_accepts_numpy_scalars_and_normalises():
    pol = RetentionPolicy(
        "h2o", np.float32(0.5), page_size=np.int64(4), sink=np.int32(1), recent=np.int8(2)
    )
    assert pol == RetentionPolicy("h2o", 0.5, page_size=4, sink=1, recent=2)
    assert hash(pol) == hash(RetentionPolicy("h2o", 0.5, page_size=4, sink=1, recent=2))
    assert type(pol.sink) is int and type(pol.budget) is float
    assert RetentionPolicy("recency", np.int64(3), granularity="token").budget == 3
    state = init_policy_state(np.int64(2), np.int32(4), policy=pol)
    assert state.scores.shape == (2, 4)
    assert budget_units(pol, np.int64(7)) == 4
    sc = RetentionPolicy("scissorhands", 2, granularity="token", history=np.int64(8))
    assert type(sc.history) is int and sc.history == 8 and sc.decay == 1.0 - 1.0 / 8
    assert hash(sc) == hash(RetentionPolicy("scissorhands", 2, granularity="token", history=8))
    assert RetentionPolicy("scissorhands", 2, granularity="token").decay == 1.0
    assert sc.uses_scores


@pytest.mark.no_typecheck
def test_function_errors():
    pol = RetentionPolicy("h2o", 2, page_size=2)
    tok = RetentionPolicy("h2o", 2, granularity="token")
    state = init_policy_state(2, 4, policy=pol)
    lengths = jnp.array([3, 4])
    with pytest.raises(ValueError, match="policy: expected a RetentionPolicy"):
        init_policy_state(2, 4, policy="h2o")
    with pytest.raises(ValueError, match="policy: expected a RetentionPolicy"):
        update_policy_state(state, jnp.zeros((2, 1, 4)), policy=None)
    with pytest.raises(ValueError, match="policy: expected a RetentionPolicy"):
        select_keep(state, lengths, policy=None)
    with pytest.raises(ValueError, match="batch_size: expected an int >= 1"):
        init_policy_state(0, 4, policy=pol)
    with pytest.raises(ValueError, match="num_units: expected an int >= 1, got float"):
        init_policy_state(2, 4.0, policy=pol)
    with pytest.raises(ValueError, match=r"mass: expected shape \[B=2, N, U=4\]"):
        update_policy_state(state, jnp.zeros((2, 5)), policy=pol)
    with pytest.raises(ValueError, match="mode: expected one of"):
        select_keep(state, lengths, policy=pol, mode="evict")
    with pytest.raises(ValueError, match=r"lengths: expected int \[B=2\]"):
        select_keep(state, jnp.array([3]), policy=pol)
    with pytest.raises(ValueError, match=r"lengths: expected int \[B=2\], got .*float32"):
        select_keep(state, jnp.array([3.0, 4.0]), policy=pol)
    with pytest.raises(ValueError, match="page_table: expected int"):
        select_keep(state, lengths, policy=pol, page_table=jnp.ones((2, 5), jnp.int32))
    with pytest.raises(ValueError, match="page_table: expected None for granularity='token'"):
        select_keep(state, lengths, policy=tok, page_table=jnp.ones((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="pinned: expected bool"):
        select_keep(state, lengths, policy=pol, pinned=jnp.array([1, 0]))
    q = jnp.zeros((1, 2, 3, 4))
    with pytest.raises(ValueError, match="k: expected"):
        token_attention_mass(q, jnp.zeros((1, 5, 1, 8)), jnp.array([5]))
    with pytest.raises(ValueError, match="k: expected kv heads K >= 1 dividing q heads"):
        token_attention_mass(q, jnp.zeros((1, 5, 2, 4)), jnp.array([5]))
    with pytest.raises(ValueError, match="lengths: expected int"):
        token_attention_mass(q, jnp.zeros((1, 5, 1, 4)), jnp.array([5, 5]))
    with pytest.raises(ValueError, match="q_positions: expected shape"):
        token_attention_mass(
            q, jnp.zeros((1, 5, 1, 4)), jnp.array([5]), q_positions=jnp.zeros((1, 3), jnp.int32)
        )
